"""A diffusion-pipe training TOML, as its users wrote it, as our config.

    python main.py --config path/to/their_training.toml [--config.key=value ...]

The TOML's `[model] type` picks the family's config (configs/<type>.py); every key of the TOML is
then honoured with diffusion-pipe's meaning (most keys share our names; where one does not, or its
values differ, its schema key says how: `rules.DiffusionPipe`), listed once as having no effect
here by design (`NO_EFFECT`), or refused before anything loads with a line that says what to do
(`REFUSED`, unknown keys). Where the TOML leaves a key out, diffusion-pipe's default applies (the
schema's), not ours. Paths are used as written: relative ones resolve from the current directory,
as diffusion-pipe resolves them.
"""
import importlib

import ml_collections
from ml_collections import config_dict

from diffpipe_jax import family as family_lib, schema
from diffpipe_jax.errors import UserError
from diffpipe_jax.files import read_toml

SECTIONS = ("model", "adapter", "optimizer", "monitoring")

# Keys whose value changes nothing here, by design: the reason, printed once at start-up.
NO_EFFECT = {
    "steps_per_print": "the progress bar shows every step's loss",
    "map_num_proc": "caching reads files in one process",
    "reentrant_activation_checkpointing": "JAX's remat has no reentrant variant",
    "partition_method": "the pipeline balances each block stack over the stages itself "
                        "(partition_split sets stage boundaries)",
}

# Keys refused whatever their value, with what to do instead.
REFUSED = {
    "compile": "the step is always compiled by XLA here; remove `compile`",
    "deepspeed": "DeepSpeed settings do not apply (no DeepSpeed here); remove them",
    "zero_optimization": "DeepSpeed ZeRO does not apply: the frozen base is shared by the mesh's "
                         "stages (pipeline_stages) and only the LoRA is trained; remove it",
    "offload_optimizer": "the LoRA's optimizer state is small and stays on the device; remove it",
    "model.bypass_guidance_embedding": "models without a guidance embedding are not supported; "
                                       "remove it",
    "model.llm_adapter_lr": "not supported; remove it",
    "adapter.fuse_adapters": "merging LoRAs into the base is not supported; remove it",
    "adapter.alpha": "diffusion-pipe fixes alpha = rank (scale 1), as here; remove it",
}


def family_config(model_type: str, where: str) -> ml_collections.ConfigDict:
  """configs/<model type>.py's default config (the module is named after the type)."""
  if model_type not in family_lib.names():
    raise UserError(f"{where}: [model] type={model_type!r}; known types: {', '.join(family_lib.names())}")
  return importlib.import_module(f"diffpipe_jax.configs.{model_type.replace('-', '_')}").get_config()


def eval_datasets(value) -> dict:
  """`eval_datasets = [{name = ..., config = 'eval.toml'}, ...]` -> {name: {toml_path}}: a
  section of ours, not a key."""
  if not isinstance(value, list) or not all(isinstance(e, dict) and set(e) == {"name", "config"}
                                            for e in value):
    raise UserError("eval_datasets must be a list of {name = '...', config = "
                    f"'eval_dataset.toml'}} tables, got {value!r}")
  return {e["name"]: dict(toml_path=schema.dataset_toml(e["config"], f"eval_datasets {e['name']!r} "
                                                                    "config")) for e in value}


def translate(key: str, value, keys: dict):
  """(our key, our value) of a TOML key, or None when it has no effect here; raises for the
  refused ones. Keys of a section come as "section.key"; `keys`: the family's `schema.keys`."""
  if key in REFUSED:
    raise UserError(f"{key}: {REFUSED[key]}")
  if key in NO_EFFECT:
    if key == "partition_method" and value != "parameters":
      raise UserError(f"partition_method={value!r}: only 'parameters' (the default, "
                      "balanced stages) exists here; set partition_split for your own boundaries")
    return None
  if key == "eval_datasets":
    return "eval_datasets", eval_datasets(value)
  renamed = {k.diffusion_pipe.name: name for name, k in keys.items()
             if k.diffusion_pipe and k.diffusion_pipe.name}
  ours = renamed.get(key, key)
  theirs = keys[ours].diffusion_pipe if ours in keys else None
  return ours, tuple_of(theirs.value(value) if theirs and theirs.value else value)


def tuple_of(value):
  """TOML arrays as tuples (our configs' sequences)."""
  return tuple(map(tuple_of, value)) if isinstance(value, list) else value


def flat_keys(toml: dict, where: str) -> dict:
  """{"key" or "section.key": value} of the TOML; an unknown table is refused."""
  flat = {}
  for key, value in toml.items():
    if isinstance(value, dict) and key in SECTIONS:
      flat.update({f"{key}.{k}": v for k, v in value.items()})
    elif isinstance(value, dict) and key not in REFUSED:
      raise UserError(f"{where}: unknown table [{key}]; diffusion-pipe's tables are "
                      f"{', '.join(f'[{s}]' for s in SECTIONS)}")
    else:
      flat[key] = value
  return flat


def config_from_toml(path: str) -> tuple:
  """(our config, {key: why it has no effect}) of a diffusion-pipe training TOML."""
  toml = read_toml(path, given_as=f"--config {path}")
  model_type = toml.get("model", {}).get("type")
  if model_type is None:
    raise UserError(f"{path}: no [model] type; set it to one of {', '.join(family_lib.names())}")
  # Any value goes in as the TOML has it: validation names a wrong type with what is allowed.
  config = ml_collections.ConfigDict(family_config(model_type, path).to_dict(), type_safe=False)
  keys = schema.keys(family_lib.get(model_type))
  config.update_from_flattened_dict({name: k.diffusion_pipe.default for name, k in keys.items()
                                     if k.diffusion_pipe and k.diffusion_pipe.default is not None})
  flat, ignored, problems = flat_keys(toml, path), {}, []
  for key, value in flat.items():
    try:
      translated = translate(key, value, keys)
    except UserError as e:
      problems.append(f"{path}: {e}")
      continue
    if translated is None:
      ignored[key] = NO_EFFECT[key]
      continue
    ours, value = translated
    section, _, leaf = ours.rpartition(".")
    parent = config[section] if section else config
    if ours == "eval_datasets":
      config.eval_datasets = ml_collections.ConfigDict(value)
    elif leaf not in parent or isinstance(parent[leaf], ml_collections.ConfigDict):
      problems.append(f"{path}: {key}: unknown key for {model_type} (a typo, or a key of "
                      "another model type or of a newer diffusion-pipe?); remove it")
    else:
      parent[leaf] = value
  if problems:
    lines = "\n  ".join(problems)
    raise UserError(lines if len(problems) == 1 else f"{len(problems)} problems:\n  {lines}")
  if "output_dir" not in flat:
    raise UserError(f"{path}: no output_dir; set it (the runs are written there)")
  # an int or a list of pairs, whichever `--config.micro_batch_size_per_gpu=` gives
  config.micro_batch_size_per_gpu = config_dict.FieldReference(config.micro_batch_size_per_gpu,
                                                              field_type=object)
  return config, ignored
