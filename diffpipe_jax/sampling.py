"""The sampler: the flow-matching Euler sampler of each family's diffusers pipeline, in JAX, with
LoRAs; used by the training loop's samples and by the sampling command (`sample.py`).

Given the same initial noise, prompt embeddings, steps and guidance, the latents equal the
family's diffusers pipeline's (tests/test_sample.py). The schedule is the pipeline's: sigmas
shifted as its FlowMatchEulerDiscreteScheduler config says (the diffusers folder's own, else the
released model's: `Family.sampling`), x <- x + (sigma_next - sigma) v in float32. Guidance goes
into the model's guidance embedding or is classifier-free against the empty prompt, as the
family's pipeline does it. What a step computes from its noise level alone (the blocks' AdaLN
modulations) is computed for every step at once, before the first (`programs.ahead_of_calls`).
"""
import copy
import dataclasses
import hashlib
import json
import os
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from diffpipe_jax import buckets, lora, media, programs, sequence
from diffpipe_jax.errors import UserError
from diffpipe_jax.files import atomic_write, read_toml


def scheduler_config(family, cfg, model_config) -> dict:
  """The diffusers folder's scheduler/scheduler_config.json if it has one, else the released."""
  path = os.path.join(model_config.get("diffusers_path", ""), "scheduler", "scheduler_config.json")
  if model_config.get("diffusers_path") and os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  return family.sampling.scheduler(cfg)


SPACINGS = ("1/N", "0", "scheduler")  # `Sampling.spacing`: what the pipeline passes `set_timesteps`


def base_sigmas(scheduler: dict, steps: int, spacing: str) -> np.ndarray:
  """A pipeline's sigmas before the shift: N from 1 to 1/N, N + 1 from 1 to 0 without the last,
  or, where it passes none, the scheduler's own: N timesteps from its training schedule's first
  sigma to its last (1 / num_train_timesteps, shifted there unless the shift is dynamic)."""
  if spacing == "1/N":
    return np.linspace(1.0, 1.0 / steps, steps)
  if spacing == "0":
    return np.linspace(1.0, 0.0, steps + 1)[:-1]
  assert spacing == "scheduler", spacing
  n = scheduler.get("num_train_timesteps", 1000)
  ends = np.array([1.0, 1.0 / n], np.float32)
  if not scheduler.get("use_dynamic_shifting"):
    shift = np.float32(scheduler.get("shift", 1.0))
    ends = shift * ends / (1 + (shift - 1) * ends)
  return np.linspace(float(ends[0]) * n, float(ends[1]) * n, steps) / n


def sigmas(scheduler: dict, steps: int, tokens: int, spacing: str) -> np.ndarray:
  """The N + 1 sigmas (the last 0) of a pipeline's `set_timesteps` for `tokens` latent tokens,
  as FlowMatchEulerDiscreteScheduler computes them (float32)."""
  if steps < 1:
    raise UserError(f"sampling needs at least 1 step, got {steps}")
  s = base_sigmas(scheduler, steps, spacing).astype(np.float32)
  if scheduler.get("use_dynamic_shifting"):
    # the pipelines' `calculate_shift`: mu linear in the tokens, base_shift at base_image_seq_len
    lo, hi = scheduler.get("base_image_seq_len", 256), scheduler.get("max_image_seq_len", 4096)
    base_shift, max_shift = scheduler.get("base_shift", 0.5), scheduler.get("max_shift", 1.15)
    mu = base_shift + (max_shift - base_shift) * (tokens - lo) / (hi - lo)
    e_mu = np.exp(mu) if scheduler.get("time_shift_type", "exponential") == "exponential" else mu
    s = e_mu / (e_mu + (1 / s - 1))
  else:
    shift = scheduler.get("shift", 1.0)
    s = shift * s / (1 + (shift - 1) * s)
  if scheduler.get("shift_terminal"):  # stretched so that the last sigma is shift_terminal
    one_minus = 1 - s
    s = 1 - one_minus / (one_minus[-1] / (1 - scheduler["shift_terminal"]))
  return np.append(s.astype(np.float32), np.float32(0))


