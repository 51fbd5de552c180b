"""The sampler: each family's diffusers pipeline's flow-matching sampler, in JAX, with LoRAs;
used by the training loop's samples and by the sampling command (`sample.py`).

Given the same initial noise, prompt embeddings, steps and guidance, the latents equal the
family's diffusers pipeline's (tests/test_sample.py). The schedule and the solver are its
scheduler's (the diffusers folder's own config, else the released model's: `Family.sampling`):
FlowMatchEulerDiscreteScheduler's Euler steps, x <- x + (sigma_next - sigma) v in float32, or
UniPCMultistepScheduler's predictor-corrector over flow sigmas, whose steps are linear
in the latents and the earlier data predictions with coefficients that the sigmas alone fix,
computed on the host before the first step (`unipc_coefficients`). Guidance goes into the
model's guidance embedding or is classifier-free against the negative prompt, as the family's
pipeline does it. What a step computes from its noise level alone (the blocks' AdaLN
modulations) is computed for every step at once, before the first (`programs.ahead_of_calls`).
"""
import copy
import dataclasses
import functools
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


def euler_sigmas(scheduler: dict, steps: int, tokens: int, spacing: str) -> np.ndarray:
  """The N + 1 sigmas (the last 0) of a pipeline's FlowMatchEulerDiscreteScheduler.set_timesteps
  for `tokens` latent tokens (float32)."""
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


# UniPCMultistepScheduler's settings that the sampler follows, with the values it supports (the
# released configs that name it); any other value is refused rather than sampled differently
UNIPC_FIXED = dict(use_flow_sigmas=True, prediction_type="flow_prediction", predict_x0=True,
                   thresholding=False, solver_p=None, use_dynamic_shifting=False,
                   shift_terminal=None, use_karras_sigmas=False, use_exponential_sigmas=False,
                   use_beta_sigmas=False)
UNIPC_DEFAULTS = dict(UNIPC_FIXED, prediction_type="epsilon", use_flow_sigmas=False,
                      num_train_timesteps=1000, flow_shift=1.0, solver_order=2,
                      solver_type="bh2", lower_order_final=True, disable_corrector=[],
                      final_sigmas_type="zero")


def unipc_settings(scheduler: dict) -> dict:
  """A UniPCMultistepScheduler config with its defaults, or a UserError naming what the sampler
  does not follow."""
  settings = UNIPC_DEFAULTS | scheduler
  unlike = {k: settings[k] for k, v in UNIPC_FIXED.items() if settings[k] != v}
  if unlike or settings["solver_type"] not in ("bh1", "bh2"):
    raise UserError(f"the scheduler config's UniPCMultistepScheduler settings "
                    f"{unlike or {'solver_type': settings['solver_type']}} are not supported: "
                    f"the sampler follows the released configs' ({UNIPC_FIXED}, solver_type bh1 or bh2)")
  return settings


def unipc_sigmas(settings: dict, steps: int):
  """(sigmas [N + 1] float32, the model's timesteps [N] float32 in 0..1) of
  UniPCMultistepScheduler.set_timesteps over flow sigmas: N of N + 1 from 1 to 1 / n (n its
  num_train_timesteps), shifted, the first just below 1; the last sigma 0 or the one before; the
  timesteps the pipeline passes the model: sigma * n truncated to an integer (then / n)."""
  n = settings["num_train_timesteps"]
  s = np.linspace(1, 1 / n, steps + 1)[:-1]
  shift = settings["flow_shift"]
  s = shift * s / (1 + (shift - 1) * s)
  if abs(s[0] - 1) < 1e-6:  # (its guard against log(0) in the first updates)
    s[0] -= 1e-6
  timesteps = (np.trunc(s * n) / n).astype(np.float32)
  last = 0.0 if settings["final_sigmas_type"] == "zero" else s[-1]
  return np.append(s, last).astype(np.float32), timesteps


