"""A function of unrolled layers run as a sequence of programs rather than one.

XLA compiles a program of every unrolled layer (57 at Flux size) in minutes: most of that time
grows with the program's size. Here the function is traced once per argument shapes and cut at
its calls of `layers.block_program`: each call is a piece whose programs every layer of a stack
shares, and each stretch of work between calls (the embedders, the loss) is a piece of its own.
`split` runs the pieces' programs in order; `value_and_grad` runs each piece's forward program
(which returns its residuals) in order, then the backward programs in reverse. Every program is
called from Python through jit's own dispatch, so the GPU runs them back to back while Python
dispatches the next ones ahead (at Flux size the step is as fast as one program's).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend import core

from diffpipe_jax.models import layers


def keeps_for_backward(prim, *_, **__) -> bool:
  """The residual policy of every piece: keep matmul and attention outputs; recompute the
  elementwise work between them in the backward program (as XLA does by fusion within one
  program, where a residual need not be a buffer of its own)."""
  return prim.name == "dot_general" or prim.name.startswith("dot_product_attention_fwd")


@dataclasses.dataclass(frozen=True)
class Piece:
  """One program's worth of a traced function."""
  jaxpr: core.ClosedJaxpr  # a block call's shared jaxpr, or a stretch of equations
  ins: tuple  # its arguments' atoms (a variable, or a literal such as the layer index)
  outs: tuple  # its results' variables
  frees: tuple = ()  # variables last read by this piece


def is_block_call(eqn) -> bool:
  """Whether a jaxpr equation is a call of `layers.block_program`."""
  return "jaxpr" in eqn.params and eqn.params.get("name") == layers.apply_block.__name__


