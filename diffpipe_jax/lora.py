"""LoRA adapters as data: which Linear layers get one, their initialisation, and their export to
(and import from) the diffusers/PEFT safetensors format that ComfyUI and diffusers load.

Targets are a family's regular expressions over module names without block indices (the Flax
names joined by ".", e.g. `transformer_blocks.attn.to_q`), less `adapter.exclude_modules` (PEFT's
list semantics over the same names); every pattern and exclusion must match at least one Linear,
so a typo is an error rather than a silently different adapter. A family's Flax names mirror its
LoRA export format, so the exported names come from the same naming rule that loads the base
weights, behind the family's `lora_prefix`; a LoRA is read back behind any of `KEY_PREFIXES`
(diffusion-pipe writes ComfyUI's), from our folders or diffusion-pipe's.
"""
import functools
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
# a LoRA folder's weights: ours (diffusers' name), or PEFT's (diffusion-pipe's epochN/ folders)
WEIGHTS_NAMES = (WEIGHTS_NAME, "adapter_model.safetensors")
# where a family's module names may stand in a LoRA file: ComfyUI's (diffusion-pipe's exports),
# diffusers', PEFT's
KEY_PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.")


def linear_modules(abstract_params) -> dict:
  """Module name ("transformer_blocks.attn.to_out.0") -> (param path, kernel) of every Linear."""
  return {".".join(path[:-1]): (path[:-1], leaf)
          for path, leaf in table.flatten(abstract_params).items() if path[-1] == "kernel"}


def excludes(entry: str, name: str) -> bool:
  """PEFT's `exclude_modules` list semantics: the module's name is the entry or ends with it."""
  return name == entry or name.endswith("." + entry)


def select_targets(abstract_params, patterns: Sequence[str], exclude: Sequence[str] = ()) -> list:
  """The Linear modules matched by `patterns` (full-match regexes) that no `exclude` entry
  `excludes`; each pattern and each entry must match something."""
  names = linear_modules(abstract_params)
  unmatched = [p for p in patterns if not any(table.matches(n, [p]) for n in names)]
  if unmatched:
    raise UserError(f"adapter target pattern(s) {unmatched} match no Linear layer; Linear layers "
                     f"are named like {sorted(names)[:6]}")
  targets = sorted(n for n in names if table.matches(n, patterns))
  for entry in exclude:
    if not any(excludes(entry, n) for n in targets):
      raise UserError(_excludes_nothing(entry, targets))
  kept = [n for n in targets if not any(excludes(e, n) for e in exclude)]
  if not kept:
    raise UserError(f"adapter.exclude_modules={list(exclude)} excludes every LoRA target; "
                    "leave some to train")
  return kept


def check_rank(abstract_params, targets: Sequence[str], rank: int):
  """Refuses a rank above a target's smaller side, naming the target that bounds it: beyond that
  side the update's rank cannot grow, and the factors only cost memory (and a first compile
  that ran to 16 GB of host memory at rank 100000)."""
  linears = linear_modules(abstract_params)
  shapes = {name: linears[name][1].shape[-2:] for name in targets}
  name, (d_in, d_out) = min(shapes.items(), key=lambda item: min(item[1]))
  if rank > min(d_in, d_out):
    raise UserError(f"adapter.rank={rank}: at most {min(d_in, d_out)} for this model, the smaller "
                    f"side of the LoRA target {name} ({d_in} x {d_out})")


def _excludes_nothing(entry: str, targets: Sequence[str]) -> str:
  """Why an `adapter.exclude_modules` entry matches no target: a block index in it (the names
  have none: an exclusion holds across blocks), or no such module."""
  parts = entry.split(".")
  across_blocks = [e for e in (".".join(parts[:i] + parts[i + 1:]) for i in range(1, len(parts) - 1)
                               if parts[i].isdigit()) if any(excludes(e, n) for n in targets)]
  if across_blocks:
    return (f"adapter.exclude_modules entry {entry!r} names one block's module, and exclusion per "
            f"block is not supported: name the module across blocks, {across_blocks[0]!r}")
  return (f"adapter.exclude_modules entry {entry!r} excludes no LoRA target; the targets are "
          f"named without block indices, like {list(targets[::max(1, len(targets) // 6)][:6])}")


def init(abstract_params, patterns: Sequence[str], rank: int, dtype, key,
         exclude: Sequence[str] = ()) -> dict:
  """A = U(-1/sqrt(in), 1/sqrt(in)) as PEFT's default, B = 0: training starts at the base model.
  The targets: `select_targets`."""
  modules = linear_modules(abstract_params)
  targets = select_targets(abstract_params, patterns, exclude)
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


def from_torch(tensors: Mapping[str, np.ndarray], abstract_lora, stacked: Sequence[str]):
  """The inverse of `to_torch` (its keys without the prefix), checked: every expected key present,
  with its shape, none left."""
  flat, used, problems = {}, set(), []
  for path, leaf in table.flatten(abstract_lora).items():
    layers = range(leaf.shape[0]) if table.is_stacked(path, stacked) else [None]
    parts = []
    for i in layers:
      key = f"{table.diffusers_key(path, i)}.weight"
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


