"""Block stacks: how a model's stacks of identical blocks can run and where their weights live.

A model family builds `Stack`s (a block, its stacked parameters and LoRA) and hands them to a
`run_stacks`-like function: `run_stacks` here runs them one after the other on one device, each
in one of three modes, and `sharding.pipeline` runs them pipelined over a mesh (`run_chunk`):

- `run_scanned`: `lax.scan` over the stacked weights (one compiled block, any depth);
- `run_unrolled`: a Python loop of `block_program` calls over weights stored one array per
  layer (`LayerArrays`), split into programs per block by `programs`;
- `run_swapped`: some layers' weights in pinned host memory (`Swapped`), copied in beside the
  compute, forward and backward;
- `run_chunk`: a pipeline stage's chunk of layers, with padding layers passed through.

Which of them runs, and under which rematerialisation policy, is the runtime's choice (`runtime`).
Nothing here knows a model family.
"""
import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from diffpipe_jax import programs, sequence

LAYER_WEIGHTS = "layer_weights"  # the checkpoint name of one layer's slice of the stacked weights


def equal_cost(names: Sequence[str], lengths: Sequence[str]) -> Callable:
  """A family's `stacks`: cfg -> ((stack name, layers, relative cost of a layer), ...) in
  execution order, stack i of `names[i]` with the config field `lengths[i]` layers, every layer
  of the same cost (a family's docstring says why its blocks cost the same)."""
  return lambda cfg: tuple((name, getattr(cfg, length), 1.0) for name, length in zip(names, lengths))
BLOCK_INPUT = "block_input"  # the checkpoint name of each block's input (what per-block remat keeps)

SWAP_NEEDS_ONE_STAGE = "blocks_to_swap needs pipeline_stages=1 (a pipeline already divides the weights)"


@dataclasses.dataclass(frozen=True)
class Stack:
  """A group of identical blocks whose parameters (and LoRA) are stacked on a leading layer axis.
  `block` is an unbound module called as `block(x, *shared, *per_sample)` -> x."""
  name: str
  block: nn.Module
  length: int
  params: Any
  lora: Any = None


# ------------------------------------------------------------------------------------------------
# Where stacked weights live: per layer (unrolled), swapped to host memory.
# ------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Swapped:
  """Stacked weights split on their layer axis: the resident layers stacked in device memory,
  the swapped ones (`swap_positions`) in pinned host memory. Of one weight (`swap_layers`):
  one host array per swapped layer, on the way to the stack's form. Of a whole stack
  (`pack_layers`, the form the model runs): `device` is the tree of resident weights, and each
  swapped layer is one byte buffer, copied to the device by one DMA that runs beside the
  compute (XLA's GPU scheduler keeps at most two copies in flight, so a layer's dozen arrays,
  copied one by one, would keep the compute waiting)."""
  device: Any
  pinned_host: tuple


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerArrays:
  """A stacked leaf [length, ...] stored as one array per layer (the unrolled mode). Each
  layer's matmuls then read their operands in place, as arguments of the step, and every layer
  runs the same programs: a static slice of a stacked weight fuses into the matmul that reads
  it, making each layer's matmul a program of its own, autotuned on its own (much longer
  compiles at full size: benchmarks/HISTORY.md, "LoRA step: unrolled layers stored per
  layer")."""
  arrays: tuple


def is_layer_arrays(leaf) -> bool:
  return isinstance(leaf, LayerArrays)


def unstack(leaf) -> LayerArrays:
  return LayerArrays(tuple(leaf[i] for i in range(leaf.shape[0])))


def restack(tree):
  """The inverse of `unstack`, on every `LayerArrays` of a tree."""
  return jax.tree.map(lambda a: jnp.stack(a.arrays) if is_layer_arrays(a) else a, tree,
                      is_leaf=is_layer_arrays)


def layer_of(tree, i: int):
  """Layer i of a stack's tree of stacked arrays or `LayerArrays`."""
  return jax.tree.map(lambda a: a.arrays[i] if is_layer_arrays(a) else a[i], tree,
                      is_leaf=is_layer_arrays)