def pieces(closed) -> list:
  """A closed jaxpr as `Piece`s in order: each block call, and each stretch of equations
  between them (with what each must return: what is read after it)."""
  jaxpr = closed.jaxpr
  groups = []
  for eqn in jaxpr.eqns:
    if is_block_call(eqn) or not groups or is_block_call(groups[-1][-1]):
      groups.append([eqn])
    else:
      groups[-1].append(eqn)
  out, live = [], {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  for eqns in reversed(groups):
    defined = {v for e in eqns for v in e.outvars}
    if is_block_call(eqns[0]):
      (eqn,) = eqns
      piece = Piece(eqn.params["jaxpr"], tuple(eqn.invars), tuple(eqn.outvars))
    else:
      ins = tuple(dict.fromkeys(v for e in eqns for v in e.invars
                                if isinstance(v, core.Var) and v not in defined))
      outs = tuple(v for e in eqns for v in e.outvars if v in live)
      effects = frozenset().union(*(e.effects for e in eqns))
      names = core.DebugInfo("programs.split", "piece", tuple(map(str, ins)), tuple(map(str, outs)))
      piece = Piece(core.ClosedJaxpr(core.Jaxpr((), ins, outs, eqns, effects, names), ()), ins, outs)
    reads = {v for v in piece.ins if isinstance(v, core.Var)}
    out.append(dataclasses.replace(piece, frees=tuple(reads - live)))
    live = (live - defined) | reads
  return out[::-1]


def _inexact(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


class _Differentiated:
  """A piece's forward and backward programs, for inputs differentiated where `differentiated`
  says, compiled at the first call. forward(diff, rest) -> (outputs, residuals);
  backward(residuals, diff + rest, output cotangents) -> diff cotangents. A residual that is one of
  the inputs (a frozen weight, the block input) is not returned (XLA would copy it) but passed
  to the backward program again."""

  def __init__(self, jaxpr, differentiated):
    self.fn, self.differentiated = core.jaxpr_as_fun(jaxpr), differentiated
    self.inexact = [_inexact(a) for a in jaxpr.out_avals]
    # jit's own dispatch is the fastest; every call has the same shapes (those of one trace
    # of the split function), so each traces once and `tree`, `forwarded` stay valid.
    self.forward, self.backward = jax.jit(self._traced_forward), jax.jit(self._backward)

  def _vjp(self, diff, rest):
    def outputs(diff):
      it_diff, it_rest = iter(diff), iter(rest)
      outs = self.fn(*[next(it_diff) if d else next(it_rest) for d in self.differentiated])
      return ([o for o, f in zip(outs, self.inexact) if f],
              [o for o, f in zip(outs, self.inexact) if not f])
    real, vjp, other = jax.vjp(jax.checkpoint(outputs, policy=keeps_for_backward,
                                              prevent_cse=False), diff, has_aux=True)
    real, other = iter(real), iter(other)
    return [next(real) if f else next(other) for f in self.inexact], vjp

  def _traced_forward(self, diff, rest):
    outs, vjp = self._vjp(diff, rest)
    leaves, self.tree = jax.tree.flatten(vjp)
    position = {id(x): k for k, x in enumerate([*diff, *rest])}
    self.forwarded = [position.get(id(leaf)) for leaf in leaves]
    self.needed = set(self.forwarded)  # the inputs that the backward program reads again
    return outs, [leaf for leaf, k in zip(leaves, self.forwarded) if k is None]

  def _backward(self, residuals, inputs, cts):
    residuals = iter(residuals)
    leaves = [next(residuals) if k is None else inputs[k] for k in self.forwarded]
    return jax.tree.unflatten(self.tree, leaves)(cts)[0]

  def __call__(self, diff, rest):
    outs, residuals = self.forward(diff, rest)
    inputs = [x if k in self.needed else None for k, x in enumerate([*diff, *rest])]
    return outs, functools.partial(self.backward, residuals, inputs)


def _cached_trace(fn):
  """args -> (values of fn's jaxpr's variables so far, the jaxpr, its pieces, the results' tree,
  a dict for the pieces' programs), tracing fn once per argument tree and shapes."""
  traced = {}

  def trace(args):
    flat, tree = jax.tree.flatten(args)
    avals = tuple(map(jax.typeof, flat))
    if (tree, avals) not in traced:
      closed, shapes = jax.make_jaxpr(lambda *f: fn(*tree.unflatten(f)), return_shape=True)(
          *[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
      traced[tree, avals] = closed, pieces(closed), jax.tree.structure(shapes), {}
    closed, steps, out_tree, programs = traced[tree, avals]
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, flat))
    return env, closed.jaxpr, steps, out_tree, programs
  return trace


def _program(programs, jaxpr):
  """The jitted program of a piece's jaxpr, one for all the pieces that share it."""
  if id(jaxpr) not in programs:
    programs[id(jaxpr)] = jax.jit(core.jaxpr_as_fun(jaxpr))
  return programs[id(jaxpr)]


@functools.cache
def _waits_for_each_program() -> bool:
  """On several CPU devices, programs in flight together can hang, each holding a thread of
  XLA's pool at a collective that waits for another device's turn: wait for each there."""
  return jax.default_backend() == "cpu" and jax.device_count() > 1


def _settled(values):
  return jax.block_until_ready(values) if _waits_for_each_program() else values


def _read(env, atom):
  return atom.val if isinstance(atom, core.Literal) else env[atom]


def _run_pieces(env, steps, call):
  """call(piece, its inputs) -> its outputs, for each piece in order; `env` keeps only what
  later pieces (or the results) read."""
  for piece in steps:
    env.update(zip(piece.outs, _settled(call(piece, [_read(env, v) for v in piece.ins]))))
    for v in piece.frees:
      del env[v]


def split(fn):
  """fn (same arguments and results), run piece by piece (`pieces`)."""
  trace = _cached_trace(fn)

  def run(*args):
    env, jaxpr, steps, out_tree, programs = trace(args)
    _run_pieces(env, steps, lambda piece, ins: _program(programs, piece.jaxpr)(*ins))
    return out_tree.unflatten([_read(env, v) for v in jaxpr.outvars])
  return run


def _differentiated_inputs(jaxpr, steps, n_diff) -> dict:
  """id(piece) -> which of its inputs depend on the first `n_diff` inputs of jaxpr (and are
  inexact), for each piece in order."""
  carries, plan = set(jaxpr.invars[:n_diff]), {}
  for piece in steps:
    plan[id(piece)] = tuple(isinstance(v, core.Var) and v in carries and _inexact(v.aval)
                            for v in piece.ins)
    if any(plan[id(piece)]):
      carries.update(piece.outs)
  return plan


def value_and_grad(fn):
  """jax.value_and_grad(fn) (of its first argument, a tree of inexact arrays; fn returns a
  scalar), run piece by piece: forward programs in order, backward programs in reverse."""
  trace = _cached_trace(fn)
  plans = {}  # id(pieces of a trace) -> `_differentiated_inputs`

  def run(*args):
    env, jaxpr, steps, _, programs = trace(args)
    n_diff = len(jax.tree.leaves(args[0]))
    if id(steps) not in plans:
      plans[id(steps)] = _differentiated_inputs(jaxpr, steps, n_diff)
    plan, tape = plans[id(steps)], []

    def forward(piece, ins):
      differentiated = plan[id(piece)]
      if not any(differentiated):
        return _program(programs, piece.jaxpr)(*ins)
      key = (id(piece.jaxpr), differentiated)  # the layers of a stack share one jaxpr
      if key not in programs:
        programs[key] = _Differentiated(piece.jaxpr, differentiated)
      outs, backward = programs[key]([x for x, d in zip(ins, differentiated) if d],
                                     [x for x, d in zip(ins, differentiated) if not d])
      tape.append((piece, differentiated, backward))
      return outs

    _run_pieces(env, steps, forward)
    (loss_var,) = jaxpr.outvars
    value = _read(env, loss_var)
    del env
    cts = {loss_var: jnp.ones_like(value)}
    while tape:
      piece, differentiated, backward = tape.pop()
      out_cts = [cts.pop(v) if v in cts else jnp.zeros(v.aval.shape, v.aval.dtype)
                 for v in piece.outs if _inexact(v.aval)]
      in_cts = _settled(backward(out_cts))
      del backward  # its residuals
      for v, ct in zip([v for v, d in zip(piece.ins, differentiated) if d], in_cts):
        cts[v] = cts[v] + ct if v in cts else ct
    grads = [cts[v] if v in cts else jnp.zeros(v.aval.shape, v.aval.dtype)
             for v in jaxpr.invars[:n_diff]]
    return value, jax.tree.unflatten(jax.tree.structure(args[0]), grads)
  return run
