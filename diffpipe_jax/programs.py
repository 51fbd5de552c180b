"""A function of unrolled layers run as a sequence of programs rather than one.

XLA compiles a program of every unrolled layer of a full-size model in minutes: most of that
time grows with the program's size. Here the function is traced once per argument shapes and cut
at its calls of functions made by `cut_point` (a model's block): each call is a piece whose
programs every layer of a stack shares, and each stretch of work between calls (the embedders, the loss) is a piece of its own.
`per_block` runs the pieces' programs in order; `value_and_grad` runs each piece's forward program
(which returns its residuals) in order, then the backward programs in reverse. Every program is
called from Python through jit's own dispatch, so the GPU runs them back to back while Python
dispatches the next ones ahead (as fast as one program: benchmarks/HISTORY.md, "LoRA step:
the unrolled step split into programs per block").

A block call under `jax.checkpoint` (per-block remat) keeps the residuals its policy saves; an
input in pinned host memory (a swapped block's frozen weights) is copied to the device a few
programs before the program that reads it (`_HostCopies`), forward and backward. With
`offload`, a block's input that only its backward program reads again waits in pinned host
memory too, copied back the same way.

`ahead_of_calls` takes the values a function marks `ahead` out of a loop of its calls: one
program computes them for every call at once.
"""
import collections
import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core
# jax.checkpoint's own split of a jaxpr into what is known and what is not (`ahead_of_calls`)
from jax._src.interpreters import partial_eval


CUT_PREFIX = "programs_cut_point__"  # the jit name of a function made by `cut_point`
KEPT = "programs_kept"  # the checkpoint name of the values a forward program keeps (`keep`)
AHEAD = "programs_ahead"  # the checkpoint name of the values computed ahead of calls (`ahead`)
# XLA's dot merger joins the matmuls that read one operand into one matmul of the others'
# concatenation: the Linears that read one input (q, k, v; the MLP's input), whose kernels it
# copies at every call, and in a backward pass the products of a Linear of parts with one
# cotangent, whose activations it copies (BENCHMARKS.md#deviceless; benchmarks/HISTORY.md,
# "Sampling and the step: the weight copies XLA added"). Off for every program here, and for the
# scanned training step where the Linears add their biases to their LoRAs' outputs
# (benchmarks/HISTORY.md, "The bias beside the LoRA, the modulations ahead").
WITHOUT_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}
# How every program compiles: without the dot merger, and without XLA's CUDA graphs (command
# buffers): a program runs once per layer, each time on other buffers, and a graph is updated for
# new buffers at each call, which costs the host more than the kernel launches it saves
# (benchmarks/HISTORY.md, "LoRA step: fewer kernels and arrays between the block programs").
JIT_OPTIONS = dict(compiler_options={"xla_gpu_enable_command_buffer": "", **WITHOUT_DOT_MERGER})


def cut_point(fn, **jit_options):
  """fn jitted (`jit_options` as jax.jit takes them): inlined where the caller is jitted whole,
  and a piece of its own, shared by every call of it, where `per_block` or `value_and_grad` runs
  the caller."""
  def piece(*args, **kwargs):
    return fn(*args, **kwargs)
  piece.__name__ = piece.__qualname__ = CUT_PREFIX + fn.__name__
  return jax.jit(piece, **jit_options)


def keep(x):
  """x, kept for the backward program by `keeps_for_backward`: a model marks the outputs that
  the backward pass would otherwise recompute by a matmul (a Linear's output, its base and LoRA
  matmuls already summed; the LoRA's rank-sized down projection, small, but a kernel launch)."""
  return checkpoint_name(x, KEPT)


def saves_attention(prim, *_, **params) -> bool:
  """Whether a primitive is cuDNN attention's forward, whose outputs (the output and the softmax
  statistics, what its backward reads) a residual policy keeps so that the backward pass does
  not run the attention forward again (XLA's attention, off the GPU, has none)."""
  return prim.name.startswith("dot_product_attention_fwd")