@dataclasses.dataclass(frozen=True)
class Steps:
  """A sampler's Euler steps (`step_fn`): `ahead(adapter, params, batch, x, sigmas, next
  sigmas)` computes what the steps read that the latents do not change (the blocks' AdaLN
  modulations: `programs.ahead`), for all the steps at once, and returns each step's;
  `step(its values, adapter, params, batch, x, sigma, sigma_next)` is a step, reading them."""
  ahead: Callable
  step: Callable


def step_fn(model, model_config, guidance: float, jit_options=programs.JIT_OPTIONS) -> Steps:
  """The Euler steps of the pipeline (`Steps`), each one program: the model's velocity at sigma
  with the adapter (None: the base model), with `guidance` embedded (`model.guidance`) or
  classifier-free (the batch holds the pipeline's [uncond, cond] rows; x the cond half's
  latents), then x + (sigma_next - sigma) v in float32. Run as the model's runtime runs a
  forward pass (`Runtime.single_microbatch`: through a pipeline as one microbatch, or over
  unrolled layers as programs per block), each program jitted with `jit_options`."""
  family = model.family
  runtime = model.runtime.single_microbatch()
  cfg_mode = family.sampling.guidance_mode == "cfg"
  mc = copy.deepcopy(model_config)
  if not cfg_mode:
    mc.guidance = guidance

  def step(adapter, params, batch, x, sigma, sigma_next):
    latents = jnp.concatenate([x, x]) if cfg_mode else x
    t = jnp.full((latents.shape[0],), sigma, jnp.float32)
    variables = {"params": params} if adapter is None else {"params": params, "lora": adapter}
    v = runtime.apply(model.module, variables,
                      **family.training_inputs(mc, model.config, batch, latents, t)).astype(jnp.float32)
    if cfg_mode:
      uncond, cond = jnp.split(v, 2)
      v = uncond + guidance * (cond - uncond)
    return sequence.whole(x + (sigma_next - sigma) * v)  # as it came: the next step's input
  # A modulation reads its whole kernel for one row a step: computed ahead, it reads it once for
  # all the steps (BENCHMARKS.md#kernels: a modulation of 28 rows takes the time of one).
  loop = programs.ahead_of_calls(step, carried=3, varying=(4, 5), jit_options=jit_options)
  return Steps(loop.values, runtime.compile(loop.call, jit_options))


def denoise(model, params, adapter, model_config, conditioning: dict, noise, grid, steps: int,
            guidance: float, uncond: Optional[dict] = None, step: Optional[Steps] = None,
            place=None, progress=None):
  """Latents from `noise` [B, *latent_shape] (float32): `steps` Euler steps of the family's
  pipeline for a latent `grid` (the encoders' `latent_grid`). `conditioning`: the cached text
  fields of B prompts (and `position_ids`, where the family has them); `uncond`: the empty
  prompt's, one row (classifier-free families); `step`: `step_fn`'s for this model_config and
  guidance (by default made here, so compiled anew: pass one to reuse it); `place`: puts
  the (numpy) batch and noise on the devices; `progress(i)` after each step."""
  sampling = model.family.sampling
  step = step or step_fn(model, model_config, guidance)
  place = place or (lambda tree: jax.tree.map(jnp.asarray, tree))
  schedule = sigmas(scheduler_config(model.family, model.config, model_config), steps,
                    int(np.prod(grid)), sampling.spacing)
  if sampling.guidance_mode == "cfg":
    if uncond is None:
      raise ValueError("classifier-free guidance needs the empty prompt's embeddings (uncond)")
    n = len(noise)  # the pipeline's [uncond, cond] rows
    conditioning = {k: np.concatenate([np.broadcast_to(uncond[k], (n, *v.shape[1:])) if k in uncond
                                       else v, v]) for k, v in conditioning.items()}
  batch, x = place((conditioning, np.asarray(noise, np.float32)))
  adapter = adapter and lora.in_dtype(adapter, model.module.dtype)  # converted once, not a step
  ahead = step.ahead(adapter, params, batch, x, schedule[:-1], schedule[1:])
  schedule = [jnp.asarray(s) for s in schedule]  # on the device once, not a copy a step
  for i in range(steps):
    x = step.step(ahead[i], adapter, params, batch, x, schedule[i], schedule[i + 1])
    if progress is not None:
      progress(i)
  return x


