"""A model family as one record, and the families by diffusion-pipe's `model.type`.

Each model file (`models/<family>.py`, named after its model.type: `ltx-video` is
`models/ltx_video.py`) ends with `FAMILY = Family(...)`: everything the generic
trainer needs to know about the family, as data or functions. The record is frozen and has no
defaults, so a family that misses a field fails when its file is imported, not three modules
later. Its torch side (VAE and text encoders, the tiny pipeline writer) is a module of its own,
`encoders/<family>.py`, ending with `TORCH_SIDE = TorchSide(...)`, imported only when caching
or writing tiny models (`torch_side`). Generic code resolves the family once (`get`) and then
passes the record around.
"""
import dataclasses
import importlib
import importlib.util
import pkgutil
from typing import Callable, Optional

from diffpipe_jax.errors import UserError

MODELS = "diffpipe_jax.models"  # a family per module, but for the layers they share
SHARED = ("layers",)


def config_dataclass(cls, cfg: dict, fixed: Optional[dict] = None, why: str = ""):
  """A family's config dataclass (diffusers' names) from a config.json dict: its fields by name,
  other keys ignored, lists as tuples, `out_channels` defaulting to `in_channels` as diffusers
  does. `fixed`: keys whose other values are not implemented (`why`), refused."""
  unsupported = {k: cfg[k] for k, v in (fixed or {}).items() if k in cfg and cfg[k] != v}
  if unsupported:
    raise UserError(f"{cls.__name__} {unsupported} is not supported{why}; expected {fixed}")
  kw = {f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.name in cfg}
  kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
  if "out_channels" in kw or "in_channels" in kw:
    kw["out_channels"] = kw.get("out_channels") or kw.get("in_channels", cls.in_channels)
  return cls(**kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SingleFile:
  """An original single-file format (BFL's Flux, Lightricks' LTX, Tencent's HunyuanVideo): its
  conversion `rows` onto our names (`convert.table`, the file holding the fused modules; None:
  the file's names are ours), a key that identifies the model, the key prefixes of repackaged
  files, the key prefixes of other models the file may also hold (a VAE: never loaded),
  `config(shapes, metadata, axes_dims_rope)`: the model config from the tensor shapes and the
  file's metadata, `locations`: where the file lies inside the model's released folder
  (Tencent's `.pt`), so that the folder itself can be given, and `folder_class`: the
  `_class_name` of the config.json of a released folder that holds the original names in
  safetensors shards (Wan-AI's "WanModel"; its config is passed to `config` as the metadata)."""
  rows: Optional[tuple]
  signature: str
  prefixes: tuple
  foreign: tuple
  config: Callable
  locations: tuple = ()
  folder_class: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How the family's diffusers pipeline samples (`diffpipe_jax.sampling`): `scheduler(cfg)`, the
  released scheduler config (a diffusers folder's own wins; its `_class_name` picks the solver,
  FlowMatchEulerDiscreteScheduler where it names none: `sampling.solver`); `spacing`, its
  pipeline's sigmas before the shift (`sampling.SPACINGS`): N from 1 to 1/N ("1/N"), N + 1 from
  1 to 0 without the last ("0"), or none passed, the scheduler's own ("scheduler"); how guidance
  enters: "embedded" (the guidance embedding, as `model.guidance` through `training_inputs`) or
  "cfg" (classifier-free, against the negative prompt); the pipeline's default `steps` and
  `guidance`; `latent_shape(cfg, grid)`: one sample's latents for a latent grid (the encoders'
  `latent_grid`); `given(cfg, conditioning, latents)`: the drawn latents with what the
  conditioning gives of them in place (a first frame the model takes clean), as the pipeline
  returns them."""
  scheduler: Callable
  spacing: str
  guidance_mode: str
  steps: int
  guidance: float
  latent_shape: Callable
  given: Callable = lambda cfg, conditioning, latents: latents


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
  """One model family. `cfg` below is the family's model config (its `config_from_diffusers`);
  `model_config` the trainer config's `model` section."""
  type: str  # diffusion-pipe's model.type
  diffusers_class: str  # the diffusers transformer class (config.json's `_class_name`)
  config_from_diffusers: Callable  # config.json dict -> cfg
  # our names from a diffusers folder's (`convert.table` rows, the folder holding the parts);
  # None: the same names (Flux, LTX-Video)
  diffusers_rows: Optional[tuple]
  single_file: Optional[SingleFile]  # the original single-file format, if the family has one
  checkpoint_path: Callable  # model_config -> the transformer's path (a folder or a file)
  model_keys: dict  # the family's own `model` keys -> their `rules.Key` (as `schema.SHARED`)
  make_module: Callable  # (cfg, dtype=, param_dtype=, attention_impl=) -> module
  stacks: Callable  # cfg -> ((stack name, layers, relative cost of a layer), ...), in order
  stacked: tuple  # the stacks' names (parameter subtrees with a leading layer axis)
  # diffusion-pipe's pipeline layers that are no block, before each stack and after the last
  # (len(stacks) + 1 counts: the input embedding, a join of two streams, the final layer): with
  # the blocks, its numbering of the model's layers, which `partition_split` splits into stages
  layers_around_stacks: tuple
  lora_targets: tuple  # full-match regexes over module names: the Linears that get a LoRA
  float8_targets: tuple  # ... whose frozen kernels float8 storage covers
  lora_prefix: str  # the key prefix of exported LoRAs (what diffusers' and ComfyUI's loaders expect)
  check_inputs: Callable  # (cfg, forward inputs) -> the inputs, checked and normalised
  random_inputs: Callable  # (cfg, batch, grid..., seed=) -> random forward inputs (numpy)
  random_batch: Callable  # (cfg, batch, grid..., seed=) -> a random batch of cached samples
  shared_inputs: tuple  # forward inputs without a batch axis
  # a cached bucket's latent grid -> the position ids of its batches; None: the model takes
  # unpacked latents and derives the positions from their shape (HunyuanVideo)
  position_ids: Optional[Callable]
  shift_timesteps: Callable  # (model_config, t, latents) -> the training timesteps
  training_inputs: Callable  # (model_config, cfg, batch, noisy latents, t) -> forward inputs
  # (model_config, cfg, key, batch, noisy latents, t [B]) -> (noisy latents, t [B] or per
  # token [B, L], loss mask or None: [B, L] for packed latents, else one that broadcasts to the
  # error without its last axis): a family that trains on partly clean latents (LTX-Video's and
  # Wan 2.2 TI2V's first-frame conditioning); None: none
  condition: Optional[Callable]
  sampling: Sampling
  # model_config -> ((the model_config of each expert, the timestep (0..1) from which it serves
  # the sampler's steps), ...) from high noise down, where the checkpoint holds several experts
  # and model_config picks none (its pipeline switches between them); () for one model
  sampling_experts: Callable = lambda model_config: ()
  torch_side: str  # the module of its `TorchSide`


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchSide:
  """A family's PyTorch side, for caching and for tests: `load_encoders(model_config, device=,
  dtype=)` -> `encoders.Encoders`; `write_tiny_pipeline(root, seed=0)` writes a complete tiny
  pipeline folder, and `write_tiny_pipeline(root, kind=kind)` one of the other `tiny_kinds` (the
  first, "", is that default: Wan's "i2v" and "ti2v" are its other models' pipelines);
  `build_tiny(seed=0, **config)` a random tiny transformer (float32, eval);
  `save_tiny(model, root)` -> {format name: path}, the model in every format the loader takes;
  `pipeline`: the diffusers pipeline class whose `load_lora_weights` takes our exported LoRAs."""
  load_encoders: Callable
  write_tiny_pipeline: Callable
  tiny_kinds: tuple
  build_tiny: Callable
  save_tiny: Callable
  pipeline: str


def names() -> tuple:
  """Every family's model.type: one per module of `models/`, found without importing them."""
  folders = importlib.util.find_spec(MODELS).submodule_search_locations
  return tuple(sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(folders)
                      if m.name not in SHARED))


def get(model_type: str) -> Family:
  """The family of diffusion-pipe's `model.type`, its model file imported on first use."""
  if model_type not in names():
    raise UserError(f"unknown model type {model_type!r}; known: {list(names())}")
  family = importlib.import_module(f"{MODELS}.{model_type.replace('-', '_')}").FAMILY
  assert family.type == model_type, (family.type, model_type)
  return family


def torch_side(family: Family) -> TorchSide:
  return importlib.import_module(family.torch_side).TORCH_SIDE
