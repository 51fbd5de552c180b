"""The sampling command: draws with a base model and LoRAs (the sampler is `sampling.py`).

  python -m diffpipe_jax.sample --config configs/<family>.py:tiny --lora runs/.../epoch4 \\
      --prompt "a red pattern" --out out.png
  python -m diffpipe_jax.sample --config configs/<family>.py --lora a.safetensors:0.8 \\
      --lora b.safetensors --prompt prompts.txt --frames 33 --height 512 --width 512 --out clips/

(`python sample.py ...` in a checkout, as `main.py` is the training command's shortcut.) LoRAs are
our exports or any file in that format (their targets and rank are read from the file), each at a
scale; several act as one of the summed ranks.
"""
import os
from typing import Sequence

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from diffpipe_jax import (device_memory, family as family_lib, lora, media, models, runtime, sampling,
                          sharding, tiny, validate)
from diffpipe_jax.cli import parse_flags
from diffpipe_jax.errors import UserError



def output_paths(out: str, count: int, frames: int) -> list:
  """The files the sampling command writes for `--out`: a folder's (an existing folder, or a
  path without extension: `folder_paths`), or the file named, in its extension's format
  (numbered `out_NN.ext` for several prompts). An extension that cannot hold the samples (an
  image's for a video) is a UserError."""
  stem, ext = os.path.splitext(out)
  if os.path.isdir(out) or not ext:
    return sampling.folder_paths(out, count, frames)
  kind, formats = ("an image", media.IMAGE_OUT) if frames == 1 else (f"a video of {frames} frames",
                                                                     media.VIDEO_OUT)
  if ext.lower() not in formats:
    raise UserError(f"--out {out}: each sample is {kind}; name a {', '.join(formats[:-1])} or "
                    f"{formats[-1]} file, or a folder (a path without extension)")
  return [out] if count == 1 else [f"{stem}_{i:02d}{ext}" for i in range(count)]


def lora_argument(value: str):
  """`path` or `path:scale` -> (path, scale); a path that holds a ':' itself stays whole."""
  path, colon, scale = value.rpartition(":")
  if not colon or os.path.exists(value):
    return value, 1.0
  try:
    return path, float(scale)
  except ValueError:
    raise UserError(f"the scale {scale!r} of --lora {value} is not a number (--lora PATH or "
                    "PATH:SCALE)") from None


def read_adapter(loras, plain, family, placement):
  """LoRAs (path, scale) as one adapter on the placement's stages, or None."""
  adapters = [lora.scaled(lora.read(lora_path, plain, family), scale) for lora_path, scale in loras]
  return placement.to_stages(lora.combine(adapters)) if adapters else None