def prompt_lines(entries: Sequence[str]) -> list:
  """`sample_prompts`: prompts, where an entry naming a .txt file stands for its non-empty lines."""
  prompts = []
  for entry in entries:
    if entry.endswith(".txt") and os.path.isfile(entry):
      with open(entry) as f:
        prompts += [line.strip() for line in f if line.strip()]
    else:
      prompts.append(entry)
  return prompts


def checked_size(encoders, frames: int, height: int, width: int):
  """(frames, height, width), or a one-line error naming the sizes the family's VAE takes."""
  multiple, per_latent = encoders.pixel_multiple, encoders.frames_per_latent
  problems = [f"{what} {v} is not a multiple of {multiple}" for what, v in
              (("height", height), ("width", width)) if v < multiple or v % multiple]
  if per_latent is None and frames != 1:
    problems.append(f"this family draws images: frames must be 1, not {frames}")
  elif per_latent is not None and (frames - 1) % per_latent:
    problems.append(f"frames {frames} is not 1 + {per_latent}k")
  if problems:
    raise UserError(f"sample size: {'; '.join(problems)}")
  return frames, height, width


def check_first_frames(encoders, prompts: int, images: Sequence[str], key="sample_images"):
  """A one-line error unless an image-to-video model has a first frame (`key`, an existing image
  file) for each of the `prompts`, or another model none."""
  if not encoders.takes_first_frame:
    if images:
      raise UserError(f"{key}: this model takes no first frame (it is no image-to-video model); "
                      "leave it empty")
    return
  if len(images) != prompts:
    raise UserError(f"{key}: an image-to-video model's samples start from a first frame: give "
                    f"one image per prompt ({prompts}), not {len(images)}")
  missing = [path for path in images if not os.path.isfile(path)]
  if missing:
    raise UserError(f"{key}: {media.listed(missing)} do(es) not exist")


def first_frames(paths: Sequence[str], height: int, width: int) -> np.ndarray:
  """Image files as first frames np [N, height, width, 3] in [-1, 1], resized and centre-cropped
  as a bucket's media are."""
  frames = [buckets.resize_and_crop(media.read_image(path), width, height)[0] for path in paths]
  return np.stack(frames).astype(np.float32) / 127.5 - 1


def noise_for(model, grid, seeds: Sequence[int]) -> np.ndarray:
  """Initial noise [len(seeds), *latent_shape], one fixed draw per seed (whatever the batch)."""
  shape = model.family.sampling.latent_shape(model.config, grid)
  return np.stack([np.asarray(jax.random.normal(jax.random.key(s), shape, jnp.float32)) for s in seeds])


def with_positions(family, conditioning: dict, grid) -> dict:
  """The conditioning rows plus the latent grid's position ids, where the family takes them."""
  if family.position_ids is None:
    return conditioning
  n = len(next(iter(conditioning.values())))
  return dict(conditioning, position_ids=np.stack([family.position_ids(grid)] * n))


@dataclasses.dataclass
class Prompts:
  """Sample prompts encoded once for one size: the text fields of each (`conditioning`, a row a
  prompt) and of the empty prompt (`uncond`, classifier-free families), the media size and its
  latent grid."""
  texts: list
  conditioning: dict
  uncond: Optional[dict]
  frames: int
  height: int
  width: int
  grid: tuple


def encode_prompts(family, encoders, texts, frames, height, width, cache_dir=None,
                   images=()) -> Prompts:
  """`texts` encoded by the family's text encoders (loaded only if the cache lacks them), with
  an image-to-video model's first frames (`images`, an image file per prompt) by its media
  encoders, and with `cache_dir` kept there (keyed by the encoders' identity, the prompts, the
  images' contents and the size), so a resumed run or another process reads them instead."""
  frames, height, width = checked_size(encoders, frames, height, width)
  check_first_frames(encoders, len(texts), images)
  grid = tuple(encoders.latent_grid(frames, height, width))
  cfg_mode = family.sampling.guidance_mode == "cfg"
  contents = [media.content_hash(path) for path in images]
  key = hashlib.sha256(json.dumps([encoders.identity(), texts, frames, cfg_mode] + (
      [contents, height, width] if images else [])).encode()).hexdigest()[:16]
  path = cache_dir and os.path.join(cache_dir, f"{key}.npz")
  if path and os.path.isfile(path):
    with np.load(path) as f:
      fields = dict(f)
  else:
    fields = {f"cond.{k}": v for k, v in encoders.encode_text(texts, frames).items()}
    if cfg_mode:
      fields |= {f"uncond.{k}": v for k, v in encoders.encode_text([""], frames).items()}
    if images:  # the unconditional rows start from the same frame (`denoise`)
      fields |= {f"cond.{k}": v for k, v in encoders.first_frame_fields(
          first_frames(images, height, width), frames).items()}
      encoders.release(encoders.media_components)  # beside the text encoders, until decoding
    if path:
      os.makedirs(cache_dir, exist_ok=True)
      atomic_write(path, lambda f: np.savez(f, **fields))
  part = lambda name: {k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith(name + ".")}
  return Prompts(list(texts), part("cond"), part("uncond") if cfg_mode else None, frames, height,
                 width, grid)


