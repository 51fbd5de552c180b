"""LoRA adapters as data: which Linear layers get one, their initialisation, and their export to
(and import from) the diffusers/PEFT safetensors format that ComfyUI and diffusers load.

Targets are a family's regular expressions over module names without block indices (the Flax
names joined by ".", e.g. `transformer_blocks.attn.to_q`); every pattern must match at least one
Linear, so a typo is an error rather than a silently smaller adapter. A family's Flax names
mirror its LoRA export format, so the exported names come from the same naming rule that loads
the base weights, behind the family's `lora_prefix`.
"""
import json
import os
import re
import shutil
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import CheckpointError, TensorFiles, write_safetensors
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import Family

WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


def linear_modules(abstract_params) -> dict:
  """Module name ("transformer_blocks.attn.to_out.0") -> (param path, kernel) of every Linear."""
  return {".".join(path[:-1]): (path[:-1], leaf)
          for path, leaf in table.flatten(abstract_params).items() if path[-1] == "kernel"}


def select_targets(abstract_params, patterns: Sequence[str]) -> list:
  """The Linear modules matched by `patterns` (full-match regexes); each must match something."""
  names = linear_modules(abstract_params)
  unmatched = [p for p in patterns if not any(table.matches(n, [p]) for n in names)]
  if unmatched:
    raise UserError(f"adapter target pattern(s) {unmatched} match no Linear layer; Linear layers "
                     f"are named like {sorted(names)[:6]}")
  return sorted(n for n in names if table.matches(n, patterns))


def init(abstract_params, patterns: Sequence[str], rank: int, dtype, key) -> dict:
  """A = U(-1/sqrt(in), 1/sqrt(in)) as PEFT's default, B = 0: training starts at the base model."""
  modules = linear_modules(abstract_params)
  targets = select_targets(abstract_params, patterns)
  flat = {}
  for name, k in zip(targets, jax.random.split(key, len(targets))):
    path, kernel = modules[name]
    *lead, d_in, d_out = kernel.shape
    bound = 1.0 / np.sqrt(d_in)
    flat[path + ("lora_A",)] = jax.random.uniform(k, (*lead, d_in, rank), dtype, -bound, bound)
    flat[path + ("lora_B",)] = jnp.zeros((*lead, rank, d_out), dtype)
  return table.unflatten(flat)


def to_torch(lora, stacked: Sequence[str], prefix: str) -> dict:
  """Our adapter -> {f"{prefix}{exported module}.lora_A.weight": (r, in), ...lora_B: (out, r)}."""
  out = {}
  for path, value in table.flatten(lora).items():
    value = np.asarray(jax.device_get(value))
    for i in range(value.shape[0]) if table.is_stacked(path, stacked) else [None]:
      out[f"{prefix}{table.diffusers_key(path, i)}.weight"] = (value if i is None else value[i]).T
  return out


def from_torch(tensors: Mapping[str, np.ndarray], abstract_lora, stacked: Sequence[str], prefix: str):
  """The inverse of `to_torch`, checked: every expected key present, with its shape, none left."""
  flat, used, problems = {}, set(), []
  for path, leaf in table.flatten(abstract_lora).items():
    layers = range(leaf.shape[0]) if table.is_stacked(path, stacked) else [None]
    parts = []
    for i in layers:
      key = f"{prefix}{table.diffusers_key(path, i)}.weight"
      want = (leaf.shape[1:] if i is not None else leaf.shape)[::-1]
      if key not in tensors:
        problems.append(f"missing {key}")
      elif tuple(tensors[key].shape) != tuple(want):
        problems.append(f"{key}: file {tuple(tensors[key].shape)}, adapter {tuple(want)}")
      else:
        parts.append(np.asarray(tensors[key], np.float32).T)
        used.add(key)
    if len(parts) == len(layers):
      flat[path] = jnp.asarray(np.stack(parts) if layers != [None] else parts[0], leaf.dtype)
  problems += [f"unexpected {k}" for k in sorted(set(tensors) - used)]
  if problems:
    file_ranks = sorted({v.shape[0] for k, v in tensors.items() if k.endswith(".lora_A.weight")})
    rank = next(leaf.shape[-1] for path, leaf in table.flatten(abstract_lora).items()
                if path[-1] == "lora_A")
    if file_ranks and file_ranks != [rank]:
      raise CheckpointError(f"the LoRA file has rank {'/'.join(map(str, file_ranks))}, this adapter "
                            f"rank {rank}: set adapter.rank={file_ranks[0]} to continue it")
    raise CheckpointError(f"the LoRA file does not match this adapter's targets ({len(problems)} "
                          f"differences: {'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})")
  return table.unflatten(flat)