def uni_bh(lam, alpha, sigma, t: int, s0: int, earlier: Sequence[int], bh2: bool, corrector: bool):
  """UniPC's B(h) update from sigma index s0 to t as coefficients: x_t = ratio x + on_s0 m_s0 +
  sum(on_earlier m_earlier) + on_t m_t, where m are the data predictions at those indices
  (`earlier` those before s0 that the order reads; m_t only for the corrector, UniC). The
  maths of diffusers' multistep_uni_p_bh_update / multistep_uni_c_bh_update, in float64."""
  h = lam[t] - lam[s0]
  rks = np.array([(lam[e] - lam[s0]) / h for e in earlier] + [1.0])
  hh = -h  # predict_x0
  h_phi_1 = np.expm1(hh)
  h_phi_k, factorial = h_phi_1 / hh - 1, 1
  b_h = np.expm1(hh) if bh2 else hh
  order = len(earlier) + 1
  powers, b = [], []
  for i in range(1, order + 1):
    powers.append(rks ** (i - 1))
    b.append(h_phi_k * factorial / b_h)
    factorial *= i + 1
    h_phi_k = h_phi_k / hh - 1 / factorial
  powers, b = np.array(powers), np.array(b)
  if corrector:
    rhos = [0.5] if order == 1 else np.linalg.solve(powers, b)
  else:
    rhos = [] if order == 1 else [0.5] if order == 2 else np.linalg.solve(powers[:-1, :-1], b[:-1])
  # x_t = sigma_t / sigma_s0 x - alpha_t h_phi_1 m_s0 - alpha_t B(h) (sum_k rho_k (m_k - m_s0) / r_k
  #       [+ rho_last (m_t - m_s0)]): regrouped by the prediction each term reads
  on_earlier = [-alpha[t] * b_h * rho / rk for rho, rk in zip(rhos, rks[:-1])]
  on_t = -alpha[t] * b_h * rhos[-1] if corrector else 0.0
  on_s0 = -alpha[t] * h_phi_1 - sum(on_earlier) - on_t
  return sigma[t] / sigma[s0], on_s0, on_earlier, on_t


def unipc_coefficients(settings: dict, s: np.ndarray) -> np.ndarray:
  """Each step's coefficients [N, 2 order + 5] (float32) for `unipc_update`: sigma; the
  corrector's on (x, the last corrected latents, m_i, m_i-1, ..., m_i-order); the predictor's
  on (the corrected latents, m_i, ..., m_i-order), as UniPCMultistepScheduler.step orders its
  updates (the warm-up's lower orders, `lower_order_final`, `disable_corrector`)."""
  s64 = s.astype(np.float64)
  alpha = 1 - s64
  # a last sigma 0 (lambda = inf) or equal to the one before (h = 0) gives infinities that the
  # maths takes where diffusers' does, and NaNs in terms that the step does not read
  with np.errstate(divide="ignore", invalid="ignore"):
    rows = unipc_rows(settings, s64, np.log(alpha) - np.log(s64), alpha)
  if not np.isfinite(rows).all():
    raise UserError(f"UniPC of order {settings['solver_order']} cannot take its last step to sigma 0 "
                    "at that order: set the scheduler config's lower_order_final to true (the "
                    "released configs')")
  return rows


def unipc_rows(settings, s64, lam, alpha) -> np.ndarray:
  """`unipc_coefficients` from the float64 sigmas, their lambdas and alphas."""
  order, bh2 = settings["solver_order"], settings["solver_type"] == "bh2"
  steps, rows, last_order = len(s64) - 1, [], 0
  for i in range(steps):
    corrector = np.zeros(order + 3)
    if i > 0 and i - 1 not in settings["disable_corrector"]:
      ratio, on_s0, on_earlier, on_t = uni_bh(lam, alpha, s64, i, i - 1,
                                              range(i - 2, i - 1 - last_order, -1), bh2, True)
      corrector[1:4 + len(on_earlier)] = [ratio, on_t, on_s0, *on_earlier]
    else:
      corrector[0] = 1.0
    this_order = min(order, steps - i) if settings["lower_order_final"] else order
    last_order = this_order = min(this_order, min(i, order) + 1)
    ratio, on_s0, on_earlier, _ = uni_bh(lam, alpha, s64, i + 1, i,
                                         range(i - 1, i - this_order, -1), bh2, False)
    predictor = np.zeros(order + 2)
    predictor[:2 + len(on_earlier)] = [ratio, on_s0, *on_earlier]
    rows.append(np.concatenate([[s64[i]], corrector, predictor]))
  return np.array(rows, np.float32)


