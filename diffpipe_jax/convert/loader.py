"""Loading PyTorch checkpoints (diffusers folders, original single files) into Flax parameters."""
import json
import os

import jax
import numpy as np
from tqdm.auto import tqdm

from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import CheckpointError, TensorFiles, common_prefix, safetensors_in_folder


def open_checkpoint(family, path: str, axes_dims_rope=None):
  """Resolves `path` for a model family: returns (config, tensor files, single-file rows or None).

  `path` is a diffusers pipeline folder (holding `transformer/`), a transformer folder (holding
  `config.json` and its safetensors), or an original single `.safetensors` file.
  """
  if os.path.isdir(path):
    folder = os.path.join(path, "transformer")
    folder = folder if os.path.isfile(os.path.join(folder, "config.json")) else path
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
      raise CheckpointError(f"{path} holds no diffusers model: expected transformer/config.json "
                            "(a pipeline folder) or config.json (a transformer folder)")
    with open(config_path) as f:
      config = json.load(f)
    cls = config.get("_class_name")
    if cls and cls != family.diffusers_class:
      raise CheckpointError(f"{config_path} describes a {cls}, not a {family.diffusers_class}: "
                            "point the path at the right model")
    return family.config_from_diffusers(config), TensorFiles(safetensors_in_folder(folder)), None
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint not found: {path} (give a diffusers folder or a .safetensors file)")
  single = family.single_file
  if single is None:
    raise CheckpointError(f"{path}: {family.type} loads from a diffusers folder only")
  files = TensorFiles([path], skip=single.foreign)
  prefix = common_prefix(files.keys(), single.prefixes)
  if prefix:
    files = TensorFiles([path], strip_prefix=prefix, skip=single.foreign)
  if single.signature not in files:
    sample = ", ".join(sorted(files.keys())[:5])
    raise CheckpointError(
        f"{path} is not a {family.diffusers_class} single file: it lacks "
        f"{single.signature} (its keys begin: {sample}). Give the original single "
        "file of this model, or a diffusers folder")
  return single.config(files.shapes(), files.metadata, axes_dims_rope), files, single.rows


def load_params(abstract, family, files, rows, dtype, put=lambda path, x: jax.device_put(x),
                finalize=None, progress=True):
  """Checks the checkpoint against `abstract` (eval_shape of the model's init), then converts it
  leaf by leaf into `dtype` arrays placed by `put`; `finalize(path, array)` may turn each leaf
  into other leaves ({path: array}) before the next is read (float8 storage). Returns the tree."""
  sources = table.sources(abstract, family.stacked, files, rows)
  leaves = table.load_leaves(abstract, family.stacked, files, sources, np.dtype(dtype), put)
  n = len(table.flatten(abstract))
  flat = {}
  for path, value in tqdm(leaves, total=n, desc="loading weights", disable=not progress, unit="tensor"):
    flat.update(finalize(path, value) if finalize else {path: value})
  return table.unflatten(flat)