def run(config, loras: Sequence[str], texts: Sequence[str], out: str, steps=0, guidance=-1.0,
        frames=0, height=0, width=0, seed=None, images: Sequence[str] = (), negative=None,
        loras_2: Sequence[str] = (), guidance_2=-1.0) -> list:
  """The sampling command: the config's base model with `loras` (path[:scale] each), every
  prompt at the config's sample settings unless given (an image-to-video model's from the
  first frame of each, `images`; guided away from `negative`, by default the config's
  sample_negative_prompt). A checkpoint of two experts (`Family.sampling_experts`) samples with
  both, as its pipeline switches between them, `loras` on the first, `loras_2` on the second
  (guided by `guidance_2`, by default the config's sample_guidance_2 or the first's).
  Writes `output_paths(out, ...)`, each beside a .txt of its prompt. Returns the paths written."""
  family = family_lib.get(config.model.type)
  validate.check(config, family)
  memory = device_memory.Sharing(config.max_device_memory_gib)  # before JAX's backend starts
  if not texts:
    raise UserError("give at least one --prompt (or a .txt file of a prompt a line)")
  texts = sampling.prompt_lines(texts)
  loras, loras_2 = ([lora_argument(value) for value in values] for values in (loras, loras_2))
  for flag, given in (("--lora", loras), ("--lora_2", loras_2)):  # before anything loads
    for lora_path, _ in given:
      if not os.path.exists(lora_path):
        raise UserError(f"{flag} {lora_path} does not exist")
  experts = family.sampling_experts(config.model)
  if loras_2 and len(experts) < 2:
    raise UserError("--lora_2 is for the second expert of a checkpoint of two (model.expert "
                    "empty); this config samples one model: use --lora")
  model_configs = [model_config for model_config, _ in experts] or [config.model]
  paths = ([family.checkpoint_path(model_config) for model_config in model_configs] if experts
           else [tiny.checkpoint_path(config, family)])
  encoders = family_lib.torch_side(family).load_encoders(model_configs[0])  # (loaded when used)
  sampling.check_first_frames(encoders, len(texts), images, key="--image")
  f, h, w = sampling.size(config, encoders.pixel_multiple)
  frames, height, width = frames or f, height or h, width or w
  out_paths = output_paths(out, len(texts), frames)
  # the prompts first, their text encoders freed before JAX takes its pool (`device_memory`)
  negative = config.sample_negative_prompt if negative is None else negative
  prompts = sampling.encode_prompts(family, encoders, texts, frames, height, width, images=images,
                                    negative=negative)
  encoders.release()
  memory.training()
  # one device, the blocks unrolled (programs per block: faster than the scan), the config's
  # float8 base and swapped blocks
  placement = sharding.make_placement(sharding.make_mesh(1, jax.devices()[:1]), family.stacks(
      models.checkpoint_config(family.type, paths[0])), 1, config.blocks_to_swap, unrolled=True)
  loaded = [models.load(family.type, path, dtype=jnp.dtype(config.model.dtype),
                        transformer_dtype=config.model.transformer_dtype,
                        runtime=runtime.Runtime.of(placement), placement=placement) for path in paths]
  model = loaded[0]
  plain = models.abstract_params(family, model.module, model.config)  # the stacked form's shapes
  default_steps, default_guidance = sampling.defaults(family, config)
  steps, guidance = steps or default_steps, default_guidance if guidance < 0 else guidance
  seed = config.sample_seed if seed is None else seed
  step = sampling.step_fn(model, config.model, guidance)
  # the experts share one shape (their modules are equal), so one step program serves them all,
  # where they share the guidance too
  assert all(other.config == model.config for other in loaded), "experts of different shapes"
  guidance_2 = sampling.second_guidance(config, guidance, guidance_2)
  step_2 = step if guidance_2 == guidance else sampling.step_fn(model, config.model, guidance_2)
  # each further expert serves the steps below the lowest timestep of the one before it
  further = [sampling.Expert(below, other.params, read_adapter(given, plain, family, placement), step_2)
             for (_, below), other, given in zip(experts, loaded[1:], [loras_2, *[()] * len(loaded)])]
  with tqdm(total=steps * len(texts), desc="sampling", unit="step", dynamic_ncols=True) as bar:
    latents = sampling.draw(model, model.params, read_adapter(loras, plain, family, placement),
                            config.model, prompts, steps, guidance, seed, step=step,
                            progress=lambda i: bar.update(1), experts=further)
  written = sampling.write(encoders, latents, prompts, out_paths, encoders.frame_rate or 24)
  for path, _ in written:
    print(f"wrote {path}")
  return [path for path, _ in written]


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  if f.config is None:
    raise app.UsageError("pass --config configs/<family>.py[:variant]")
  try:
    run(f.config, f.lora or [], f.prompt or [], f.out, f.steps, f.guidance, f.frames, f.height,
        f.width, f.seed, f.image or [], f.negative_prompt, f.lora_2 or [], f.guidance_2)
  except UserError as e:
    raise SystemExit(f"error: {e}")


def define_flags():
  """The command's flags, defined when it runs (not on import: the training command's `--config`
  would clash in a process that imports both)."""
  config_flags.DEFINE_config_file("config", None, "configs/<family>.py file, optionally :variant",
                                  lock_config=True)
  flags.DEFINE_multi_string("lora", None, "a LoRA (folder or .safetensors), optionally :scale; repeat for several")
  flags.DEFINE_multi_string("lora_2", None, "a checkpoint of two experts: a LoRA of the second "
                            "(its low-noise one), as --lora; --lora's go to the first")
  flags.DEFINE_multi_string("prompt", None, "a prompt, or a .txt file of a prompt a line; repeat for several")
  flags.DEFINE_multi_string("image", None, "an image-to-video model's first frame, an image file a "
                            "prompt, in their order; repeat for several (a model that also "
                            "draws from text alone takes one a prompt or none)")
  flags.DEFINE_string("negative_prompt", None, "classifier-free families: what the samples are "
                      "guided away from (default: the config's sample_negative_prompt)")
  flags.DEFINE_string("out", "samples", "a folder, or a file: .png, .jpg, .webp (images), .mp4, .webm "
                      "(videos); numbered _NN for several prompts")
  flags.DEFINE_integer("steps", 0, "sampling steps (0: the config's sample_steps, else the pipeline's)")
  flags.DEFINE_float("guidance", -1.0, "guidance (< 0: the config's sample_guidance, else the pipeline's)")
  flags.DEFINE_float("guidance_2", -1.0, "a checkpoint of two experts: the second's guidance (< 0: "
                     "the config's sample_guidance_2, else --guidance's)")
  flags.DEFINE_integer("frames", 0, "frames (video families; 0: the config's sample_frames)")
  flags.DEFINE_integer("height", 0, "pixels (0: the config's sample_height, else its first resolution)")
  flags.DEFINE_integer("width", 0, "pixels (0: the config's sample_width, else its first resolution)")
  flags.DEFINE_integer("seed", None, "prompt i's noise seed is seed + i (default: the config's sample_seed)")


def run_command():
  define_flags()
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run_command()
