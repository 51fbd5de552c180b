"""Pipeline parallelism over the mesh's 'stage' axis: a circular schedule in one `jax.shard_map`.

Each block stack (a model may have several, run one after the other) is cut into chunks of `per_stage`
layers. A microbatch visits stage 0, 1, ..., S-1 once per round ("visit"): with S stages and k
layers a chunk, layer l runs on stage (l // k) % S in visit l // (S k). A stack of L layers takes
ceil(L / (S k)) visits; the last visit's missing layers are padding that passes activations
through unchanged (`valid` flags), so any number of layers suits any number of stages. The chunk
sizes are chosen per stack by simulating the schedule (`make_plan`).

Each stage stores only its own chunks: a stacked weight [L, ...] becomes [S, visits * k, ...],
sharded over 'stage' (`to_stages`; `to_layers` is the inverse, for exports and checkpoints).

A stack runs as a `lax.scan` over ticks. At tick t stage s works on item f = t - s of the flat
sequence (visit v, microbatch m) = divmod(f, slots), runs its chunk of that visit, and
`lax.ppermute` hands the result to stage s+1; the last stage hands it round to stage 0, which
keeps it until the microbatch's next visit. With slots = max(M, S) (M microbatches) a stack of V
visits takes V * slots + S - 1 ticks: the bubble is (S-1) / (V * slots + S - 1) per stack.
Stages with nothing to do in a tick compute anyway and the result is dropped: the tick lasts as
long as its busiest stage, and there is no branch in the program. Gradients come from `jax.grad`
outside: the transpose of ppermute(+1) is ppermute(-1).

Conditioning (timestep embedding, RoPE tables) is computed on every stage; the last stage's
outputs are summed over 'stage', so that every stage holds the stack's output.
"""
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from diffpipe_jax import stacks as stacks_lib
from diffpipe_jax.errors import UserError

# The cost of a tick beyond its layers (transfers, buffer updates, loop), in layers; chosen by
# measurement on 2 H200s (BENCHMARKS.md, the pipeline's tick overhead).
TICK_OVERHEAD = 0.05


@dataclasses.dataclass(frozen=True)
class Segment:
  """One block stack in the pipeline: `length` layers in chunks of `per_stage`, `visits` rounds."""
  name: str
  length: int
  per_stage: int
  visits: int
  cost: float = 1.0  # of one layer, relative to the other stacks'


@dataclasses.dataclass(frozen=True)
class Plan:
  """How the stacks are split over `stages` for `microbatches` microbatches per step."""
  stages: int
  microbatches: int
  segments: tuple
  tick_overhead: float = TICK_OVERHEAD

  def slots(self, segment: Segment) -> int:
    """Microbatch slots a visit takes: a microbatch is back at stage 0 before its next visit."""
    return max(self.microbatches, self.stages) if segment.visits > 1 else self.microbatches

  def ticks(self, segment: Segment) -> int:
    return segment.visits * self.slots(segment) + self.stages - 1

  def layers_on(self, segment: Segment, stage: int, visit: int) -> range:
    first = (visit * self.stages + stage) * segment.per_stage
    return range(first, min(first + segment.per_stage, segment.length))

  def cost(self) -> float:
    """The schedule's time in layer units: each tick takes its chunk's time, plus overhead."""
    return sum(self.ticks(s) * (s.per_stage * s.cost + self.tick_overhead) for s in self.segments)

  def ideal_cost(self) -> float:
    return self.microbatches * sum(s.cost * s.length for s in self.segments) / self.stages

  def bubble(self) -> float:
    """The fraction of stage time idle or on padding (without the tick overhead)."""
    busy = sum(self.ticks(s) * s.per_stage * s.cost for s in self.segments)
    return 1 - self.ideal_cost() / busy

  def describe(self) -> str:
    lines = [f"pipeline: {self.stages} stages, {self.microbatches} microbatches, "
             f"{sum(self.ticks(s) for s in self.segments)} ticks, bubble {self.bubble():.1%}"]
    for s in range(self.stages):
      parts = []
      for seg in self.segments:
        held = [self.layers_on(seg, s, v) for v in range(seg.visits)]
        parts.append(f"{seg.name} " + (",".join(
            f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in held if len(r)) or "-"))
      lines.append(f"  stage {s}: " + "; ".join(parts))
    return "\n".join(lines)

  # ------------------------------------------------------------------ storage layout
  def segment(self, name: str) -> Segment:
    return next(s for s in self.segments if s.name == name)

  def to_stages(self, name: str, leaf):
    """A stacked leaf [L, ...] -> [S, visits * per_stage, ...], zero-padded (numpy or jax)."""
    seg, xp = self.segment(name), (np if isinstance(leaf, np.ndarray) else jnp)
    S, k, V = self.stages, seg.per_stage, seg.visits
    padded = xp.concatenate([leaf, xp.zeros((V * S * k - seg.length, *leaf.shape[1:]), leaf.dtype)])
    staged = padded.reshape(V, S, k, *leaf.shape[1:]).swapaxes(0, 1)
    return staged.reshape(S, V * k, *leaf.shape[1:])

  def to_layers(self, name: str, leaf):
    """The inverse of `to_stages`."""
    seg, S = self.segment(name), self.stages
    k, V = seg.per_stage, seg.visits
    layers_ = leaf.reshape(S, V, k, *leaf.shape[2:]).swapaxes(0, 1)
    return layers_.reshape(V * S * k, *leaf.shape[2:])[:seg.length]

  def valid(self, name: str) -> np.ndarray:
    return self.to_stages(name, np.ones((self.segment(name).length,), bool))


