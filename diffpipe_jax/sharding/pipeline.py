"""Pipeline parallelism over the mesh's 'stage' axis: a circular schedule in one `jax.shard_map`.

Each block stack (a model may have several, run one after the other) is cut into chunks of `per_stage`
layers. A microbatch visits stage 0, 1, ..., S-1 once per round ("visit"): with S stages and k
layers a chunk, layer l runs on stage (l // k) % S in visit l // (S k). A stack of L layers takes
ceil(L / (S k)) visits; the last visit's missing layers are padding that passes activations
through unchanged (`valid` flags), so any number of layers suits any number of stages. The chunk
sizes are chosen per stack by simulating the schedule (`make_plan`).

Each stage stores only its own chunks: a stacked weight [L, ...] becomes [S, visits * k, ...],
sharded over 'stage' (`to_stages`; `to_layers` is the inverse, for exports and checkpoints).

A fixed split (diffusion-pipe's `partition_split`, `blocks_per_stage`) gives each stage instead a
contiguous range of each stack, of any length, none included, run in one visit: k is the
longest range, and the shorter ones are padded to it. The trade-off: the shards of an array are
equal, so every stage stores k layers of each stack whatever its own range, as many as the
stage with the most and never fewer than an even split's ceil(L / S). A split cannot give a
smaller GPU less memory (a model of two stacks split between them on 2 stages: each stage
stores both stacks whole, the whole model's size, about half of it padding), and each stack
takes as long as its longest range. It runs diffusion-pipe's configs unchanged, at their stage
boundaries; without one, memory and time are balanced.

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
from jax.sharding import Mesh

from diffpipe_jax import axes, stacks as stacks_lib
from diffpipe_jax.errors import UserError

# The cost of a tick beyond its layers (transfers, buffer updates, loop), in layers; chosen by
# measurement on 2 H200s (BENCHMARKS.md#flux-multi-gpu; the trials: benchmarks/HISTORY.md,
# "LoRA step on 2 GPUs: data and pipeline parallelism").
TICK_OVERHEAD = 0.05


@dataclasses.dataclass(frozen=True)
class Segment:
  """One block stack in the pipeline: `length` layers in chunks of `per_stage`, `visits` rounds;
  with `counts`, a fixed split: `counts[s]` consecutive layers on stage s, one visit, chunks of
  the largest count (`per_stage`)."""
  name: str
  length: int
  per_stage: int
  visits: int
  cost: float = 1.0  # of one layer, relative to the other stacks'
  counts: tuple = ()


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
    if segment.counts:
      first = sum(segment.counts[:stage])
      return range(first, first + segment.counts[stage])
    first = (visit * self.stages + stage) * segment.per_stage
    return range(first, min(first + segment.per_stage, segment.length))

  def cost(self) -> float:
    """The schedule's time in layer units: each tick takes its chunk's time, plus overhead."""
    return sum(self.ticks(s) * (s.per_stage * s.cost + self.tick_overhead) for s in self.segments)

  def ideal_cost(self) -> float:
    return self.microbatches * sum(s.cost * s.length for s in self.segments) / self.stages

  def layers_stored(self) -> int:
    """Layers each stage stores per step's weights (its own and padding): one size for all."""
    return sum(s.visits * s.per_stage for s in self.segments)

  def bubble(self) -> float:
    """The fraction of stage time idle or on padding (without the tick overhead)."""
    busy = sum(self.ticks(s) * s.per_stage * s.cost for s in self.segments)
    return 1 - self.ideal_cost() / busy

  def describe(self) -> str:
    lines = [f"pipeline: {self.stages} stages, {self.microbatches} microbatches, "
             f"{sum(self.ticks(s) for s in self.segments)} ticks, bubble {self.bubble():.1%}"]
    for s in range(self.stages):
      parts, padding = [], 0
      for seg in self.segments:
        held = [self.layers_on(seg, s, v) for v in range(seg.visits)]
        padding += seg.visits * seg.per_stage - sum(map(len, held))
        parts.append(f"{seg.name} " + (",".join(
            f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in held if len(r)) or "-"))
      lines.append(f"  stage {s}: " + "; ".join(parts)
                   + (f" (+{padding} padding layers)" if padding else ""))
    return "\n".join(lines)

  # ------------------------------------------------------------------ storage per stage
  def segment(self, name: str) -> Segment:
    return next(s for s in self.segments if s.name == name)

  def stored_layers(self, name: str) -> np.ndarray:
    """[S, visits * per_stage]: the layer each stage stores in each slot, `length` for padding."""
    seg = self.segment(name)
    stored = np.full((self.stages, seg.visits, seg.per_stage), seg.length)
    for stage, visit in np.ndindex(self.stages, seg.visits):
      layers = self.layers_on(seg, stage, visit)
      stored[stage, visit, :len(layers)] = layers
    return stored.reshape(self.stages, -1)

  def to_stages(self, name: str, leaf):
    """A stacked leaf [L, ...] -> [S, visits * per_stage, ...], zero-padded (numpy or jax)."""
    xp = np if isinstance(leaf, np.ndarray) else jnp
    return xp.concatenate([leaf, xp.zeros((1, *leaf.shape[1:]), leaf.dtype)])[self.stored_layers(name)]

  def to_layers(self, name: str, leaf):
    """The inverse of `to_stages`."""
    order = np.argsort(self.stored_layers(name), axis=None, kind="stable")  # padding sorts last
    return leaf.reshape(-1, *leaf.shape[2:])[order[:self.segment(name).length]]

  def valid(self, name: str) -> np.ndarray:
    return self.stored_layers(name) < self.segment(name).length


