"""The device mesh ('data', 'stage', 'seq': `axes.MESH`) and how arrays are placed on it, as
data; the specs come from `axes`' one table of logical names.

Data parallelism: every batch is split over 'data'; the LoRA and optimizer state are replicated
over it, so XLA all-reduces the LoRA gradients. Sequence parallelism: every block's tokens are
split over 'seq' (`diffpipe_jax.sequence`); weights and state are replicated over it. Pipeline parallelism (stages > 1, see
`pipeline.py`): the block stacks' weights, LoRA and Adam moments are stored per stage, sharded
over 'stage'; everything else (embedders, final layers) is replicated. Block swapping (one
stage): the frozen weights of `blocks_to_swap` blocks, spread evenly over the last stacks, live
in pinned host memory. Layers unrolled (`unrolled=True`, one stage): the stacked weights and
LoRA, which the blocks read, are stored one array per layer (`stacks.LayerArrays`), the swapped
layers' weights in host memory; the optimizer state stays stacked (`STACKED_WHEN_UNROLLED`).
"""
import dataclasses
import re
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from diffpipe_jax import axes
from diffpipe_jax.errors import UserError
from diffpipe_jax.sharding import pipeline as pipeline_lib
from diffpipe_jax.stacks import (SWAP_NEEDS_ONE_STAGE, LayerArrays, Swapped, layer_bytes, pack_layers,
                                 restack, swap_layers, swap_positions, unstack)

# The state's entries that stay stacked in the per-layer form: the update, one program, reads it
# whole, and per-layer arrays would make that call thousands of arrays long, each costing host
# time a step (benchmarks/HISTORY.md, "LoRA step: fewer kernels and arrays between the
# block programs").
STACKED_WHEN_UNROLLED = ("opt_state",)


