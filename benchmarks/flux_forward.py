"""Full-size FLUX.1-dev forward, random weights, bf16, one GPU: our loader and model beside diffusers.

  python benchmarks/flux_forward.py --res 1024 --txt 512 --workdir /tmp/flux_dev_random

1. torch: builds a random `FluxTransformer2DModel` of the FLUX.1-dev shape on the GPU in bf16,
   writes it as a diffusers folder (sharded safetensors + index), times its forward on fixed
   inputs and saves inputs and output.
2. JAX, in a fresh process so that its host memory is its own: `diffpipe_jax.models.load` from
   that folder (wall time, peak host RSS and peak anonymous RSS, sampled), then the forward:
   time, and relative error against diffusers' output.

Prints one table. `--smoke` runs a tiny shape on the CPU to test the script itself.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SMOKE = dict(FLUX_DEV, num_layers=2, num_single_layers=2, attention_head_dim=32,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
             axes_dims_rope=(4, 14, 14))


def median_time(fn, sync, warmup=2, reps=10):
  """Median wall time of `sync(fn())`."""
  for _ in range(warmup):
    sync(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def torch_stage(a, cfg):
  import torch
  from diffusers import FluxTransformer2DModel
  from torch.nn.attention import SDPBackend, sdpa_kernel
  dev = "cpu" if a.smoke else "cuda"
  torch.manual_seed(0)
  with torch.device(dev):
    model = FluxTransformer2DModel(**cfg).to(torch.bfloat16).eval()
  t0 = time.perf_counter()
  model.save_pretrained(os.path.join(a.workdir, "transformer"), max_shard_size="10GB")
  save_s = time.perf_counter() - t0
  from diffpipe_jax.models import flux
  inputs = flux.random_inputs(flux.config_from_diffusers(cfg), 1, a.res // 16, a.res // 16, a.txt)
  inputs.update(timestep=np.array([0.5], np.float32), guidance=np.array([1.0], np.float32))
  np.savez(os.path.join(a.workdir, "inputs.npz"), **inputs)
  t_in = {k: torch.from_numpy(v).to(dev, torch.bfloat16) for k, v in inputs.items()}
  ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if dev == "cuda" else torch.no_grad()
  sync = (lambda _: torch.cuda.synchronize()) if dev == "cuda" else (lambda _: None)
  with torch.no_grad(), ctx:
    fwd = lambda: model(**t_in, return_dict=False)[0]
    out = fwd().float().cpu().numpy()
    fwd_s = median_time(fwd, sync, reps=a.reps)
  np.save(os.path.join(a.workdir, "torch_out.npy"), out)
  return dict(save_s=save_s, forward_s=fwd_s, torch=torch.__version__)


class PeakMemory:
  """Samples this process's resident memory (total and anonymous) in a background thread."""

  def __init__(self, period=0.02):
    self.peak = {"VmRSS": 0, "RssAnon": 0}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)

  def _run(self, period):
    while not self._stop.is_set():
      with open("/proc/self/status") as f:
        for line in f:
          key = line.split(":")[0]
          if key in self.peak:
            self.peak[key] = max(self.peak[key], int(line.split()[1]) * 1024)
      time.sleep(period)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def jax_stage(a):
  import jax
  import jax.numpy as jnp
  from diffpipe_jax import models
  with PeakMemory() as mem:
    t0 = time.perf_counter()
    model = models.load("flux", a.workdir, dtype=jnp.bfloat16, progress=False)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
  inputs = dict(np.load(os.path.join(a.workdir, "inputs.npz")))
  inputs = {k: jnp.asarray(v, jnp.bfloat16 if v.ndim > 1 and k.endswith("states") else v.dtype)
            for k, v in inputs.items()}
  t0 = time.perf_counter()
  out = jax.block_until_ready(model(**inputs))
  compile_s = time.perf_counter() - t0
  fwd_s = median_time(lambda: model(**inputs), jax.block_until_ready, reps=a.reps)
  ref = np.load(os.path.join(a.workdir, "torch_out.npy"))
  out = np.asarray(out.astype(jnp.float32))
  rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(y))
  # the same weights with float8 block kernels (per-channel scales): its error against bf16
  fp8 = models.load("flux", a.workdir, dtype=jnp.bfloat16, transformer_dtype="float8", progress=False)
  out_fp8 = np.asarray(fp8(**inputs).astype(jnp.float32))
  fp8_s = median_time(lambda: fp8(**inputs), jax.block_until_ready, reps=a.reps)
  gib = 2.0 ** 30
  return dict(load_s=load_s, peak_rss_gib=mem.peak["VmRSS"] / gib,
              peak_anon_gib=mem.peak["RssAnon"] / gib, compile_s=compile_s, forward_s=fwd_s,
              rel_err=rel(out, ref), fp8_forward_s=fp8_s, fp8_rel_err=rel(out_fp8, out),
              fp8_rel_err_torch=rel(out_fp8, ref),
              jax=jax.__version__, device=str(jax.devices()[0].device_kind),
              params=sum(x.size for x in jax.tree.leaves(model.params)))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--res", type=int, default=1024)
  p.add_argument("--txt", type=int, default=512)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--workdir", default="/tmp/flux_dev_random")
  p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: tests the script")
  p.add_argument("--stage", choices=["all", "jax"], default="all")
  a = p.parse_args()
  if a.smoke:
    a.res, a.txt, a.reps = min(a.res, 64), min(a.txt, 8), 2
  cfg = SMOKE if a.smoke else FLUX_DEV
  if a.stage == "jax":
    print(json.dumps(jax_stage(a)))
    return
  os.makedirs(a.workdir, exist_ok=True)
  t = torch_stage(a, cfg)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if a.smoke:
    env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, __file__, "--stage", "jax", "--workdir", a.workdir,
                         "--res", str(a.res), "--txt", str(a.txt), "--reps", str(a.reps)]
                        + (["--smoke"] if a.smoke else []),
                        env=env, check=True, stdout=subprocess.PIPE, text=True)
  j = json.loads(proc.stdout.strip().splitlines()[-1])
  tokens = (a.res // 16) ** 2 + a.txt
  print(f"Flux forward, {'smoke' if a.smoke else 'FLUX.1-dev shape'}, random weights, bf16, "
        f"{a.res}x{a.res} ({tokens} tokens), batch 1; {j['device']}, jax {j['jax']}, torch {t['torch']}")
  print(f"| {'what':34} | {'diffusers (torch)':>18} | {'diffpipe-jax':>14} |")
  print(f"|{'-' * 36}|{'-' * 20}|{'-' * 16}|")
  rows = [("parameters", "", f"{j['params'] / 1e9:.2f} B"),
          ("write diffusers folder (s)", f"{t['save_s']:.1f}", ""),
          ("load from diffusers folder (s)", "", f"{j['load_s']:.1f}"),
          ("peak host RSS while loading (GiB)", "", f"{j['peak_rss_gib']:.2f}"),
          ("  of which anonymous (GiB)", "", f"{j['peak_anon_gib']:.2f}"),
          ("forward compile (s)", "", f"{j['compile_s']:.1f}"),
          ("forward, median (ms)", f"{t['forward_s'] * 1e3:.1f}", f"{j['forward_s'] * 1e3:.1f}"),
          ("rel. error vs diffusers bf16", "", f"{j['rel_err']:.2e}"),
          ("forward, fp8 base, median (ms)", "", f"{j['fp8_forward_s'] * 1e3:.1f}"),
          ("fp8 base: rel. err. vs ours bf16", "", f"{j['fp8_rel_err']:.2e}"),
          ("fp8 base: rel. err. vs diffusers", "", f"{j['fp8_rel_err_torch']:.2e}")]
  for name, ref, ours in rows:
    print(f"| {name:34} | {ref:>18} | {ours:>14} |")


if __name__ == "__main__":
  main()
