"""The whole training config checked in one place, before anything is written or loaded.

Every key has a rule (what values are allowed, in words and as a predicate), declared with the
key in `schema.SHARED` or the family's `model_keys`. A key without one is an unknown key. Then
the combinations, then the files. Each problem is one line naming the key, the value and what is
allowed; all of them are reported together.
"""
import fnmatch
import os

from diffpipe_jax import data, runtime, schema, tiny
from diffpipe_jax.errors import UserError


def flatten(config, prefix="") -> dict:
  """{"a.b.c": value} of a (nested) ConfigDict or dict."""
  out = {}
  for k, v in config.items():
    if hasattr(v, "items"):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def rule_for(name: str, keys: dict):
  """The rule of a flattened key (exact, else the first matching pattern) in `keys`
  (`schema.keys`), or None."""
  key = keys.get(name) or next((k for p, k in keys.items() if fnmatch.fnmatchcase(name, p)), None)
  return key.rule if key else None


def value_problems(values: dict, keys: dict) -> list:
  problems = []
  for key, value in values.items():
    rule = rule_for(key, keys)
    if rule is None:
      problems.append(f"{key}: unknown key (a typo, or a key of another model family?)")
    elif not rule.ok(value):
      problems.append(f"{key}={value!r}: must be {rule.allowed}")
  return problems


def combination_problems(config) -> list:
  problems = []
  try:
    runtime.unrolled_for(config)
  except UserError as e:
    problems.append(str(e))
  if config.model.min_t >= config.model.max_t:
    problems.append(f"model.min_t={config.model.min_t} and model.max_t={config.model.max_t}: min_t "
                    "must be below max_t")
  if config.huber_delta and config.smooth_l1_beta:
    problems.append(f"huber_delta={config.huber_delta} and smooth_l1_beta={config.smooth_l1_beta}: "
                    "each picks the loss; set one")
  if config.partition_split and len(config.partition_split) != config.pipeline_stages - 1:
    problems.append(f"partition_split={list(config.partition_split)}: {config.pipeline_stages} "
                    f"pipeline_stages need {config.pipeline_stages - 1} boundaries")
  if config.dataset.path and config.dataset.toml_path:
    problems.append(f"dataset.path={config.dataset.path!r} and dataset.toml_path="
                    f"{config.dataset.toml_path!r}: the TOML lists the directories; set only one")
  if not (config.dataset.path or config.dataset.toml_path or config.dataset.get("directories")):
    problems.append("dataset.path='': set dataset.path (a folder of images and captions) or "
                    "dataset.toml_path (a diffusion-pipe dataset.toml)")
  return problems


def unwritable(folder: str) -> str | None:
  """Why `folder` (made if absent) cannot take new files: its nearest existing ancestor is a
  file or not writable; None when it can."""
  existing = os.path.abspath(folder)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{existing} is a file"
  if not os.access(existing, os.W_OK | os.X_OK):  # a read-only filesystem refuses root too
    return f"{existing} is not writable (a read-only filesystem or folder)"
  return None


def file_problems(config, family) -> list:
  """Paths that must exist now (all but those `generate_tiny` writes: `tiny.generates`), and
  output_dir, which must be writable."""
  problems = []
  why = unwritable(config.output_dir)
  if why:
    problems.append(f"output_dir={config.output_dir!r}: {why}; set output_dir to a folder you can write")
  try:
    model_path = family.checkpoint_path(config.model)
    if not (os.path.exists(model_path) or tiny.generates(config, model_path)):
      key = next(k for k, v in config.model.items() if v == model_path)  # the key that names it
      problems.append(f"model.{key}={model_path!r}: no such file or directory")
  except UserError as e:  # no path set
    problems.append(str(e))
  if config.adapter.init_from_existing and not os.path.exists(config.adapter.init_from_existing):
    problems.append(f"adapter.init_from_existing={config.adapter.init_from_existing!r}: no such "
                    "file or directory (a LoRA .safetensors file or folder, or a run folder of them)")
  for name, e in config.eval_datasets.items():
    if e.get("toml_path"):
      try:
        data.dataset_settings(dict(toml_path=e.toml_path))
      except UserError as err:
        problems.append(f"eval_datasets.{name}.toml_path: {err}")
    elif not (os.path.isdir(e.get("path", "")) or tiny.generates(config, e.get("path", ""))):
      problems.append(f"eval_datasets.{name}.path={e.get('path', '')!r}: no such directory")
  if not tiny.generates(config, config.dataset.path):
    try:  # every dataset key, the TOML's and its folders included
      data.dataset_settings(config.dataset)
    except UserError as e:
      problems.append(str(e))
  return problems


def check(config, family):
  """Raises `UserError` listing every problem of `config` (one line each), or returns."""
  # In stages, each reading only values that passed the one before.
  problems = value_problems(flatten(config), schema.keys(family))
  problems = problems or combination_problems(config)
  problems = problems or file_problems(config, family)
  if problems:
    lines = "\n  ".join(problems)
    raise UserError(lines if len(problems) == 1 else f"{len(problems)} problems in the config:\n  {lines}")