def make_mesh(pipeline_stages: int = 1, devices=None, sequence_parallel: int = 1) -> Mesh:
  """A (data, stage, seq) mesh over all devices: data-parallel degree = devices / (stages x
  sequence_parallel). A sequence group, then a stage group, is consecutive devices, so that the
  attention's all-to-alls and the pipeline's transfers stay within a host."""
  devices = list(devices if devices is not None else jax.devices())
  group = pipeline_stages * sequence_parallel
  if pipeline_stages < 1 or sequence_parallel < 1 or len(devices) % group:
    raise UserError(f"pipeline_stages={pipeline_stages} x sequence_parallel={sequence_parallel} does "
                    f"not divide the {len(devices)} devices; use a divisor of {len(devices)}")
  if jax.local_device_count() % sequence_parallel:
    raise UserError(f"sequence_parallel={sequence_parallel} does not divide the "
                    f"{jax.local_device_count()} devices of a process; a sequence group is one "
                    "host's devices")
  grid = np.array(devices).reshape(len(devices) // group, pipeline_stages, sequence_parallel)
  return Mesh(grid, axes.MESH)


def param_rules(stacked: Sequence[str], pipelined: bool):
  """(regex over "/"-joined parameter paths, partition spec) pairs: the first match wins.
  They cover the weights, the LoRA and the optimizer state (whose paths end in the same names)."""
  stage = (rf"(.*/)?({'|'.join(map(re.escape, stacked))})/.*", axes.spec("layers"))
  return ((stage,) if pipelined else ()) + ((r".*", axes.spec()),)


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def tree_shardings(mesh: Mesh, tree, rules=param_rules((), False)):
  """A NamedSharding for every leaf of `tree` from `rules`; a leaf no rule covers is an error.
  The `pinned_host` layers of a `Swapped` weight are placed in that memory."""
  def spec(path, memory_kind=None):
    name = _path_name(path)
    for pattern, s in rules:
      if re.fullmatch(pattern, name):
        return NamedSharding(mesh, s, memory_kind=memory_kind)
    raise ValueError(f"no sharding rule covers {name}")

  def place(path, node):
    if not isinstance(node, Swapped):
      return spec(path)
    device = jax.tree_util.tree_map_with_path(lambda p, _: spec(path + p), node.device)
    return Swapped(device, tuple(spec(path, "pinned_host") for _ in node.pinned_host))
  return jax.tree_util.tree_map_with_path(place, tree, is_leaf=lambda x: isinstance(x, Swapped))


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the frozen weights and the training state live on `mesh`. With a pipeline `plan`,
  stacked leaves are stored per stage ([S, chunks, ...], `plan.to_stages`); checkpoints and
  exported LoRAs always hold the stacked form, so any placement can resume any other."""
  mesh: Mesh
  stacked: tuple
  plan: Optional[pipeline_lib.Plan] = None
  swap: tuple = ()  # ((stack name, how many of its layers live in pinned host memory), ...)
  unrolled: bool = False  # stacked leaves stored one array per layer (layers unrolled)

  @property
  def pipeline(self) -> Optional[pipeline_lib.Pipeline]:
    return None if self.plan is None else pipeline_lib.Pipeline(self.mesh, self.plan)

  def shardings(self, tree):
    return tree_shardings(self.mesh, tree, param_rules(self.stacked, self.plan is not None))

  def to_stages(self, tree):
    """The stacked form -> this placement's form (identity without a pipeline or `unrolled`);
    jit-able."""
    if self.unrolled:
      return pipeline_lib.map_stacked(lambda name, leaf: unstack(leaf), tree, self.stacked,
                                      skip=STACKED_WHEN_UNROLLED)
    return tree if self.plan is None else pipeline_lib.map_stacked(self.plan.to_stages, tree, self.stacked)

  def to_layers(self, tree):
    """This placement's form -> the stacked form that checkpoints and exports use."""
    if self.unrolled:
      return restack(tree)
    return tree if self.plan is None else pipeline_lib.map_stacked(self.plan.to_layers, tree, self.stacked)

  def create(self, fn, *args):
    """fn(*args), a tree in the stacked form, computed by one jit straight into this
    placement's shardings (no device holds more than its share)."""
    staged = lambda *a: self.to_stages(fn(*a))
    return jax.jit(staged, out_shardings=self.shardings(jax.eval_shape(staged, *args)))(*args)

  def put(self, path, host_array):
    """Places one converted weight (a loader's `put`): reordered into stages on the host, then
    sent to each device's share only."""
    name = pipeline_lib.is_stacked_path(path, self.stacked) if self.plan is not None else None
    if name is not None:
      host_array = self.plan.to_stages(name, host_array)
    spec = axes.spec() if name is None else axes.spec("layers")
    return jax.device_put(host_array, NamedSharding(self.mesh, spec))

  def settle(self, path, weight):
    """A placed frozen weight; in a stack with swapped layers, `Swapped`: its swapped layers moved
    to host memory, one array each (`pack` gathers them once every weight is placed); stacked and
    `unrolled`, one array per layer, the swapped layers' in host memory."""
    name = pipeline_lib.is_stacked_path(path, self.stacked)
    layers = dict(self.swap).get(name, 0)
    if self.unrolled and name is not None:
      host = swap_positions(weight.shape[0], layers) if layers else ()
      return LayerArrays(tuple(jax.device_put(a, self.host_memory) if i in host else a
                               for i, a in enumerate(unstack(weight).arrays)))
    if not layers:
      return weight
    swapped = swap_layers(weight, layers)
    return Swapped(swapped.device, jax.device_put(swapped.pinned_host, self.host_memory))

  def pack(self, params):
    """The placed frozen weights with each swapped stack's weights (`settle`d) in their final
    form, one host buffer per layer (`stacks.pack_layers`), packed one layer at a time, so that
    the device holds one layer's copy at most. Unrolled, each swapped layer's weights stay
    host arrays of their own (`programs` copies each layer's beside the compute)."""
    if self.unrolled:
      return params
    pack_layer = jax.jit(layer_bytes, out_shardings=self.host_memory)
    return {**params, **{name: pack_layers(params[name], pack_layer) for name, _ in self.swap}}

  @property
  def host_memory(self):
    return NamedSharding(self.mesh, axes.spec(), memory_kind="pinned_host")


def swapped_layers(block_stacks, blocks_to_swap: int) -> tuple:
  """((stack name, layers), ...): `blocks_to_swap` blocks taken from the model's last stack first,
  spread evenly over each stack (`stacks.swap_positions`)."""
  total = sum(length for _, length, _ in block_stacks)
  if not 0 <= blocks_to_swap <= total:
    raise UserError(f"blocks_to_swap={blocks_to_swap}; the model has {total} blocks")
  swap, left = [], blocks_to_swap
  for name, length, _ in reversed(block_stacks):
    if left:
      swap.append((name, min(length, left)))
      left -= swap[-1][1]
  return tuple(swap)


def make_placement(mesh: Mesh, block_stacks, microbatches: int, blocks_to_swap: int = 0,
                   unrolled: bool = False, partition_split: Sequence[int] = (),
                   layers_around_stacks: Sequence[int] = (), **plan_options) -> Placement:
  """The placement on `mesh` of a model whose block stacks are `block_stacks` ((name, layers,
  relative cost), in order: a family's `stacks(cfg)`); with more than one stage, their pipeline
  plan (`plan.describe()` prints it) for `microbatches` microbatches a step, balanced, or at
  diffusion-pipe's stage boundaries `partition_split` in its numbering of the model's layers
  (the family's `layers_around_stacks`, `pipeline.blocks_per_stage`); on one stage, the frozen
  weights of `blocks_to_swap` blocks in pinned host memory, and with the layers `unrolled` (see
  `runtime.remat_policy`), every stacked leaf per layer."""
  stages = mesh.shape[axes.STAGE]
  split = (pipeline_lib.blocks_per_stage(block_stacks, layers_around_stacks, partition_split, stages)
           if partition_split else None)
  plan = None
  if stages > 1:
    if blocks_to_swap:
      raise UserError(SWAP_NEEDS_ONE_STAGE)
    plan = pipeline_lib.make_plan(block_stacks, stages, microbatches, split, **plan_options)
  swap = swapped_layers(block_stacks, blocks_to_swap)
  return Placement(mesh, tuple(name for name, _, _ in block_stacks), plan, swap, unrolled=unrolled)


def global_batch(mesh: Mesh, local_batch, batch_axis: int = 1):
  """This process's rows -> one global array per leaf, split over 'data' along `batch_axis`
  (1 for [accumulation, micro batch, ...] stacks, 0 for a plain batch)."""
  sharding = NamedSharding(mesh, axes.spec(*[None] * batch_axis, "batch"))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)


def whole_rows(mesh: Mesh, batch):
  """A batch that every process holds whole -> global arrays split over 'data' along axis 0
  (the rows must divide by the data axis)."""
  sharding = NamedSharding(mesh, axes.spec("batch"))
  return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i: x[i]), batch)
