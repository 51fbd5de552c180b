"""Sampling speed: our sampler (`diffpipe_jax.sampling.denoise`) beside the family's diffusers
pipeline's transformer loop (prompt embeddings given, `output_type="latent"`: no text encoders,
no VAE), on the released shape with random weights in bf16, one call, one table.

  python benchmarks/sample_steps.py --model flux --res 1024 --steps 28 --guidance 3.5
  python benchmarks/sample_steps.py --model hunyuan-video --res 512 --frames 33 --steps 50
  python benchmarks/sample_steps.py --model ltx-video --res 512 --width 768 --frames 121 --steps 50
  python benchmarks/sample_steps.py --model wan --wan 14b --res 480 --width 832 --frames 81 --steps 50 --guidance 5

Each side runs in a process of its own (its own peak memory): a warm-up call of `--steps` steps
(ours compiles then, its program for the modulations of that many steps among them), then the
timed call of `--steps` (until 2026-12-04's sixth session the warm-up was 2 steps). LTX-Video
and Wan run classifier-free guidance (two rows a step) in both; Flux and HunyuanVideo their
guidance embedding. Each side steps with its pipeline's scheduler (Wan's: UniPC). Shapes and defaults are benchmarks/train_step.py's (`SHAPES`). `--smoke` runs tiny
shapes on the CPU to test the script.
"""
import argparse
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.train_step import SHAPES, shape_arguments, shape_defaults  # noqa: E402


def inputs(a):
  """(model config, conditioning of one prompt, the empty prompt's, noise [1, ...], latent tokens)
  of the shape, as numpy float32."""
  shape = SHAPES[a.model](a)
  batch = shape.batch(1)
  latents = batch.pop("latents")
  uncond = {k: v for k, v in batch.items() if k != "position_ids"}
  tokens = latents.shape[1] if latents.ndim == 3 else int(np.prod(latents.shape[2:]))
  noise = np.random.default_rng(0).standard_normal(latents.shape).astype(np.float32)
  return shape, batch, uncond, noise, tokens


def sampling_config(a):
  """The family's `model` config as the sampler reads it here (25 fps for the video families)."""
  from diffpipe_jax.configs import common
  model_config = common.base(a.model).model
  model_config.frame_rate, model_config.guidance = 25, 1.0
  return model_config


def ours(a):
  import jax
  import jax.numpy as jnp
  from diffpipe_jax import family as family_lib, models, runtime, sampling, sharding
  family = family_lib.get(a.model)
  shape, conditioning, uncond, noise, tokens = inputs(a)
  placement = sharding.make_placement(sharding.make_mesh(1), family.stacks(shape.cfg), 1, 0, a.unrolled)
  model = models.init_random(a.model, shape.cfg, jax.random.key(0), runtime=runtime.Runtime.of(placement),
                             dtype=jnp.float32 if a.smoke else jnp.bfloat16, placement=placement)
  model_config = sampling_config(a)
  step = sampling.step_fn(model, model_config, a.guidance)  # compiled by the warm-up
  run = lambda steps: jax.block_until_ready(sampling.denoise(
      model, model.params, None, model_config, conditioning, noise, (tokens,), steps, a.guidance,
      uncond=uncond, step=step))
  t0 = time.perf_counter()
  run(a.steps)
  warm = time.perf_counter() - t0
  t0 = time.perf_counter()
  run(a.steps)
  total = time.perf_counter() - t0
  if a.profile:  # two more steps under the profiler, summarised by benchmarks/trace_summary.py
    run(2)  # (compiling the modulations of 2 steps before the trace)
    jax.profiler.start_trace(a.profile)
    run(2)
    jax.profiler.stop_trace()
  peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices()) / 2**30
  return dict(total_s=total, warmup_s=warm, peak_gib=peak or None)