def swap_positions(length: int, swapped: int) -> tuple:
  """The layers of a stack of `length` whose weights live in host memory when `swapped` of them
  do: spread evenly, so that each one's copy overlaps the resident layers computed before it."""
  return tuple((2 * j + 1) * length // (2 * swapped) for j in range(swapped))


def is_swapped(leaf) -> bool:
  return isinstance(leaf, Swapped)


def swapped_stacks(params) -> list:
  """The `Swapped` stacks (or weights) of a parameter tree."""
  return [leaf for leaf in jax.tree.leaves(params, is_leaf=is_swapped) if is_swapped(leaf)]


def host_layers(params) -> int:
  """How many layers of a stack live in host memory (its params are `Swapped`), 0 if none."""
  return len(params.pinned_host) if is_swapped(params) else 0


def swap_layers(weight, swapped: int):
  """A stacked weight [length, ...] -> `Swapped` (still where `weight` is; jit-able)."""
  host = swap_positions(weight.shape[0], swapped)
  resident = np.array([i for i in range(weight.shape[0]) if i not in host], dtype=np.int32)
  return Swapped(weight[resident], tuple(weight[i] for i in host))


def pack_layers(stack, pack_layer):
  """A stack's tree of `swap_layers` weights -> one `Swapped` whose host layers are
  `layer_bytes` buffers, each made by `pack_layer` (`layer_bytes` placed in host memory)."""
  leaves, treedef = jax.tree.flatten(stack, is_leaf=is_swapped)
  return Swapped(treedef.unflatten([leaf.device for leaf in leaves]),
                 tuple(pack_layer([leaf.pinned_host[j] for leaf in leaves])
                       for j in range(len(leaves[0].pinned_host))))


def to_device(tree):
  """The tree's arrays in device memory (a copy from host memory where they are there)."""
  return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


def layer_bytes(weights):
  """One layer's weights (any dtypes, wherever they are) as one uint8 vector on the device."""
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
  return jnp.concatenate([as_bytes(a) for a in to_device(weights)])


def layer_from_bytes(buffer, like):
  """The weights of one layer from its `layer_bytes` buffer; `like`: the stack's stacked
  weights (their shapes and dtypes)."""
  leaves, treedef = jax.tree.flatten(like)
  weights, offset = [], 0
  for a in leaves:
    shape, itemsize = a.shape[1:], a.dtype.itemsize
    size = math.prod(shape) * itemsize
    raw = jax.lax.slice_in_dim(buffer, offset, offset + size).reshape(shape + ((itemsize,) if itemsize > 1 else ()))
    weights.append(jax.lax.bitcast_convert_type(raw, a.dtype))
    offset += size
  return treedef.unflatten(weights)


# ------------------------------------------------------------------------------------------------
# Running a stack.
# ------------------------------------------------------------------------------------------------


def apply_block(block: nn.Module, x, params, lora, args, key, i):
  """Layer i of a stack of `block`s (dropout key: `key` folded with i), its input and output
  split along the tokens under sequence parallelism (`sequence`)."""
  variables = {"params": params, **({"lora": lora} if lora is not None else {})}
  rngs = None if key is None else {"dropout": jax.random.fold_in(key, i)}
  x = checkpoint_name(sequence.over_tokens(x), BLOCK_INPUT)
  return sequence.over_tokens(block.apply(variables, x, *args, rngs=rngs))


# One unrolled layer: in a jitted function it is inlined (traced and lowered once for all of a
# stack's layers); in a function that `programs` splits, the point where it cuts, so that a
# stack's forward and backward programs compile once and every layer reuses them.
block_program = programs.cut_point(apply_block, static_argnums=(0,))


def run_stacks(stacks: Sequence[Stack], x, per_sample, shared, *, remat=None, key=None,
               unrolled=False):
  """The stacks one after the other on one device (the pipeline's counterpart is
  `sharding.pipeline.Pipeline.run`), each by `run_swapped` if some of its layers' weights are in
  host memory, else by `run_unrolled` or `run_scanned`."""
  for n, stack in enumerate(stacks):
    args, stack_key = (*shared, *per_sample), None if key is None else jax.random.fold_in(key, n)
    if host_layers(stack.params):
      x = run_swapped(stack, x, args, stack_key)
    elif unrolled:
      x = run_unrolled(stack, x, args, remat=remat, key=stack_key)
    else:
      x = run_scanned(stack, x, args, remat=remat, key=stack_key)
  return x


def run_scanned(stack: Stack, x, args, *, remat: Optional[Callable] = None, key=None):
  """x through the layers of `stack` by lax.scan, each rematerialised under the jax.checkpoint
  policy `remat` (None: no rematerialisation). The stacked weights are the scan's xs, which the
  backward pass reads in place."""
  assert not any(map(is_layer_arrays, jax.tree.leaves(stack.params, is_leaf=is_layer_arrays))), (
      "weights in the per-layer form run unrolled: unrolled=True")
  apply = lambda x, params, lora, i: apply_block(stack.block, x, params, lora, args, key, i)
  run = apply if remat is None else jax.checkpoint(apply, prevent_cse=False, policy=remat)
  layer = lambda x, xs: (run(x, *xs), None)
  return jax.lax.scan(layer, x, (stack.params, stack.lora, jnp.arange(stack.length)))[0]


def run_unrolled(stack: Stack, x, args, *, remat: Optional[Callable] = None, key=None):
  """x through the layers of `stack` by a Python loop of `block_program` calls, each under
  `remat`: each layer's residuals are buffers of their own rather than slices of stacked ones
  that a scan fills and copies back out (BENCHMARKS.md#flux-step-no-remat: scanned and
  unrolled). Its weights and
  LoRA are best stored per layer (`LayerArrays`). Jitted whole, this is a program of every
  layer, slow to compile at full size: the trainer runs it split into programs per block
  (`programs`), where each block's backward program recomputes it (jitted whole, XLA is free to
  schedule a remat's recomputation early, saving nothing)."""
  call = functools.partial(block_program, stack.block)
  if remat is not None:
    call = jax.checkpoint(call, policy=remat, prevent_cse=False)
  for i in range(stack.length):
    x = call(x, *layer_of((stack.params, stack.lora), i), args, key, i)
  return x


def run_chunk(stack: Stack, x, args, *, start, count, valid=None, remat: Optional[Callable] = None,
              key=None):
  """x through `count` layers of `stack` from layer `start` (a pipeline stage's chunk): each
  layer slices its weights inside a checkpoint that never saves the slice, so the backward pass
  slices again instead of keeping a stacked copy; where `valid[i]` is False, layer i passes x on
  unchanged (padding of uneven stages: computed, as the busy stages compute meanwhile, and
  selected away)."""
  apply = lambda x, params, lora, i: apply_block(stack.block, x, params, lora, args, key, i)

  @functools.partial(jax.checkpoint, prevent_cse=False,
                     policy=remat or jax.checkpoint_policies.save_anything_except_these_names(LAYER_WEIGHTS))
  def apply_layer(x, i):
    take = lambda tree: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
    return apply(x, jax.tree.map(lambda a: checkpoint_name(a, LAYER_WEIGHTS), take(stack.params)),
                 take(stack.lora), i)

  def layer(x, j):
    i = start + j
    y = apply_layer(x, i)
    return (y if valid is None else jnp.where(valid[i], y, x)), None
  return jax.lax.scan(layer, x, jnp.arange(count))[0]


def run_swapped(stack: Stack, x, args, key):
  """x through a stack whose swapped layers' weights are in host memory (`Swapped`).

  Each swapped layer is its own call, between scans of the resident layers, so its weights are
  one host buffer that the device copies by DMA beside the compute. A swapped layer and the
  resident layers after it form one `fetch_ahead` unit, whose backward pass copies the weights
  while the resident layers' backward runs; in the forward pass the copy may start two units
  before (not earlier, which would hold every layer's weights at once). Every layer is
  rematerialised in the backward pass (whatever `activation_checkpointing` says: a swapped
  layer's weights must be copied again anyway), in order (`recompute_in_order`).
  """
  def layer(x, lora, args, weights, index):
    i, weight_index, key = index  # layer, its weights' index (None: `weights` are the layer's own)
    if weight_index is not None:
      weights = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, weight_index, keepdims=False), weights)
    return apply_block(stack.block, x, weights, lora, args, key, i)

  def run_resident(x, lora, args, weights, first, end, swapped_before):
    """Layers first..end-1, all resident (weights index: layer - swapped_before)."""
    if first == end:
      return x
    step = lambda x, xs: (recompute_in_order(layer, x, xs[0], args, weights,
                                             (xs[1], xs[1] - swapped_before, key)), None)
    return jax.lax.scan(step, x, (lora, jnp.arange(first, end)))[0]

  resident = stack.params.device
  positions = swap_positions(stack.length, host_layers(stack.params))
  # The LoRA in pieces (resident runs, swapped layers) by one split, whose gradient is one
  # concatenation rather than a full-size sum per piece.
  bounds = sorted({0, stack.length, *positions, *(i + 1 for i in positions)})
  loras = dict(zip(bounds, split_layer_axis(stack.lora, np.diff(bounds).tolist())))
  stack_input, unit_inputs = x, []
  if positions[0] > 0:
    x = run_resident(x, loras[0], args, resident, 0, positions[0], 0)
  for j, first in enumerate(positions):
    end = positions[j + 1] if j + 1 < len(positions) else stack.length
    # A layer's copy takes about as long as a unit's forward pass, so it may start two units
    # ahead (with one, every other copy kept the compute waiting: measured).
    ready = unit_inputs[j - 2] if j >= 2 else stack_input
    host, _ = jax.lax.optimization_barrier((stack.params.pinned_host[j], jax.lax.stop_gradient(ready)))
    after = functools.partial(run_resident, first=first + 1, end=end, swapped_before=j + 1)
    lora = (jax.tree.map(lambda a: a[0], loras[first]), loras[first + 1] if end > first + 1 else None)
    unit_inputs.append(x)
    x = fetch_ahead(layer, after, x, lora, args, host, resident, (first, None, key))
  return x