def unipc_update(x, v, row, history):
  """One UniPC step from the model's velocity v at x (`unipc_coefficients`' row): the data
  prediction m = x - sigma v; x corrected with it (UniC); then the predictor's next latents
  (UniP). `history`: (the last corrected latents, m_i-1, ..., m_i-order)."""
  last, earlier = history[0], history[1:]
  m = x - row[0] * v  # UniPCMultistepScheduler.convert_model_output for flow_prediction
  weigh = lambda coefficients, terms: sum(c * term for c, term in zip(coefficients, terms))
  order = len(earlier)
  corrected = weigh(row[1:order + 4], (x, last, m, *earlier))
  x_next = weigh(row[order + 4:], (corrected, m, *earlier))
  return x_next, (corrected, m, *earlier[:-1])


def euler_update(x, v, row, history):
  """FlowMatchEulerDiscreteScheduler.step: x + (sigma_next - sigma) v (row: sigma, sigma_next)."""
  return x + (row[1] - row[0]) * v, history


@dataclasses.dataclass(frozen=True)
class Solver:
  """A scheduler's steps: `schedule(steps, tokens)` -> (the model's timestep a step [N], each
  step's coefficients [N, K]), both float32; `update(x, v, coefficients, history) -> (next x,
  history)`, with `history` (the arrays a step hands the next, as many as `carries`) starting
  at zeros like x."""
  schedule: Callable
  update: Callable
  carries: int


def solver(scheduler: dict, spacing: str) -> Solver:
  """The `Solver` of a pipeline's scheduler config (its `_class_name`; FlowMatchEulerDiscrete
  where it names none); `spacing`: the sigmas the pipeline passes `set_timesteps` (`SPACINGS`)."""
  name = scheduler.get("_class_name", "FlowMatchEulerDiscreteScheduler")
  if name == "FlowMatchEulerDiscreteScheduler":
    def schedule(steps, tokens):
      s = euler_sigmas(scheduler, steps, tokens, spacing)
      return s[:-1], np.stack([s[:-1], s[1:]], axis=1)
    return Solver(schedule, euler_update, 0)
  if name == "UniPCMultistepScheduler":
    settings = unipc_settings(scheduler)
    if spacing != "scheduler":
      raise ValueError(f"UniPC takes the scheduler's own sigmas, not spacing {spacing!r}")
    def schedule(steps, tokens):
      s, timesteps = unipc_sigmas(settings, steps)
      return timesteps, unipc_coefficients(settings, s)
    return Solver(schedule, unipc_update, 1 + settings["solver_order"])
  raise UserError(f"the scheduler {name} is not supported: the sampler follows "
                  "FlowMatchEulerDiscreteScheduler and UniPCMultistepScheduler (set the diffusers "
                  "folder's scheduler/scheduler_config.json back to the released one)")


@dataclasses.dataclass(frozen=True)
class Steps:
  """A sampler's steps (`step_fn`): `ahead(adapter, params, batch, state, timesteps,
  coefficients)` computes what the steps read that the latents do not change (the blocks' AdaLN
  modulations: `programs.ahead`), for all the steps at once, and returns each step's;
  `step(its values, adapter, params, batch, state, timestep, coefficients)` is a step, reading
  them, from state (x, the solver's history) to the next; `solver`: the scheduler's."""
  ahead: Callable
  step: Callable
  solver: Solver


def step_fn(model, model_config, guidance: float, jit_options=programs.JIT_OPTIONS) -> Steps:
  """The steps of the pipeline (`Steps`), each one program: the model's velocity at the
  timestep with the adapter (None: the base model), with `guidance` embedded (`model.guidance`)
  or classifier-free (the batch holds the pipeline's [uncond, cond] rows; x the cond half's
  latents), then the scheduler's update (`solver`) in float32. Run as the model's runtime runs a
  forward pass (`Runtime.single_microbatch`: through a pipeline as one microbatch, or over
  unrolled layers as programs per block), each program jitted with `jit_options`."""
  family = model.family
  runtime = model.runtime.single_microbatch()
  cfg_mode = family.sampling.guidance_mode == "cfg"
  solve = solver(scheduler_config(family, model.config, model_config), family.sampling.spacing)
  mc = copy.deepcopy(model_config)
  if not cfg_mode:
    mc.guidance = guidance

  def step(adapter, params, batch, state, timestep, coefficients):
    x, history = state
    latents = jnp.concatenate([x, x]) if cfg_mode else x
    t = jnp.full((latents.shape[0],), timestep, jnp.float32)
    variables = {"params": params} if adapter is None else {"params": params, "lora": adapter}
    v = runtime.apply(model.module, variables,
                      **family.training_inputs(mc, model.config, batch, latents, t)).astype(jnp.float32)
    if cfg_mode:
      uncond, cond = jnp.split(v, 2)
      v = uncond + guidance * (cond - uncond)
    return jax.tree.map(sequence.whole, solve.update(x, v, coefficients, history))  # as they came
  # A modulation reads its whole kernel for one row a step: computed ahead, it reads it once for
  # all the steps (BENCHMARKS.md#kernels: a modulation of 28 rows takes the time of one).
  loop = programs.ahead_of_calls(step, carried=3, varying=(4, 5), jit_options=jit_options)
  return Steps(loop.values, runtime.compile(loop.call, jit_options), solve)