def weights_file(path: str) -> str:
  """The LoRA file that `path` names: the file itself; a LoRA folder (`WEIGHTS_NAMES`); or a run
  folder, diffusion-pipe's or ours, whose epochN/ (or stepN/) LoRA folder of the highest number
  is taken."""
  if not os.path.isdir(path):
    return path
  held = [os.path.join(path, n) for n in WEIGHTS_NAMES if os.path.isfile(os.path.join(path, n))]
  if held:
    return held[0]
  saves = {}  # "epoch" / "step" -> [(number, folder)]
  for entry in os.listdir(path):
    match = re.fullmatch(r"(epoch|step)(\d+)", entry)
    if match and any(os.path.isfile(os.path.join(path, entry, n)) for n in WEIGHTS_NAMES):
      saves.setdefault(match[1], []).append((int(match[2]), entry))
  newest = sorted(max(found)[1] for found in saves.values())
  if not newest:
    raise CheckpointError(f"{path} holds no LoRA: no {' or '.join(WEIGHTS_NAMES)}, nor epochN/ or "
                          "stepN/ folders holding one")
  if len(newest) > 1:
    raise CheckpointError(f"{path} holds LoRAs by epoch and by step (the newest: {' and '.join(newest)}): "
                          "name the folder to continue from")
  print(f"{path}: taking its newest LoRA, {newest[0]}/")
  return weights_file(os.path.join(path, newest[0]))


def read_tensors(path: str, family: Family) -> dict:
  """The LoRA that `path` names (`weights_file`) as {"<module>.lora_A.weight": (r, in), ...
  lora_B: (out, r)} with the family's module names, found behind its `lora_prefix` or any of
  `KEY_PREFIXES`. An alpha other than the rank (a module's `<module>.alpha`, ComfyUI's, else
  `lora_alpha` of a PEFT `adapter_config.json` beside the file) is folded into B: the update is
  alpha / rank * B A, as PEFT and ComfyUI apply it, and our adapters have scale 1."""
  path = weights_file(path)
  files = TensorFiles([path])
  prefixes = (family.lora_prefix, *KEY_PREFIXES)
  unprefixed = lambda k: k[len(next((p for p in prefixes if k.startswith(p)), "")):]
  tensors = {unprefixed(k): files[k] for k in files.keys()}
  config_path = os.path.join(os.path.dirname(path), "adapter_config.json")
  config_alpha = None
  if os.path.isfile(config_path):
    with open(config_path) as f:
      config_alpha = json.load(f).get("lora_alpha")
  for b in [k for k in tensors if k.endswith(".lora_B.weight")]:
    alpha = tensors.pop(b.removesuffix("lora_B.weight") + "alpha", config_alpha)
    rank = tensors[b].shape[-1]
    if alpha is not None and float(np.asarray(alpha, np.float32)) != rank:
      tensors[b] = np.asarray(tensors[b], np.float32) * (float(np.asarray(alpha, np.float32)) / rank)
  return tensors


def load(path: str, abstract_lora, family: Family):
  """A LoRA to continue (`adapter.init_from_existing`): ours as `save` writes it, or diffusion-
  pipe's (`read_tensors`), holding exactly this adapter's modules, at its rank."""
  return from_torch(read_tensors(path, family), abstract_lora, family.stacked)


def read(path: str, abstract_params, family: Family):
  """Any LoRA that `read_tensors` reads (ours, diffusion-pipe's, one a user downloaded),
  whatever its targets and rank: the modules it holds become the targets."""
  tensors = read_tensors(path, family)
  stacked = "|".join(map(re.escape, family.stacked))
  names = {k.rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k}
  if not names:
    raise CheckpointError(f"{path} holds no {family.lora_prefix}<module>.lora_A/B weights (nor behind "
                          f"another prefix): not a {family.type} LoRA in the diffusers/PEFT format")
  patterns = sorted({re.escape(re.sub(rf"^({stacked})\.\d+\.", r"\1.", n)) for n in names})
  ranks = sorted({v.shape[0] for k, v in tensors.items() if k.endswith(".lora_A.weight")})
  if len(ranks) != 1:
    raise CheckpointError(f"{path} mixes LoRA ranks {ranks}; one rank per file is supported")
  abstract = jax.eval_shape(lambda: init(abstract_params, patterns, ranks[0], jnp.float32, jax.random.key(0)))
  return from_torch(tensors, abstract, family.stacked)


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


@functools.partial(jax.jit, static_argnums=1)
def in_dtype(adapter, dtype):
  """The adapter's arrays in `dtype`. In the compute dtype, a model computes with it as with
  the original (each Linear converts its LoRA to that dtype, the gradient too) without a
  conversion per array: under a program per block, each conversion is a kernel launched from
  the host, thousands a step (benchmarks/HISTORY.md, "LoRA step: fewer kernels and arrays
  between the block programs")."""
  return jax.tree.map(lambda a: a.astype(dtype), adapter)