def split_layer_axis(tree, sizes):
  """[tree of the first sizes[0] layers, of the next sizes[1], ...] (None for None)."""
  if tree is None:
    return [None] * len(sizes)
  leaves, treedef = jax.tree.flatten(tree)
  parts = [jax.lax.split(a, sizes) for a in leaves]
  return [treedef.unflatten([p[k] for p in parts]) for k in range(len(sizes))]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def recompute_in_order(layer, x, lora, args, weights, index):
  """layer(x, lora, args, weights, index), recomputed in the backward pass only once its
  cotangent has arrived: a plain remat that XLA sees unrolled (or a scan of one step, inlined)
  may be recomputed as early as XLA likes, all layers at once. No gradient for weights, index."""
  return layer(x, lora, args, weights, index)


def _recompute_in_order_fwd(layer, x, lora, args, weights, index):
  return layer(x, lora, args, weights, index), (x, lora, args, weights, index)


def _recompute_in_order_bwd(layer, residuals, ct):
  (x, lora, args, weights, index), ct = jax.lax.optimization_barrier((residuals, ct))
  return (*recomputed_vjp(layer, x, lora, args, weights, index, ct), None, None)


def recomputed_vjp(layer, x, lora, args, weights, index, ct):
  """The gradients of layer(x, lora, args, weights, index) for x, lora, args, recomputing the
  layer (whose inputs must come after ct, through an optimization_barrier)."""
  # XLA turns the barrier into an ordering, after which its CSE would merge the recomputation
  # (and a weight slice) with the forward pass's: adding 0 * ct makes new values (XLA keeps
  # 0 * y for floats, for NaN's sake).
  zero = 0 * ct.reshape(-1)[0]
  x = x + zero.astype(x.dtype)
  salt = lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.integer) else a
  index = jax.tree.map(salt, index)
  _, vjp = jax.vjp(lambda x, lora, args: layer(x, lora, args, weights, index), x, lora, args)
  # All of this layer's gradients before the layer below starts: otherwise XLA's GPU scheduler
  # puts off the LoRA weight gradients, which are off the critical path, and keeps every
  # layer's recomputed activations alive until the end of the backward pass.
  return jax.lax.optimization_barrier(vjp(ct))