def draw(model, params, adapter, model_config, prompts: Prompts, steps: int, guidance: float,
         seed: int, rows: int = 1, step=None, place=None, progress=None) -> np.ndarray:
  """Latents of every prompt [N, ...], `rows` prompts at a time (a multiple of the data axis:
  the last batch repeats its last prompt), prompt i from the noise of seed + i, whatever the
  batching."""
  n, out = len(prompts.texts), []
  step = step or step_fn(model, model_config, guidance)  # one program for every batch
  conditioning = with_positions(model.family, prompts.conditioning, prompts.grid)
  for start in range(0, n, rows):
    index = [min(i, n - 1) for i in range(start, start + rows)]
    latents = denoise(model, params, adapter, model_config,
                      {k: v[index] for k, v in conditioning.items()},
                      noise_for(model, prompts.grid, [seed + i for i in index]), prompts.grid, steps,
                      guidance, prompts.uncond, step, place, progress)
    out.append(np.asarray(multihost_utils.process_allgather(latents, tiled=True))[:n - start])
  return np.concatenate(out)


def folder_paths(folder: str, count: int, frames: int) -> list:
  """The files of `count` samples of `frames` frames in `folder`: NN.png, or NN.mp4 for videos."""
  ext = media.IMAGE_OUT[0] if frames == 1 else media.VIDEO_OUT[0]
  return [os.path.join(folder, f"{i:02d}{ext}") for i in range(count)]


def write(encoders, latents, prompts: Prompts, paths: Sequence[str], fps) -> list:
  """Decodes each prompt's latents to its path (an image or a video, by extension), beside a
  .txt of the same stem holding the prompt. Returns (path, pixels [F, H, W, 3] in [-1, 1]) per
  prompt."""
  written = []
  for path, text, z in zip(paths, prompts.texts, latents):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pixels = encoders.decode(z[None], prompts.grid)[0]
    media.write_media(path, pixels, fps)
    atomic_write(f"{os.path.splitext(path)[0]}.txt", lambda f: f.write(text.encode() + b"\n"))
    written.append((path, pixels))
  return written


def preview(pixels) -> np.ndarray:
  """A TensorBoard image [H, W', 3] uint8 of a sample: the image, or a video's first, middle and
  last frames side by side."""
  frames = pixels[[0, len(pixels) // 2, -1]] if len(pixels) > 1 else pixels
  return np.round((np.concatenate(list(frames), axis=1) + 1) * 127.5).clip(0, 255).astype(np.uint8)


def defaults(family, config):
  """(steps, guidance) of the config, the family pipeline's where it leaves them at 0 / < 0."""
  return (config.sample_steps or family.sampling.steps,
          family.sampling.guidance if config.sample_guidance < 0 else config.sample_guidance)


def size(config, multiple: int):
  """(frames, height, width) of the config's samples: its sample_* keys, else the first bucket
  resolution (the dataset TOML's, when the config names one), square, rounded down to the VAE's
  pixel `multiple` as the buckets are (768x512's resolution 627 draws 608x608)."""
  side = config.dataset.resolutions[0]
  if config.dataset.toml_path:
    side = read_toml(config.dataset.toml_path).get("resolutions", media.DatasetSettings.resolutions)[0]
  side = max(multiple, side // multiple * multiple)
  return config.sample_frames, config.sample_height or side, config.sample_width or side