def save(lora, directory: str, family: Family, rank: int, save_dtype):
  """Writes `directory/pytorch_lora_weights.safetensors` (+ PEFT `adapter_config.json`) through a
  temporary directory renamed into place, so a crash never leaves half an adapter."""
  prefix = family.lora_prefix
  tensors = {k: v.astype(save_dtype) for k, v in to_torch(lora, family.stacked, prefix).items()}
  modules = sorted({k[len(prefix):].rsplit(".lora_", 1)[0] for k in tensors})
  config = dict(peft_type="LORA", r=rank, lora_alpha=rank, target_modules=modules, lora_dropout=0.0,
                bias="none", use_dora=False, use_rslora=False, init_lora_weights=True,
                fan_in_fan_out=False, modules_to_save=None, rank_pattern={}, alpha_pattern={},
                task_type=None, base_model_name_or_path=None)
  tmp = directory.rstrip("/") + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    os.makedirs(tmp)
    write_safetensors(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
      json.dump(config, f, indent=2)
  except BaseException:  # a full disk, a signal: nothing half-written stays
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  shutil.rmtree(directory, ignore_errors=True)
  os.replace(tmp, directory)
  return os.path.join(directory, WEIGHTS_NAME)


def load(path: str, abstract_lora, family: Family):
  """Reads an adapter written by `save` (a directory or the .safetensors file itself)."""
  if os.path.isdir(path):
    path = os.path.join(path, WEIGHTS_NAME)
  files = TensorFiles([path])
  return from_torch({k: files[k] for k in files.keys()}, abstract_lora, family.stacked,
                    family.lora_prefix)


def read(path: str, abstract_params, family: Family):
  """Any LoRA file in our export format (ours, or one a user downloaded), whatever its targets
  and rank: the modules it holds become the targets. A PEFT `adapter_config.json` beside it with
  a `lora_alpha` other than the rank scales B by alpha / rank, as PEFT applies it."""
  folder = path if os.path.isdir(path) else os.path.dirname(path)
  path = os.path.join(path, WEIGHTS_NAME) if os.path.isdir(path) else path
  files = TensorFiles([path])
  tensors = {k: files[k] for k in files.keys()}
  prefix, stacked = family.lora_prefix, "|".join(map(re.escape, family.stacked))
  names = {k[len(prefix):].rsplit(".lora_", 1)[0] for k in tensors if k.startswith(prefix)}
  if not names:
    raise CheckpointError(f"{path} holds no {prefix}*.lora_A/B weights: not a {family.type} LoRA "
                          "in the diffusers/PEFT format")
  patterns = sorted({re.escape(re.sub(rf"^({stacked})\.\d+\.", r"\1.", n)) for n in names})
  ranks = sorted({v.shape[0] for k, v in tensors.items() if k.endswith(".lora_A.weight")})
  if len(ranks) != 1:
    raise CheckpointError(f"{path} mixes LoRA ranks {ranks}; one rank per file is supported")
  abstract = jax.eval_shape(lambda: init(abstract_params, patterns, ranks[0], jnp.float32, jax.random.key(0)))
  adapter = from_torch(tensors, abstract, family.stacked, prefix)
  config_path = os.path.join(folder, "adapter_config.json")
  if os.path.isfile(config_path):
    with open(config_path) as f:
      alpha = json.load(f).get("lora_alpha", ranks[0])
    adapter = scaled(adapter, alpha / ranks[0])
  return adapter


def scaled(adapter, scale: float):
  """The adapter whose update is `scale` times this one's (B scaled)."""
  return {k: scaled(v, scale) if isinstance(v, dict) else v * scale if k == "lora_B" else v
          for k, v in adapter.items()}


def combine(adapters: Sequence[dict]):
  """Several adapters as one whose update is their sum: per module, A and B concatenated along
  the rank (a module that only some adapters hold gets only theirs)."""
  flat = [table.flatten(a) for a in adapters]
  modules = sorted({path[:-1] for f in flat for path in f})
  out = {}
  for m in modules:
    held = [f for f in flat if m + ("lora_A",) in f]
    out[m + ("lora_A",)] = jnp.concatenate([f[m + ("lora_A",)] for f in held], axis=-1)
    out[m + ("lora_B",)] = jnp.concatenate([f[m + ("lora_B",)] for f in held], axis=-2)
  return table.unflatten(out)
