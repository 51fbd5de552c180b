"""The config every family's file starts from: every key at its default (each declared once,
with its rule and what it does, in diffpipe_jax/schema.py and the family's `model_keys`), and
the `:tiny` variant's shared settings.
"""
import os

import ml_collections

from diffpipe_jax import family as family_lib, schema, tiny as tiny_defaults
from diffpipe_jax.errors import UserError

VARIANTS = ("", "tiny")  # every family's: the released model's defaults, and `tiny`


def check_variant(config_file: str, variant: str, own=()):
  """Refuses `--config configs/<family>.py:<variant>` for a variant other than `VARIANTS` and
  the family's `own`."""
  variants = VARIANTS + tuple(own)
  if variant not in variants:
    name = f"configs/{os.path.basename(config_file)}"
    raise UserError(f"--config {name}:{variant}: no such variant; use "
                    + " or ".join(f"{name}:{v}" if v else name for v in variants))


def base(model_type: str) -> ml_collections.ConfigDict:
  """The family's config with every key at its default."""
  return schema.config(family_lib.get(model_type))


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `:tiny` variant's shared settings: a random tiny pipeline and a small synthetic
  captioned image set written under runs/tiny/ on first use, float32, a few steps (CPU, no
  downloads)."""
  c.output_dir += "_tiny"
  c.epochs = 4
  c.micro_batch_size_per_gpu = 2
  c.gradient_accumulation_steps = 2  # 12 items in 3 buckets: 3 steps an epoch
  c.checkpoint_every_n_steps = 4
  c.save_dtype = "float32"
  c.unrolled = False  # on the CPU the scan compiles faster than the programs per block
  c.generate_tiny = True
  c.model.diffusers_path = tiny_defaults.pipeline_dir(c.model.type)
  c.model.dtype = "float32"
  c.adapter.rank = 4
  c.optimizer.lr = 1e-3
  c.dataset.path = tiny_defaults.IMAGES
  c.dataset.resolutions = (32,)
  c.caching_batch_size = 4
  c.eval_datasets.tiny_eval = dict(path=tiny_defaults.EVAL_IMAGES, toml_path="")  # a folder, not a TOML
  c.sample_prompts = ("a red pattern", "a blue pattern")
  c.sample_every_n_epochs = 2
  c.sample_steps = 4
  return c


def tiny_video(c: ml_collections.ConfigDict, frame_buckets) -> ml_collections.ConfigDict:
  """The `:tiny` variant of a video family: `tiny`'s settings on the synthetic clips and images
  at 64 pixels, in `frame_buckets`, the samples of their middle length."""
  tiny(c)
  c.dataset.path = tiny_defaults.VIDEOS
  c.dataset.resolutions = (64,)
  c.dataset.frame_buckets = frame_buckets
  c.sample_frames = frame_buckets[1]
  return c