def keeps_for_backward(prim, *_, **params) -> bool:
  """The residual policy of every piece: keep what the model marks (`keep`) and attention's
  outputs; recompute the elementwise work between them in the backward program (as XLA does by
  fusion within one program). Keeping every matmul's output would keep a LoRA Linear's output
  twice (its base and LoRA parts, before they are summed): more memory, and more arrays between
  programs, each costing host time (benchmarks/HISTORY.md, "LoRA step: fewer kernels and
  arrays between the block programs")."""
  return (prim.name == "name" and params.get("name") == KEPT) or saves_attention(prim)


def ahead(x):
  """x, marked as a value that `ahead_of_calls` computes for a loop's calls all at once: one
  that depends on what changes from call to call (a sampler's noise level) and on what stays
  (weights, prompt), but not on what the loop carries (the latents). An AdaLN modulation is one:
  a matmul of one row (the timestep embedding), which reads a whole kernel for that row."""
  return checkpoint_name(x, AHEAD)


def _is_ahead(prim, *_, **params) -> bool:
  return prim.name == "name" and params.get("name") == AHEAD


@dataclasses.dataclass(frozen=True)
class _AheadSplit:
  """A function's jaxpr (its constants as leading inputs) split at its `ahead` values:
  `before` computes them from the inputs `before_reads` says; `rest` computes the results
  from them and the inputs `rest_reads` says (of the values, then the inputs)."""
  consts: list
  before: core.ClosedJaxpr
  before_reads: list
  rest: core.ClosedJaxpr
  rest_reads: list
  out_tree: object


def _split_ahead(fn, shapes, tree, carried: set) -> _AheadSplit:
  """fn's jaxpr for arguments of `shapes` (flattened by `tree`) split so that the `ahead`
  values that do not depend on the `carried` inputs are computed before the rest (by
  jax.checkpoint's own partial evaluation, its policy saving only those values: whatever
  else the rest needs of the known inputs, such as a slice of a weight, it computes itself)."""
  closed, out = jax.make_jaxpr(lambda *f: fn(*tree.unflatten(f)), return_shape=True)(*shapes)
  # its constants as leading inputs
  jaxpr = _jaxpr_of((*closed.jaxpr.constvars, *closed.jaxpr.invars), closed.jaxpr.outvars,
                    closed.jaxpr.eqns, closed.jaxpr.effects)
  unknown = [False] * len(closed.consts) + [k in carried for k in range(len(shapes))]
  before, rest, _, _, n_values = partial_eval.partial_eval_jaxpr_custom(
      jaxpr, unknown, in_inst=True, ensure_out_unknowns=True, ensure_out_inst=True,
      saveable=_is_ahead)
  before, before_reads = partial_eval.dce_jaxpr(before, [True] * n_values)
  rest, rest_reads = partial_eval.dce_jaxpr(rest, [True] * len(rest.outvars))
  return _AheadSplit(list(closed.consts), core.ClosedJaxpr(before, ()), before_reads,
                     core.ClosedJaxpr(rest, ()), rest_reads, jax.tree.structure(out))


@dataclasses.dataclass(frozen=True)
class AheadOfCalls:
  """`ahead_of_calls`' two functions."""
  values: Callable  # (*args, the varying ones stacked) -> [the `ahead` values of each call]
  call: Callable  # (the values of a call, *args) -> fn(*args), reading them