def peer(a):
  """The diffusers pipeline's loop over the same shape, random weights, torch's own attention."""
  import diffusers
  import torch
  from diffpipe_jax import family as family_lib
  family = family_lib.get(a.model)
  shape, conditioning, uncond, noise, tokens = inputs(a)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.float32 if a.smoke else torch.bfloat16
  cls = getattr(diffusers, family.diffusers_class)
  accepted = inspect.signature(cls.__init__).parameters
  with torch.device(device):  # random weights, made on the device
    transformer = cls(**{k: v for k, v in dataclasses.asdict(shape.cfg).items() if k in accepted})
    transformer = transformer.to(dtype).eval()
  released = dict(family.sampling.scheduler(shape.cfg))
  scheduler = getattr(diffusers, released.pop("_class_name", "FlowMatchEulerDiscreteScheduler"))(**released)
  pipeline = getattr(diffusers, {"flux": "FluxPipeline", "ltx-video": "LTXPipeline",
                                 "hunyuan-video": "HunyuanVideoPipeline", "wan": "WanPipeline"}[a.model])
  components = {n: None for n in inspect.signature(pipeline.__init__).parameters if n != "self"}
  pipe = pipeline(**dict(components, transformer=transformer, scheduler=scheduler))
  t = lambda x: torch.from_numpy(np.asarray(x)).to(device, dtype)
  kw = dict(prompt_embeds=t(conditioning["text"]))
  if "pooled" in conditioning:
    kw["pooled_prompt_embeds"] = t(conditioning["pooled"])
  if "text_mask" in conditioning:
    kw["prompt_attention_mask"] = t(conditioning["text_mask"])
  if family.sampling.guidance_mode == "cfg":
    kw["negative_prompt_embeds"] = t(uncond["text"])
    if "text_mask" in uncond:
      kw["negative_prompt_attention_mask"] = t(uncond["text_mask"])
  width = a.width or a.res
  video = dict(num_frames=a.frames) if a.model != "flux" else {}
  run = lambda steps: pipe(**kw, latents=t(noise), height=a.res, width=width, num_inference_steps=steps,
                           guidance_scale=a.guidance, output_type="latent", **video)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  with torch.no_grad():
    t0 = time.perf_counter()
    run(a.steps)
    sync()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(a.steps)
    sync()
    total = time.perf_counter() - t0
  peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
  return dict(total_s=total, warmup_s=warm, peak_gib=peak)


def main():
  p = shape_arguments(frames=33)
  p.add_argument("--steps", type=int, default=28)
  p.add_argument("--guidance", type=float, default=3.5)
  p.add_argument("--unrolled", action="store_true", help="ours with the blocks unrolled (programs per block)")
  p.add_argument("--profile", default="", help="a folder: also trace two of our steps there")
  p.add_argument("--side", choices=("ours", "peer"), help=argparse.SUPPRESS)  # in a subprocess of its own
  a = shape_defaults(p.parse_args())
  if a.side:
    print(json.dumps((ours if a.side == "ours" else peer)(a)))
    return
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if a.smoke:
    env.update(JAX_PLATFORMS="cpu")
  results = {}
  for side in ("ours", "peer"):
    out = subprocess.run([sys.executable, *sys.argv, "--side", side], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    results[side] = json.loads(out.strip().splitlines()[-1])
  shape = SHAPES[a.model](a)
  print(f"{shape.title}: {a.steps} sampling steps, guidance {a.guidance:g}"
        + (", ours unrolled" if a.unrolled else ""))
  print("| implementation | total (s) | per step (s) | vs peer | peak memory (GiB) | warm-up, same steps (s) |")
  print("|---|---|---|---|---|---|")
  for side, name in (("ours", "diffpipe-jax"), ("peer", "diffusers pipeline")):
    r = results[side]
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    print(f"| {name} | {r['total_s']:.3f} | {r['total_s'] / a.steps:.4f} | "
          f"{results['peer']['total_s'] / r['total_s']:.2f}x | {peak} | {r['warmup_s']:.1f} |")


if __name__ == "__main__":
  main()
