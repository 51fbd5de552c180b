"""The device mesh ('data', 'stage') and how arrays are laid out on it, as data.

Data parallelism: every batch is split over 'data'; weights, LoRA and optimizer state are
replicated, so XLA all-reduces the LoRA gradients. Pipeline stages ('stage' > 1) land with the
pipeline loop; until then a mesh has one stage.
"""
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "stage")

# (regex over "/"-joined parameter paths, partition spec): the first match wins.
PARAM_RULES = ((r".*", P()),)


def make_mesh(pipeline_stages: int = 1, devices=None) -> Mesh:
  """A (data, stage) mesh over all devices: data-parallel degree = devices / stages."""
  devices = list(devices if devices is not None else jax.devices())
  if pipeline_stages < 1 or len(devices) % pipeline_stages:
    raise ValueError(f"pipeline_stages={pipeline_stages} does not divide the {len(devices)} devices")
  if pipeline_stages != 1:
    raise ValueError("pipeline_stages > 1 is not implemented yet; use pipeline_stages=1 "
                     "(data parallel over all devices)")
  grid = np.array(devices).reshape(len(devices) // pipeline_stages, pipeline_stages)
  return Mesh(grid, AXES)


def tree_shardings(mesh: Mesh, tree, rules=PARAM_RULES):
  """A NamedSharding for every leaf of `tree` from `rules`; a leaf no rule covers is an error."""
  def spec(path, _):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    for pattern, s in rules:
      if re.fullmatch(pattern, name):
        return NamedSharding(mesh, s)
    raise ValueError(f"no sharding rule covers {name}")
  return jax.tree_util.tree_map_with_path(spec, tree)


def global_batch(mesh: Mesh, local_batch, batch_axis: int = 1):
  """This process's rows -> one global array per leaf, split over 'data' along `batch_axis`
  (1 for [accumulation, micro batch, ...] stacks, 0 for a plain batch)."""
  sharding = NamedSharding(mesh, P(*[None] * batch_axis, "data"))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)