@dataclasses.dataclass(frozen=True)
class Expert:
  """A further expert of a model of several (`Family.sampling_experts`): its params, adapter
  (None: none) and steps (`step_fn` of its model and guidance), serving the steps whose timestep
  is below `below` (the lowest timestep of the expert before it)."""
  below: float
  params: dict
  adapter: Optional[dict]
  step: Steps


def denoise(model, params, adapter, model_config, conditioning: dict, noise, grid, steps: int,
            guidance: float, uncond: Optional[dict] = None, step: Optional[Steps] = None,
            place=None, progress=None, experts: Sequence[Expert] = ()):
  """Latents from `noise` [B, *latent_shape] (float32): `steps` steps of the family's pipeline
  for a latent `grid` (the encoders' `latent_grid`). `conditioning`: the cached text fields of B
  prompts (and `position_ids`, where the family has them); `uncond`: the negative prompt's, one
  row (classifier-free families); `step`: `step_fn`'s for this model_config and guidance (by
  default made here, so compiled anew: pass one to reuse it); `place`: puts the (numpy) batch and
  noise on the devices; `progress(i)` after each step; `experts`: a model of several's further
  ones, from high noise down (params, adapter and step serving the steps above the first's)."""
  if steps < 1:
    raise UserError(f"sampling needs at least 1 step, got {steps}")
  step = step or step_fn(model, model_config, guidance)
  place = place or (lambda tree: jax.tree.map(jnp.asarray, tree))
  timesteps, coefficients = step.solver.schedule(steps, int(np.prod(grid)))
  given = functools.partial(model.family.sampling.given, model.config, conditioning)
  if model.family.sampling.guidance_mode == "cfg":
    if uncond is None:
      raise ValueError("classifier-free guidance needs the negative prompt's embeddings (uncond)")
    n = len(noise)  # the pipeline's [uncond, cond] rows
    conditioning = {k: np.concatenate([np.broadcast_to(uncond[k], (n, *v.shape[1:])) if k in uncond
                                       else v, v]) for k, v in conditioning.items()}
  batch, x = place((conditioning, np.asarray(noise, np.float32)))
  state = (x, tuple(jnp.zeros_like(x) for _ in range(step.solver.carries)))
  serving = [Expert(np.inf, params, adapter, step), *experts]
  expert_of_step = [sum(t < e.below for e in experts) for t in timesteps]
  ahead = [None] * steps
  for k, e in enumerate(serving):
    own = [i for i in range(steps) if expert_of_step[i] == k]
    if own:
      serving[k] = e = dataclasses.replace(  # converted once, not a step
          e, adapter=e.adapter and lora.in_dtype(e.adapter, model.module.dtype))
      for i, values in zip(own, e.step.ahead(e.adapter, e.params, batch, state, timesteps[own],
                                             coefficients[own])):
        ahead[i] = values
  # on the device once, not a copy a step
  timesteps, coefficients = jnp.asarray(timesteps), jnp.asarray(coefficients)
  for i in range(steps):
    e = serving[expert_of_step[i]]
    state = e.step.step(ahead[i], e.adapter, e.params, batch, state, timesteps[i], coefficients[i])
    if progress is not None:
      progress(i)
  return given(state[0])


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
  file) for each of the `prompts`, a model that may take them (`takes_first_frame`) one each or
  none, and another model none."""
  if not encoders.takes_first_frame:
    if images:
      raise UserError(f"{key}: this model takes no first frame (it is no image-to-video model); "
                      "leave it empty")
    return
  if encoders.needs_first_frame and len(images) != prompts:
    raise UserError(f"{key}: an image-to-video model's samples start from a first frame: give "
                    f"one image per prompt ({prompts}), not {len(images)}")
  if images and len(images) != prompts:
    raise UserError(f"{key}: give one first frame per prompt ({prompts}), or none to draw from "
                    f"the text alone; not {len(images)}")
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
  prompt) and of the negative prompt (`uncond`, classifier-free families), the media size and
  its latent grid."""
  texts: list
  conditioning: dict
  uncond: Optional[dict]
  frames: int
  height: int
  width: int
  grid: tuple


