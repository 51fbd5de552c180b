"""The whole training config checked in one place, before anything is written or loaded.

Every key has a rule (what values are allowed, in words and as a predicate): the shared keys in
`RULES`, a family's own model keys in its `Family.config_rules`. A key without a rule is an
unknown key, so the table covers the config by construction (tests/test_validate.py checks every
family's configs pass). Then the combinations, then the files. Each problem is one line naming the
key, the value and what is allowed; all of them are reported together.
"""
import fnmatch
import os

from diffpipe_jax import data, family as family_lib, flow, optim, stacks, tiny
from diffpipe_jax.errors import UserError
from diffpipe_jax.rules import FLAG, PROBABILITY, TEXT, Rule, choice, integer, number, numbers

DTYPES = ("float32", "bfloat16", "float16")
TRANSFORMER_DTYPES = ("", "float8")


# The shared keys (configs/common.py); `eval_datasets.*`: one entry per eval set.
RULES = {
    "output_dir": Rule("a non-empty path", lambda v: isinstance(v, str) and bool(v)),
    "seed": integer(0),
    "generate_tiny": FLAG,
    "epochs": integer(1),
    "max_steps": integer(0),
    "micro_batch_size_per_gpu": Rule(
        "an integer >= 1, or a list of [resolution, batch] pairs of integers >= 1",
        lambda v: integer(1).ok(v) or numbers(numbers(integer(1), length=2)).ok(v)),
    "image_micro_batch_size_per_gpu": integer(0),
    "eval_micro_batch_size_per_gpu": integer(0),
    "eval_gradient_accumulation_steps": integer(1),
    "partition_split": Rule("a list of increasing layer indices >= 1 (or empty)",
                            lambda v: isinstance(v, (tuple, list)) and all(map(integer(1).ok, v))
                            and list(v) == sorted(set(v))),
    "force_constant_lr": number(0),
    "save_every_n_examples": integer(0),
    "checkpoint_every_n_epochs": integer(0),
    "eval_every_n_examples": integer(0),
    "disable_block_swap_for_eval": FLAG,
    "huber_delta": number(0),
    "smooth_l1_beta": number(0),
    "uncond_fraction": PROBABILITY,
    "x_axis_examples": FLAG,
    "pipeline_stages": integer(1),
    "sequence_parallel": integer(1),
    "gradient_accumulation_steps": integer(1),
    "gradient_clipping": number(0),
    "warmup_steps": integer(0),
    "lr_scheduler": choice(*optim.SCHEDULES),
    "save_every_n_epochs": integer(0),
    "save_every_n_steps": integer(0),
    "save_dtype": choice(*DTYPES),
    "checkpoint_every_n_minutes": number(0),
    "checkpoint_every_n_steps": integer(0),
    "checkpoints_to_keep": integer(1),
    "activation_checkpointing": choice(*stacks.REMAT_POLICIES),
    "unrolled": Rule("True, False or None (True where it can be)", lambda v: v is None or isinstance(v, bool)),
    "compilation_cache_dir": TEXT,
    "blocks_to_swap": integer(0),
    "max_device_memory_gib": number(0),
    "model.type": choice(*family_lib.names()),
    "model.dtype": choice(*DTYPES),
    "model.transformer_dtype": choice(*TRANSFORMER_DTYPES),
    "model.timestep_sample_method": choice(*flow.TIMESTEP_METHODS),
    "model.sigmoid_scale": number(0, above=True),
    "model.shift": number(0, above=True),
    "model.min_t": PROBABILITY,
    "model.max_t": PROBABILITY,
    "adapter.type": choice("lora"),
    "adapter.rank": integer(1),
    "adapter.dtype": choice("float32", "bfloat16"),
    "adapter.dropout": number(0, below=1),
    "adapter.init_from_existing": TEXT,
    "adapter.exclude_modules": Rule("a list of module names", lambda v: isinstance(v, (tuple, list))
                                    and all(isinstance(m, str) and m for m in v)),
    "optimizer.type": Rule(f"one of {', '.join(map(repr, optim.OPTIMIZERS))}, in any case (automagic: "
                           "no maintained JAX library implements it)",
                           lambda v: isinstance(v, str) and v.lower() in optim.OPTIMIZERS),
    "optimizer.lr": number(0, above=True),
    "optimizer.betas": numbers(number(0, below=1), length=2),
    "optimizer.weight_decay": number(0),
    "optimizer.eps": number(0, above=True),
    "monitoring.enable_wandb": FLAG,
    "monitoring.wandb_api_key": TEXT,
    "monitoring.wandb_tracker_name": TEXT,
    "monitoring.wandb_run_name": TEXT,
    "dataset.path": TEXT,
    "dataset.toml_path": TEXT,
    "dataset.resolutions": numbers(integer(1)),
    "dataset.enable_ar_bucket": FLAG,
    "dataset.min_ar": number(0, above=True),
    "dataset.max_ar": number(0, above=True),
    "dataset.num_ar_buckets": integer(1),
    "dataset.num_repeats": integer(1),
    "dataset.caption_prefix": TEXT,
    "caching_batch_size": integer(1),
    "eval_datasets.*.path": TEXT,
    "eval_datasets.*.toml_path": TEXT,
    "eval_every_n_steps": integer(0),
    "eval_every_n_epochs": integer(0),
    "eval_before_first_step": FLAG,
    "sample_prompts": Rule("a list of prompts (or .txt files of a prompt a line)",
                           lambda v: isinstance(v, (tuple, list)) and all(isinstance(p, str) for p in v)),
    "sample_every_n_epochs": integer(0),
    "sample_every_n_steps": integer(0),
    "sample_steps": integer(0),
    "sample_guidance": number(-1),
    "sample_height": integer(0),
    "sample_width": integer(0),
    "sample_frames": integer(1),
    "sample_seed": integer(0),
    "sample_before_first_step": FLAG,
}

# The dataset section also takes the rest of diffusion-pipe's dataset keys (media.py checks them).
DATASET_KEYS_CHECKED_BY_MEDIA = ("dataset.*",)


def flatten(config, prefix="") -> dict:
  """{"a.b.c": value} of a (nested) ConfigDict or dict."""
  out = {}
  for k, v in config.items():
    if hasattr(v, "items"):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def rules(family) -> dict:
  return {**RULES, **{f"model.{k}": r for k, r in family.config_rules.items()}}


def rule_for(key: str, table: dict):
  """The rule of a flattened key (exact, else the first matching pattern), or None."""
  return table.get(key) or next((r for p, r in table.items() if fnmatch.fnmatchcase(key, p)), None)


def value_problems(values: dict, table: dict) -> list:
  problems = []
  for key, value in values.items():
    rule = rule_for(key, table)
    if rule is None:
      if not any(fnmatch.fnmatchcase(key, p) for p in DATASET_KEYS_CHECKED_BY_MEDIA):
        problems.append(f"{key}: unknown key (a typo, or a key of another model family?)")
    elif not rule.ok(value):
      problems.append(f"{key}={value!r}: must be {rule.allowed}")
  return problems


def combination_problems(config) -> list:
  problems = []
  try:
    stacks.unrolled_for(config)
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
  problems = value_problems(flatten(config), rules(family))
  problems = problems or combination_problems(config)
  problems = problems or file_problems(config, family)
  if problems:
    lines = "\n  ".join(problems)
    raise UserError(lines if len(problems) == 1 else f"{len(problems)} problems in the config:\n  {lines}")