def make_plan(block_stacks: Sequence, stages: int, microbatches: int, split: Sequence | None = None,
              tick_overhead: float = TICK_OVERHEAD) -> Plan:
  """The chunk size of each stack with the cheapest schedule. `block_stacks` lists (name,
  layers, relative cost of a layer) in execution order (a model family's `stacks`); `split`, a
  fixed split instead: each stack's layers on each stage (`blocks_per_stage`)."""
  if stages < 1 or microbatches < 1:
    raise UserError(f"need stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
  plan = lambda segments: Plan(stages, microbatches, tuple(segments), tick_overhead)
  if split is not None:
    assert [sum(c) for c in split] == [length for _, length, _ in block_stacks], (split, block_stacks)
    return plan(Segment(name, length, max(counts), 1, cost, tuple(counts))
                for (name, length, cost), counts in zip(block_stacks, split))
  best = []
  for name, length, cost in block_stacks:  # stacks run one after the other: each on its own
    choices = [Segment(name, length, k, -(-length // (stages * k)), cost)
               for k in range(1, -(-length // stages) + 1)]
    best.append(min(choices, key=lambda s: (round(plan([s]).cost(), 6), plan([s]).ticks(s))))
  return plan(best)


def blocks_per_stage(block_stacks: Sequence, layers_around_stacks: Sequence, partition_split: Sequence,
                     stages: int) -> tuple:
  """diffusion-pipe's `partition_split` -> each stack's number of blocks on each stage.

  diffusion-pipe numbers the model's layers in one list: `layers_around_stacks[i]` layers that
  are no block (embeddings, a join of two streams) before stack i, then its blocks, and
  `layers_around_stacks[-1]` after the last stack (the final layer; a family's field).
  `partition_split` lists the first layer of stages 1, 2, ...; stage 0 starts at layer 0."""
  lengths = [length for _, length, _ in block_stacks]
  assert len(layers_around_stacks) == len(lengths) + 1, (layers_around_stacks, lengths)
  total, split = sum(lengths) + sum(layers_around_stacks), list(partition_split)
  if len(split) != stages - 1:
    raise UserError(f"partition_split={split}: {stages} pipeline stages need {stages - 1} boundaries")
  if split != sorted(set(split)) or not all(0 < a < total for a in split):
    raise UserError(f"partition_split={split}: the model has {total} layers (diffusion-pipe's "
                    f"numbering, 0 its input embedding); use increasing indices in 1..{total - 1}")
  bounds = np.array([0, *split, total])
  first = np.cumsum(layers_around_stacks[:-1]) + np.cumsum([0, *lengths[:-1]])  # of each stack's block 0
  before = np.clip(bounds - first[:, None], 0, np.array(lengths)[:, None])  # a stack's blocks before each bound
  counts = np.diff(before, axis=1)  # [stacks, stages]
  empty = np.flatnonzero(counts.sum(0) == 0)
  if empty.size:
    s = empty[0]
    raise UserError(f"partition_split={split}: stage {s} would hold layers {bounds[s]}-"
                    f"{bounds[s + 1] - 1}, no block; every stage needs one (the blocks are layers "
                    f"{first[0]}-{total - layers_around_stacks[-1] - 1} of the model's {total})")
  return tuple(tuple(map(int, c)) for c in counts)


def is_stacked_path(path, names) -> str | None:
  """The stack name a tree path (of jax key entries or strings) lies under, if any."""
  for k in path:
    name = getattr(k, "key", k)
    if name in names:
      return name
  return None


def map_stacked(fn, tree, names, skip=()):
  """Applies fn(stack name, leaf) to the leaves under a stack (LoRA, Adam moments alike), but
  those under a key in `skip`."""
  def visit(path, leaf):
    name = is_stacked_path(path, names)
    if name is None or not hasattr(leaf, "shape") or leaf.ndim == 0 or is_stacked_path(path, skip):
      return leaf
    return fn(name, leaf)
  return jax.tree_util.tree_map_with_path(visit, tree)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """`run` runs the stacks as `stacks.run_stacks` does (but unrolled), pipelined over `mesh`."""
  mesh: Mesh
  plan: Plan

  def single_microbatch(self) -> "Pipeline":
    """The same stages run on a batch that is one microbatch (evals, sampling)."""
    return dataclasses.replace(self, plan=dataclasses.replace(self.plan, microbatches=1))

  def run(self, stacks: Sequence[stacks_lib.Stack], x, per_sample, shared, *, remat=None, key=None):
    plan, M = self.plan, self.plan.microbatches
    if x.shape[0] % M:
      raise ValueError(f"a batch of {x.shape[0]} does not split into {M} microbatches")
    split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])
    valids = [jnp.asarray(plan.valid(s.name)) for s in stacks]
    batch_spec, stage_spec = axes.spec(None, "batch"), axes.spec("layers")  # [M, rows, ...], [S, ...]
    every = lambda tree, spec: jax.tree.map(lambda _: spec, tree)
    in_specs = (batch_spec, [batch_spec] * len(per_sample), every(shared, axes.spec()),
                [every(s.params, stage_spec) for s in stacks], [every(s.lora, stage_spec) for s in stacks],
                [stage_spec] * len(stacks), axes.spec())
    body = jax.shard_map(  # manual over 'data' and 'stage'; 'seq' left to `sequence`'s annotations
        lambda *a: _pipeline(plan, stacks, *a, remat=remat, with_key=key is not None),
        mesh=self.mesh, in_specs=in_specs, out_specs=batch_spec, axis_names={axes.DATA, axes.STAGE})
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
  stage = jax.lax.axis_index(axes.STAGE)

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
    state = jax.lax.ppermute(y, axes.STAGE, [(s, (s + 1) % S) for s in range(S)])
    return (state, returned, out), None

  # The carries vary over 'stage' as their updates do (and over 'data' as x does).
  zeros = lambda n: jax.lax.pcast(jnp.zeros_like(x[:1], shape=(n, *x.shape[1:])), axes.STAGE,
                                  to="varying")
  init = (zeros(1)[0], zeros(slots if segment.visits > 1 else 0), zeros(M))
  (_, _, out), _ = jax.lax.scan(tick, init, jnp.arange(plan.ticks(segment)))
  return jax.lax.psum(out, axes.STAGE)  # only the last stage wrote: every stage gets the result