def encode_prompts(family, encoders, texts, frames, height, width, cache_dir=None,
                   images=(), negative="") -> Prompts:
  """`texts` (and a classifier-free family's `negative` prompt) encoded by the family's text
  encoders (loaded only if the cache lacks them), with an image-to-video model's first frames
  (`images`, an image file per prompt) by its media encoders, and with `cache_dir` kept there
  (keyed by the encoders' identity, the prompts, the images' contents and the size), so a
  resumed run or another process reads them instead."""
  frames, height, width = checked_size(encoders, frames, height, width)
  check_first_frames(encoders, len(texts), images)
  grid = tuple(encoders.latent_grid(frames, height, width))
  cfg_mode = family.sampling.guidance_mode == "cfg"
  if negative and not cfg_mode:
    raise UserError("sample_negative_prompt: this family's guidance is embedded in the model, "
                    "not classifier-free against a negative prompt; leave it empty")
  contents = [media.content_hash(path) for path in images]
  key = hashlib.sha256(json.dumps([encoders.identity(), texts, frames, cfg_mode] + (
      [contents, height, width] if images else []) + ([negative] if negative else [])
  ).encode()).hexdigest()[:16]
  path = cache_dir and os.path.join(cache_dir, f"{key}.npz")
  if path and os.path.isfile(path):
    with np.load(path) as f:
      fields = dict(f)
  else:
    fields = {f"cond.{k}": v for k, v in encoders.encode_text(texts, frames).items()}
    if cfg_mode:
      fields |= {f"uncond.{k}": v for k, v in encoders.encode_text([negative], frames).items()}
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
         seed: int, rows: int = 1, step=None, place=None, progress=None, experts=()) -> np.ndarray:
  """Latents of every prompt [N, ...], `rows` prompts at a time (a multiple of the data axis:
  the last batch repeats its last prompt), prompt i from the noise of seed + i, whatever the
  batching (`experts`: `denoise`'s)."""
  n, out = len(prompts.texts), []
  step = step or step_fn(model, model_config, guidance)  # one program for every batch
  conditioning = with_positions(model.family, prompts.conditioning, prompts.grid)
  for start in range(0, n, rows):
    index = [min(i, n - 1) for i in range(start, start + rows)]
    latents = denoise(model, params, adapter, model_config,
                      {k: v[index] for k, v in conditioning.items()},
                      noise_for(model, prompts.grid, [seed + i for i in index]), prompts.grid, steps,
                      guidance, prompts.uncond, step, place, progress, experts)
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


def second_guidance(config, guidance: float, given: float = -1.0) -> float:
  """The second expert's guidance: `given`, else the config's sample_guidance_2, where either is
  >= 0; else `guidance` (the pipelines' guidance_scale_2 when None)."""
  return next((g for g in (given, config.sample_guidance_2) if g >= 0), guidance)


def size(config, multiple: int):
  """(frames, height, width) of the config's samples: its sample_* keys, else the first bucket
  resolution (the dataset TOML's, when the config names one), square, rounded down to the VAE's
  pixel `multiple` as the buckets are (768x512's resolution 627 draws 608x608)."""
  side = config.dataset.resolutions[0]
  if config.dataset.toml_path:
    side = read_toml(config.dataset.toml_path).get("resolutions", media.DatasetSettings.resolutions)[0]
  side = max(multiple, side // multiple * multiple)
  return config.sample_frames, config.sample_height or side, config.sample_width or side
