"""Loading PyTorch checkpoints (diffusers folders, original single files) into Flax parameters."""
import dataclasses
import json
import os
from typing import Optional

import jax
import numpy as np
from tqdm.auto import tqdm

from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import (CheckpointError, TensorFiles, common_prefix,
                                             open_tensor_file, safetensors_in_folder)


@dataclasses.dataclass
class Checkpoint:
  """An opened checkpoint: the model config it implies, its tensors, and how their names map
  onto ours (`table.sources`: `rows`, None for the same names, and the side they name)."""
  config: object
  files: object
  rows: Optional[tuple] = None
  holds: str = "single"


def open_checkpoint(family, path: str, axes_dims_rope=None) -> Checkpoint:
  """Resolves `path` for a model family: a diffusers pipeline folder (holding `transformer/`), a
  transformer folder (holding `config.json` and its safetensors), a released folder of the
  original names (`SingleFile.folder_class`), a folder that holds the family's original file
  where its release puts it (`SingleFile.locations`), or an original single file
  (`.safetensors`, or a torch pickle `.pt`)."""
  if os.path.isdir(path):
    single = family.single_file
    for location in single.locations if single else ():
      if os.path.isfile(os.path.join(path, location)):
        return open_checkpoint(family, os.path.join(path, location), axes_dims_rope)
    folder = os.path.join(path, "transformer")
    folder = folder if os.path.isfile(os.path.join(folder, "config.json")) else path
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
      where = f", {' or '.join(single.locations)} (the original format)" if single and single.locations else ""
      raise CheckpointError(f"{path} holds no {family.type} model: expected transformer/config.json "
                            f"(a diffusers pipeline folder), config.json (a transformer folder){where}")
    with open(config_path) as f:
      config = json.load(f)
    cls = config.get("_class_name")
    if single and single.folder_class and cls == single.folder_class:  # the original names, sharded
      files = TensorFiles(safetensors_in_folder(folder))
      return Checkpoint(single.config(files.shapes(), config, axes_dims_rope), files, single.rows, "single")
    if cls and cls != family.diffusers_class:
      raise CheckpointError(f"{config_path} describes a {cls}, not a {family.diffusers_class}: "
                            "point the path at the right model")
    return Checkpoint(family.config_from_diffusers(config), TensorFiles(safetensors_in_folder(folder)),
                      family.diffusers_rows, "parts")
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint not found: {path} (give a diffusers folder or the model's "
                          "original file)")
  single = family.single_file
  if single is None:
    raise CheckpointError(f"{path}: {family.type} loads from a diffusers folder only")
  files = open_tensor_file(path, skip=single.foreign)
  prefix = common_prefix(files.keys(), single.prefixes)
  if prefix:
    files = open_tensor_file(path, strip_prefix=prefix, skip=single.foreign)
  if single.signature not in files:
    sample = ", ".join(sorted(files.keys())[:5])
    raise CheckpointError(
        f"{path} is not a {family.diffusers_class} single file: it lacks "
        f"{single.signature} (its keys begin: {sample}). Give the original single "
        "file of this model, or a diffusers folder")
  return Checkpoint(single.config(files.shapes(), files.metadata, axes_dims_rope), files,
                    single.rows, "single")


def load_params(abstract, family, checkpoint: Checkpoint, dtype,
                put=lambda path, x: jax.device_put(x), finalize=None, progress=True,
                keeps_float8=lambda path: False):
  """Checks the checkpoint against `abstract` (eval_shape of the model's init), then converts it
  leaf by leaf into `dtype` arrays placed by `put`; `finalize(path, array)` may turn each leaf
  into other leaves ({path: array}) before the next is read (float8 storage). Leaves where
  `keeps_float8(path)` keep a float8 checkpoint's own values. Returns the tree."""
  sources = table.sources(abstract, family.stacked, checkpoint.files, checkpoint.rows,
                          checkpoint.holds)
  leaves = table.load_leaves(abstract, family.stacked, checkpoint.files, sources, np.dtype(dtype),
                             put, keeps_float8)
  n = len(table.flatten(abstract))
  flat = {}
  for path, value in tqdm(leaves, total=n, desc="loading weights", disable=not progress, unit="tensor"):
    flat.update(finalize(path, value) if finalize else {path: value})
  return table.unflatten(flat)