def ahead_of_calls(fn, carried: int, varying: Sequence[int], jit_options=JIT_OPTIONS) -> AheadOfCalls:
  """fn(*args) in a loop whose calls differ in the arguments at the positions `varying` and in
  the one at `carried` (what the loop carries), its `ahead` values taken out of the loop:
  `values(*args)`, with each varying argument stacked (one row a call), computes those that do
  not depend on the carried argument for every call in one program (jitted with `jit_options`)
  and returns each call's; `call(values, *args)` is fn(*args), reading the call's values instead
  of computing them (a traceable function: jit it, or run it `per_block`). A one-row matmul of
  each call becomes one matmul of a row a call, which reads its weights once for all of them."""
  splits, programs = {}, {}

  def split_of(args, stacked: bool) -> tuple:
    flat, tree = jax.tree.flatten(args)
    positions = [k for k, arg in enumerate(args) for _ in jax.tree.leaves(arg)]
    # what the trace reads of each argument (not its sharding, which a call's output may add);
    # one call's arguments: the varying ones without their leading axis. Plain tuples for the
    # key: a ShapeDtypeStruct a leaf costs more than the rest of a call (thousands of weights).
    avals = [(a.shape[1:] if stacked and k in varying else a.shape, a.dtype, a.weak_type)
             for a, k in zip(map(_aval, flat), positions)]
    key = (tree, tuple(avals))
    if key not in splits:
      shapes = [jax.ShapeDtypeStruct(*aval[:2], weak_type=aval[2]) for aval in avals]
      splits[key] = _split_ahead(fn, shapes, tree, {j for j, k in enumerate(positions) if k == carried})
    return splits[key], flat, positions

  def values(*args):
    split, flat, positions = split_of(args, stacked=True)
    calls = len(jax.tree.leaves(args[varying[0]])[0])
    if not split.before.jaxpr.outvars:
      return [()] * calls
    known = [j for j, k in enumerate(positions) if k != carried]  # `before`'s inputs, after consts
    if (id(split), calls) not in programs:
      axes = [None] * len(split.consts) + [0 if positions[j] in varying else None for j in known]
      every_call = jax.vmap(core.jaxpr_as_fun(split.before),
                            in_axes=[a for a, read in zip(axes, split.before_reads) if read])
      # each call's values as arrays of their own, which its program reads without a slice
      programs[id(split), calls] = jax.jit(
          lambda *ins: [tuple(v[n] for v in every_call(*ins)) for n in range(calls)], **jit_options)
    ins = [x for x, read in zip(split.consts + [flat[j] for j in known], split.before_reads) if read]
    return programs[id(split), calls](*ins)

  def call(values, *args):
    split, flat, _ = split_of(args, stacked=False)
    ins = [x for x, read in zip(list(values) + split.consts + flat, split.rest_reads) if read]
    return split.out_tree.unflatten(core.jaxpr_as_fun(split.rest)(*ins))

  return AheadOfCalls(values, call)


@dataclasses.dataclass(frozen=True)
class Piece:
  """One program's worth of a traced function."""
  jaxpr: core.ClosedJaxpr  # a block call's shared jaxpr, or a stretch of equations
  ins: tuple  # its arguments' atoms (a variable, or a literal such as the layer index)
  outs: tuple  # its results' variables
  policy: Callable = keeps_for_backward  # what its forward program keeps for the backward one
  frees: tuple = ()  # variables last read by this piece
  block: bool = False  # a block call (else a stretch of equations between them)


def block_call(eqn) -> Optional[tuple]:
  """(the block's jaxpr, its residual policy) if a jaxpr equation calls a `cut_point` function,
  alone or as the whole of a `jax.checkpoint` (whose policy it then takes); else None."""
  if str(eqn.params.get("name", "")).startswith(CUT_PREFIX) and "jaxpr" in eqn.params:
    return eqn.params["jaxpr"], keeps_for_backward
  body = eqn.params.get("jaxpr")
  if "policy" in eqn.params and isinstance(body, core.Jaxpr) and len(body.eqns) == 1:
    (inner,) = body.eqns
    if (block_call(inner) and not body.constvars and inner.invars == body.invars
        and inner.outvars == body.outvars):
      policy = eqn.params["policy"] or jax.checkpoint_policies.nothing_saveable  # None: nothing
      return inner.params["jaxpr"], policy
  return None