def make_plan(block_stacks: Sequence, stages: int, microbatches: int,
              tick_overhead: float = TICK_OVERHEAD) -> Plan:
  """The chunk size of each stack with the cheapest schedule. `block_stacks` lists (name,
  layers, relative cost of a layer) in execution order (a model family's `stacks`)."""
  if stages < 1 or microbatches < 1:
    raise UserError(f"need stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
  plan = lambda segments: Plan(stages, microbatches, tuple(segments), tick_overhead)
  best = []
  for name, length, cost in block_stacks:  # stacks run one after the other: each on its own
    choices = [Segment(name, length, k, -(-length // (stages * k)), cost)
               for k in range(1, -(-length // stages) + 1)]
    best.append(min(choices, key=lambda s: (round(plan([s]).cost(), 6), plan([s]).ticks(s))))
  return plan(best)


def is_stacked_path(path, names) -> str | None:
  """The stack name a tree path (of jax key entries or strings) lies under, if any."""
  for k in path:
    name = getattr(k, "key", k)
    if name in names:
      return name
  return None


def map_stacked(fn, tree, names):
  """Applies fn(stack name, leaf) to the leaves under a stack (LoRA, Adam moments alike)."""
  def visit(path, leaf):
    name = is_stacked_path(path, names)
    return leaf if name is None or not hasattr(leaf, "shape") or leaf.ndim == 0 else fn(name, leaf)
  return jax.tree_util.tree_map_with_path(visit, tree)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """`run` has the signature of `stacks.run_stacks` and runs the stacks pipelined over `mesh`."""
  mesh: Mesh
  plan: Plan

  def single_microbatch(self) -> "Pipeline":
    """The same stages run on a batch that is one microbatch (evals, sampling)."""
    return dataclasses.replace(self, plan=dataclasses.replace(self.plan, microbatches=1))

  def run(self, stacks: Sequence[stacks_lib.Stack], x, per_sample, shared, *, remat=None, key=None,
          unrolled=False):
    assert not unrolled, "a pipeline's chunks are scanned (stacks.remat_policy rejects unrolled)"
    plan, M = self.plan, self.plan.microbatches
    if x.shape[0] % M:
      raise ValueError(f"a batch of {x.shape[0]} does not split into {M} microbatches")
    split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])
    valids = [jnp.asarray(plan.valid(s.name)) for s in stacks]
    batch_spec = P(None, "data")
    stage_spec = lambda tree: jax.tree.map(lambda _: P("stage"), tree)
    in_specs = (batch_spec, [batch_spec] * len(per_sample), jax.tree.map(lambda _: P(), shared),
                [stage_spec(s.params) for s in stacks], [stage_spec(s.lora) for s in stacks],
                [P("stage")] * len(stacks), P())
    body = jax.shard_map(
        lambda *a: _pipeline(plan, stacks, *a, remat=remat, with_key=key is not None),
        mesh=self.mesh, in_specs=in_specs, out_specs=batch_spec)
    out = body(split(x), [split(a) for a in per_sample], shared, [s.params for s in stacks],
               [s.lora for s in stacks], valids, jax.random.key(0) if key is None else key)
    return out.reshape(x.shape)


def _pipeline(plan: Plan, stacks, x, per_sample, shared, params, loras, valids, key, *, remat,
              with_key):
  """The per-device schedule (inside shard_map) of the stacks, one after the other."""
  local = lambda tree: jax.tree.map(lambda a: a[0], tree)  # this stage's chunks
  for g, (segment, stack) in enumerate(zip(plan.segments, stacks)):
    stack = dataclasses.replace(stack, params=local(params[g]), lora=local(loras[g]))
    x = _run_segment(plan, segment, stack, x, per_sample, shared, valids[g][0],
                     jax.random.fold_in(key, g) if with_key else None, remat)
  return x


def _run_segment(plan: Plan, segment: Segment, stack, x, per_sample, shared, valid, key, remat):
  """One stack on x [M, micro batch, sequence, D]; returns its output on every stage."""
  S, M, slots, k = plan.stages, plan.microbatches, plan.slots(segment), segment.per_stage
  stage = jax.lax.axis_index("stage")

  def chunk(h, visit, m):  # this stage's layers of the visit, each rematerialised by `remat`
    args = (*shared, *[a[m] for a in per_sample])
    return stacks_lib.run_chunk(stack, h, args, start=visit * k, count=k, valid=valid, remat=remat,
                                key=None if key is None else jax.random.fold_in(key, m))

  def tick(carry, t):
    state, returned, out = carry
    v, m = jnp.divmod(t - stage, slots)
    v, m = jnp.clip(v, 0, segment.visits - 1), jnp.clip(m, 0, M - 1)  # idle work: any valid index
    first = x[m]
    if segment.visits > 1:  # stage 0 files what came round the ring: microbatch (t - S) % slots
      back = jnp.mod(t - S, slots)
      returned = returned.at[back].set(jnp.where((stage == 0) & (t >= S), state, returned[back]))
      first = jnp.where(v == 0, first, returned[m])
    y = chunk(jnp.where(stage == 0, first, state), v, m)
    done = (stage == S - 1) & (t - stage == (segment.visits - 1) * slots + m)  # its last visit
    out = out.at[m].set(jnp.where(done, y, out[m]))
    state = jax.lax.ppermute(y, "stage", [(s, (s + 1) % S) for s in range(S)])
    return (state, returned, out), None

  # The carries vary over 'stage' as their updates do (and over 'data' as x does).
  zeros = lambda n: jax.lax.pcast(jnp.zeros_like(x[:1], shape=(n, *x.shape[1:])), "stage", to="varying")
  init = (zeros(1)[0], zeros(slots if segment.visits > 1 else 0), zeros(M))
  (_, _, out), _ = jax.lax.scan(tick, init, jnp.arange(plan.ticks(segment)))
  return jax.lax.psum(out, "stage")  # only the last stage wrote: every stage gets the result