recompute_in_order.defvjp(_recompute_in_order_fwd, _recompute_in_order_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fetch_ahead(layer, after, x, lora, args, host_buffer, weights, index):
  """after(layer(x, lora[0], args, the weights in host_buffer, index), lora[1], args, weights):
  a swapped layer and the resident layers (`weights`) after it. The backward pass copies the
  swapped layer's weights again as it starts, so that the copy runs beside the backward pass
  of `after` (which comes first) rather than after it. No gradient for the weights, index."""
  return after(layer(x, lora[0], args, fetch(host_buffer, weights), index), lora[1], args, weights)


def fetch(host_buffer, like):
  """One swapped layer's weights, copied from their host buffer (`like`: the stacked weights)."""
  return layer_from_bytes(to_device(host_buffer), like)


def _fetch_ahead_fwd(layer, after, x, lora, args, host_buffer, weights, index):
  y = layer(x, lora[0], args, fetch(host_buffer, weights), index)
  z, after_vjp = jax.vjp(lambda y, lora, args: after(y, lora, args, weights), y, lora[1], args)
  return z, ((x, lora[0], args, host_buffer, index, after_vjp), weights)


def _fetch_ahead_bwd(layer, after, residuals, ct):
  residuals, weights = residuals  # `weights`: only their shapes
  (x, lora, args, host_buffer, index, after_vjp), ct = jax.lax.optimization_barrier((residuals, ct))
  swapped_weights = fetch(host_buffer, weights)
  ct_y, ct_lora_after, ct_args_after = after_vjp(ct)
  ct_x, ct_lora, ct_args = recomputed_vjp(layer, x, lora, args, swapped_weights, index, ct_y)
  ct_args = jax.tree.map(jnp.add, ct_args, ct_args_after)
  return ct_x, (ct_lora, ct_lora_after), ct_args, None, None, None


fetch_ahead.defvjp(_fetch_ahead_fwd, _fetch_ahead_bwd)