def pieces(closed) -> list:
  """A closed jaxpr as `Piece`s in order: each block call, and each stretch of equations
  between them (with what each must return: what is read after it)."""
  jaxpr = closed.jaxpr
  groups = []  # [(block_call(eqn), [eqn]) or (None, [eqns of a stretch])]
  for eqn in jaxpr.eqns:
    call = block_call(eqn)
    if call or not groups or groups[-1][0]:
      groups.append((call, [eqn]))
    else:
      groups[-1][1].append(eqn)
  out, live = [], {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  for call, eqns in reversed(groups):
    defined = {v for e in eqns for v in e.outvars}
    if call:
      (eqn,) = eqns
      piece = Piece(call[0], tuple(eqn.invars), tuple(eqn.outvars), call[1], block=True)
    else:
      ins = tuple(dict.fromkeys(v for e in eqns for v in e.invars
                                if isinstance(v, core.Var) and v not in defined))
      outs = tuple(v for e in eqns for v in e.outvars if v in live)
      effects = frozenset().union(*(e.effects for e in eqns))
      piece = Piece(core.ClosedJaxpr(_jaxpr_of(ins, outs, eqns, effects), ()), ins, outs)
    reads = {v for v in piece.ins if isinstance(v, core.Var)}
    out.append(dataclasses.replace(piece, frees=tuple(reads - live)))
    live = (live - defined) | reads
  return out[::-1]


def _jaxpr_of(ins, outs, eqns, effects) -> core.Jaxpr:
  """A jaxpr without constants of equations taken from another, reading `ins`, giving `outs`."""
  names = core.DebugInfo("programs", "piece", tuple(map(str, ins)), tuple(map(str, outs)))
  return core.Jaxpr((), ins, outs, eqns, effects, names)


def _inexact(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


class _Differentiated:
  """A piece's forward and backward programs, for inputs differentiated where `differentiated`
  says, keeping the residuals `policy` saves, compiled at the first call.
  forward(diff, rest) -> (outputs, residuals); backward(residuals, inputs, output cotangents)
  -> diff cotangents, where `inputs` are diff + rest, of which only those `kept` are read.
  A residual that is one of the inputs (a frozen weight, the block input) is not returned (XLA
  would copy it) but passed to the backward program again."""

  def __init__(self, jaxpr, differentiated, policy, jit_options):
    self.fn, self.differentiated, self.policy = core.jaxpr_as_fun(jaxpr), differentiated, policy
    self.inexact = [_inexact(a) for a in jaxpr.out_avals]
    self.diff_at = [k for k, d in enumerate(differentiated) if d]  # (positions in the inputs)
    self.rest_at = [k for k, d in enumerate(differentiated) if not d]
    self.backward_order = self.diff_at + self.rest_at
    # jit's own dispatch is the fastest; every call has the same shapes (those of one trace of
    # the function run per block), so each traces once and `tree`, `forwarded`, `kept_at` stay
    # valid.
    self.forward = jax.jit(self._traced_forward, **jit_options)
    self.backward = jax.jit(self._backward, **jit_options)

  def _vjp(self, diff, rest):
    def outputs(diff):
      it_diff, it_rest = iter(diff), iter(rest)
      outs = self.fn(*[next(it_diff) if d else next(it_rest) for d in self.differentiated])
      return ([o for o, f in zip(outs, self.inexact) if f],
              [o for o, f in zip(outs, self.inexact) if not f])
    real, vjp, other = jax.vjp(jax.checkpoint(outputs, policy=self.policy, prevent_cse=False),
                               diff, has_aux=True)
    real, other = iter(real), iter(other)
    return [next(real) if f else next(other) for f in self.inexact], vjp

  def _traced_forward(self, diff, rest):
    outs, vjp = self._vjp(diff, rest)
    leaves, self.tree = jax.tree.flatten(vjp)
    position = {id(x): k for k, x in enumerate([*diff, *rest])}
    self.forwarded = [position.get(id(leaf)) for leaf in leaves]
    needed = set(self.forwarded)  # the inputs that the backward program reads again
    self.kept_at = [k if j in needed else None for j, k in enumerate(self.backward_order)]
    return outs, [leaf for leaf, k in zip(leaves, self.forwarded) if k is None]

  def _backward(self, residuals, inputs, cts):
    residuals = iter(residuals)
    leaves = [next(residuals) if k is None else inputs[k] for k in self.forwarded]
    return jax.tree.unflatten(self.tree, leaves)(cts)[0]

  def ordered(self, ins):
    """A piece's inputs as (diff, rest)."""
    return [ins[k] for k in self.diff_at], [ins[k] for k in self.rest_at]

  def kept(self, ins):
    """What the backward program reads again of a piece's inputs, in its order (diff + rest;
    None where it does not read one), known once the forward program is traced."""
    return [None if k is None else ins[k] for k in self.kept_at]


# A swapped block's weights take a few times its forward pass to copy
# (BENCHMARKS.md#flux-host-copy): the copy starts this many programs before the program that
# reads them ...
COPY_AHEAD = 6
# ... once the program this many before the current one has finished, since Python runs far
# ahead of the device: the device holds the copies of at most COPY_AHEAD + COPY_WAIT programs.
COPY_WAIT = 2


class _HostCopies:
  """Device copies of programs' inputs that live in pinned host memory, each made `COPY_AHEAD`
  programs before the program that reads it, so that its DMA runs beside the programs in
  between (the copy of a whole host array is a DMA; within one program it would wait for XLA's
  scheduler). `host`: {n: {position: host array}} for the n-th program to run, where it has
  any; `finished`: the outputs of the last programs run (shared by successive passes)."""

  def __init__(self, host, finished):
    self.host, self.finished, self.copies = host, finished, {}
    self.pending = collections.deque(sorted(host))

  def inputs(self, n, ins):
    """Program n's inputs `ins`, its host ones replaced by their copies (a new list, if any)."""
    while self.pending and self.pending[0] <= n + COPY_AHEAD:
      m = self.pending.popleft()
      if len(self.finished) == COPY_WAIT:
        jax.block_until_ready(self.finished[0])
      positions, arrays = zip(*self.host[m].items())
      self.copies[m] = dict(zip(positions, jax.device_put(
          list(arrays), [a.sharding.with_memory_kind("device") for a in arrays])))
    copies = self.copies.pop(n, None)
    return ins if copies is None else [copies.get(k, x) for k, x in enumerate(ins)]

  def ran(self, outputs):
    """Records that the next program was dispatched, with `outputs` (a list: one is enough)."""
    self.finished.append(outputs[:1])


def _aval(x):
  """jax.typeof(x) without an array's sharding, which the trace does not read: an array's own
  aval, ten times faster to get (a step reads thousands)."""
  aval = getattr(x, "aval", None)
  return jax.typeof(x) if aval is None else aval


@dataclasses.dataclass(frozen=True)
class _Trace:
  """fn traced for one argument tree, shapes and memories and cut into `steps`, its variables
  numbered: a run's environment is a list (`start`: the constants and literals in place, the
  arguments to be put from `first_arg`) that each piece reads and writes at positions found
  here once, so that a step's Python does little besides calling the programs."""
  jaxpr: core.Jaxpr
  steps: list
  out_tree: object
  start: list
  first_arg: int
  reads: list  # for each piece, where its inputs are
  writes: list  # ... where its outputs go
  frees: list  # ... what no later piece (nor a result) reads
  host: dict  # piece index -> the positions of its inputs that are in host memory
  results: tuple  # where fn's results are
  programs: dict  # the pieces' programs (`_program`, `_Differentiated`)

  def environment(self, flat_args) -> list:
    env = list(self.start)
    env[self.first_arg:self.first_arg + len(flat_args)] = flat_args
    return env


def _numbered(closed, steps, out_tree, in_host) -> _Trace:
  """The `_Trace` of a closed jaxpr cut into `steps`; `in_host`: its inputs in host memory."""
  slot, start = {}, []

  def number(atom) -> int:
    if isinstance(atom, core.Literal):
      start.append(atom.val)
      return len(start) - 1
    if atom not in slot:
      slot[atom] = len(start)
      start.append(None)
    return slot[atom]
  for v, value in zip(closed.jaxpr.constvars, closed.consts):
    start[number(v)] = value
  first_arg = len(start)
  for v in closed.jaxpr.invars:
    number(v)
  host = {n: tuple(k for k, v in enumerate(p.ins) if _in(v, in_host)) for n, p in enumerate(steps)}
  return _Trace(closed.jaxpr, steps, out_tree, start, first_arg,
                [tuple(map(number, p.ins)) for p in steps], [tuple(map(number, p.outs)) for p in steps],
                [tuple(slot[v] for v in p.frees) for p in steps],
                {n: positions for n, positions in host.items() if positions},
                tuple(map(number, closed.jaxpr.outvars)), {})


def _cached_trace(fn):
  """args -> (the environment of a run, the `_Trace` of fn for the argument tree, shapes and
  memories of args), tracing fn once for each."""
  traced = {}

  def trace(args):
    flat, tree = jax.tree.flatten(args)
    avals = tuple(map(_aval, flat))
    if (tree, avals) not in traced:
      closed, shapes = jax.make_jaxpr(lambda *f: fn(*tree.unflatten(f)), return_shape=True)(
          *[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
      in_host = {v for v, a in zip(closed.jaxpr.invars, avals)
                 if a.memory_space == jax.memory.Space.Host}
      traced[tree, avals] = _numbered(closed, pieces(closed), jax.tree.structure(shapes), in_host)
    t = traced[tree, avals]
    return t.environment(flat), t
  return trace


def _program(programs, jaxpr, jit_options=JIT_OPTIONS):
  """The jitted program of a piece's jaxpr, one for all the pieces that share it."""
  if id(jaxpr) not in programs:
    programs[id(jaxpr)] = jax.jit(core.jaxpr_as_fun(jaxpr), **jit_options)
  return programs[id(jaxpr)]


@functools.cache
def _waits_for_each_program() -> bool:
  """On several CPU devices, programs in flight together can hang, each holding a thread of
  XLA's pool at a collective that waits for another device's turn: wait for each there."""
  return jax.default_backend() == "cpu" and jax.device_count() > 1


def _settled(values):
  return jax.block_until_ready(values) if _waits_for_each_program() else values


def _in(atom, variables) -> bool:
  return isinstance(atom, core.Var) and atom in variables


def _run_pieces(env, t: _Trace, call, finished):
  """call(n, piece, its inputs, the same with those in host memory copied to the device) -> its
  outputs, for each piece n in order; `env` keeps only what later pieces (or the results) read."""
  copies = _HostCopies({n: {k: env[t.reads[n][k]] for k in positions}
                        for n, positions in t.host.items()}, finished)
  for n, (piece, reads, writes, frees) in enumerate(zip(t.steps, t.reads, t.writes, t.frees)):
    ins = [env[k] for k in reads]
    outs = _settled(call(n, piece, ins, copies.inputs(n, ins)))
    copies.ran(outs)
    for k, out in zip(writes, outs):
      env[k] = out
    for k in frees:
      env[k] = None


def per_block(fn, jit_options=JIT_OPTIONS):
  """fn (same arguments and results), run piece by piece (`pieces`), each program jitted with
  `jit_options`."""
  trace = _cached_trace(fn)

  def run(*args):
    env, t = trace(args)
    _run_pieces(env, t, lambda n, piece, _, ins: _program(t.programs, piece.jaxpr, jit_options)(*ins),
                collections.deque(maxlen=COPY_WAIT))
    return t.out_tree.unflatten([env[k] for k in t.results])
  return run


def _differentiated_inputs(jaxpr, steps, n_diff) -> list:
  """For each piece in order, which of its inputs depend on the first `n_diff` inputs of jaxpr
  (and are inexact)."""
  carries, plan = set(jaxpr.invars[:n_diff]), []
  for piece in steps:
    plan.append(tuple(_in(v, carries) and _inexact(v.aval) for v in piece.ins))
    if any(plan[-1]):
      carries.update(piece.outs)
  return plan


def _offloadable_inputs(jaxpr, steps, plan) -> list:
  """For each piece in order, the positions of its inputs that `value_and_grad(offload=True)`
  moves to host memory: a block's differentiated inputs that an earlier piece computed and no
  later one reads (the activations it takes from the block before, not a weight or what every
  block reads)."""
  given = set(jaxpr.invars) | set(jaxpr.constvars)
  return [tuple(k for k, (v, d) in enumerate(zip(piece.ins, differentiated))
                if piece.block and d and v in piece.frees and v not in given)
          for piece, differentiated in zip(steps, plan)]


def value_and_grad(fn, jit_options=JIT_OPTIONS, offload=False):
  """jax.value_and_grad(fn) (of its first argument, a tree of inexact arrays; fn returns a
  scalar), run piece by piece: forward programs in order, backward programs in reverse, each
  jitted with `jit_options`. `offload`: each block's input that its backward program reads
  again (under per-block remat, what the backward pass keeps of the block) is copied to pinned
  host memory as the block's forward program is dispatched, and back to the device
  `COPY_AHEAD` programs before its backward program, so that the device holds a few of them
  rather than one a block."""
  trace = _cached_trace(fn)
  plans = {}  # id(a trace) -> (`_differentiated_inputs`, `_offloadable_inputs` or nothing)

  def run(*args):
    env, t = trace(args)
    n_diff = len(jax.tree.leaves(args[0]))
    if id(t) not in plans:
      plan = _differentiated_inputs(t.jaxpr, t.steps, n_diff)
      plans[id(t)] = plan, (_offloadable_inputs(t.jaxpr, t.steps, plan) if offload
                            else [()] * len(t.steps))
    (plan, offloaded), tape, finished = plans[id(t)], [], collections.deque(maxlen=COPY_WAIT)

    def forward(n, piece, originals, ins):
      differentiated = plan[n]
      if not any(differentiated):
        return _program(t.programs, piece.jaxpr, jit_options)(*ins)
      key = (id(piece.jaxpr), differentiated, piece.policy)  # the layers of a stack share one jaxpr
      if key not in t.programs:
        t.programs[key] = _Differentiated(piece.jaxpr, differentiated, piece.policy, jit_options)
      program = t.programs[key]
      outs, residuals = program.forward(*program.ordered(ins))
      # What the backward program reads again; host inputs stay there, to be copied again, and
      # offloaded ones go there (the device frees its copy once no later program reads it).
      kept, hosts = program.kept(originals), {}
      in_host, moved = t.host.get(n, ()), offloaded[n]
      for j, k in enumerate(program.backward_order) if in_host or moved else ():
        if kept[j] is None:
          continue
        if k in moved:
          kept[j] = jax.device_put(kept[j], kept[j].sharding.with_memory_kind("pinned_host"))
        if k in in_host or k in moved:
          hosts[j] = kept[j]
      tape.append((n, program, residuals, kept, hosts))
      return outs

    _run_pieces(env, t, forward, finished)
    (loss,) = t.results
    value = env[loss]
    del env
    cts = [None] * len(t.start)  # the cotangent of each variable, where it has one
    cts[loss] = jnp.ones_like(value)
    copies = _HostCopies({m: hosts for m, (*_, hosts) in enumerate(reversed(tape)) if hosts},
                         finished)
    for m in range(len(tape)):
      n, program, residuals, kept, _ = tape.pop()
      out_cts = []
      for v, k, inexact in zip(t.steps[n].outs, t.writes[n], program.inexact):
        if inexact:
          out_cts.append(jnp.zeros(v.aval.shape, v.aval.dtype) if cts[k] is None else cts[k])
          cts[k] = None
      in_cts = _settled(program.backward(residuals, copies.inputs(m, kept), out_cts))
      copies.ran(in_cts)
      del residuals, kept
      for j, ct in zip(program.diff_at, in_cts):
        k = t.reads[n][j]
        cts[k] = ct if cts[k] is None else cts[k] + ct
    grads = [jnp.zeros(v.aval.shape, v.aval.dtype) if ct is None else ct
             for v, ct in zip(t.jaxpr.invars[:n_diff], cts[t.first_arg:t.first_arg + n_diff])]
    return value, jax.tree.unflatten(jax.tree.structure(args[0]), grads)
  return run
