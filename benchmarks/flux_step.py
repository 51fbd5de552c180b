"""Flux LoRA training step on one GPU: the project's real step in three memory modes, beside the
PyTorch peer, in one call.

  python benchmarks/flux_step.py --peer ../shared/bench/peer_torch_flux.py

Full FLUX.1-dev shape with random weights, LoRA rank 32 on every block Linear (float32), AdamW,
bf16 compute, 1024x1024 (4096 image + 512 text tokens), batch 1. Modes: no rematerialisation,
per-block rematerialisation, and float8 (e4m3) frozen block weights with per-block remat. Each
mode (and each peer run) is its own process, so each peak memory is its own. Useful FLOPs are
counted as the peer counts them (forward + input-gradient matmuls, attention x3).
`--smoke` runs a tiny shape on the CPU to test the script itself.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"no remat": dict(remat="none", transformer_dtype=""),
         "per-block remat (save dots)": dict(remat="block_save_dots", transformer_dtype=""),
         "per-block remat": dict(remat="block", transformer_dtype=""),
         "fp8 base + per-block remat": dict(remat="block", transformer_dtype="float8")}
CEILING_TFLOPS = 810.0  # measured bf16 matmul rate of the H200 (REFERENCE.md section 5)


def useful_flop(blocks, dim, tokens):
  mm_fwd = blocks * 2 * (dim * 3 * dim + dim * dim + 2 * dim * 4 * dim) * tokens
  return 2 * mm_fwd + 3 * blocks * 4 * tokens * tokens * dim


def run_mode(a, mode):
  import jax
  import jax.numpy as jnp
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import flux as flux_configs
  from diffpipe_jax import lora, models, optim, train
  from diffpipe_jax.models import flux
  from benchmarks.flux_forward import FLUX_DEV, SMOKE

  cfg = flux.config_from_diffusers(SMOKE if a.smoke else FLUX_DEV)
  config = flux_configs.get_config("")
  config.adapter.rank = a.rank
  dtype = jnp.float32 if a.smoke else jnp.bfloat16
  model = models.init_random("flux", cfg, jax.random.key(0), dtype=dtype, **MODES[mode])
  tx, _ = optim.make(config, 1000)
  adapter = lora.init(model.params, flux.LORA_TARGETS, a.rank, jnp.float32, jax.random.key(1))
  state = dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))
  grid = a.res // 16
  inputs = flux.random_inputs(cfg, 1, grid, grid, a.txt)
  batch = dict(latents=inputs["hidden_states"], text=inputs["encoder_hidden_states"],
               pooled=inputs["pooled_projections"], img_ids=inputs["img_ids"][None])
  batches = jax.tree.map(lambda x: jnp.asarray(x[None], dtype if x.ndim == 3 and x.shape[-1] != 3 else x.dtype),
                         batch)
  step = jax.jit(lambda s, p, b, k: train.train_step(
      s, p, b, k, tx=tx, loss=lambda *x: train.loss_fn(*x, model=model, config=config)),
      donate_argnums=(0,))
  resident = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)  # weights + state
  t0 = time.perf_counter()
  state, m = step(state, model.params, batches, jax.random.key(2))
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(a.steps + 2):
    t0 = time.perf_counter()
    state, m = step(state, model.params, batches, jax.random.key(3 + i))
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  stats = jax.devices()[0].memory_stats() or {}
  return dict(step_s=float(np.median(times[2:])), compile_s=compile_s,
              peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30, resident_gib=resident / 2**30,
              loss=float(m["loss"]),
              device=jax.devices()[0].device_kind, jax=jax.__version__)


def sub(args, env=None):
  out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT).stdout
  return json.loads(out.strip().splitlines()[-1])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--res", type=int, default=1024)
  p.add_argument("--txt", type=int, default=512)
  p.add_argument("--rank", type=int, default=32)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--peer", default="", help="path of peer_torch_flux.py: run it too, --ckpt 0 and 1")
  p.add_argument("--modes", default=",".join(m for m in MODES if "save dots" not in m))
  p.add_argument("--mode", help=argparse.SUPPRESS)
  p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: tests the script")
  a = p.parse_args()
  if a.smoke:
    a.res, a.txt, a.steps, a.rank = 64, 8, 2, 4
  if a.mode:
    print(json.dumps(run_mode(a, a.mode)))
    return
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if a.smoke:
    env["JAX_PLATFORMS"] = "cpu"
  common = [sys.executable, os.path.abspath(__file__), "--res", str(a.res), "--txt", str(a.txt),
            "--rank", str(a.rank), "--steps", str(a.steps)] + (["--smoke"] if a.smoke else [])
  ours = {m: sub(common + ["--mode", m], env) for m in a.modes.split(",")}
  peer = {}
  for ckpt in (0, 1) if a.peer else ():
    peer[ckpt] = sub([sys.executable, a.peer, "--res", str(a.res), "--txt", str(a.txt),
                      "--rank", str(a.rank), "--ckpt", str(ckpt)])
  tokens = (a.res // 16) ** 2 + a.txt
  flop = useful_flop(57, 3072, tokens) if not a.smoke else float("nan")
  first = next(iter(ours.values()))
  print(f"Flux LoRA r{a.rank} step, {'smoke' if a.smoke else 'FLUX.1-dev shape'}, {a.res}^2 "
        f"({tokens} tokens), batch 1, bf16, AdamW; {first['device']}, jax {first['jax']}; "
        f"useful {flop / 1e12:.1f} TFLOP/step")
  print("| mode | implementation | step (s, median) | peak memory (GiB) | weights + state (GiB) "
        "| TFLOP/s | of 810 | compile (s) |")
  print("|---|---|---|---|---|---|---|---|")
  rows = [(m, "diffpipe-jax", r["step_s"], r["peak_gib"], r["resident_gib"], r["compile_s"])
          for m, r in ours.items()]
  rows += [(("no remat", "per-block remat")[c], "PyTorch peer", r["step_s_median"], r["peak_mem_gib"],
            float("nan"), float("nan")) for c, r in peer.items()]
  for mode, impl, step_s, peak, resident, compile_s in sorted(rows, key=lambda r: list(MODES).index(r[0])):
    tflops = flop / step_s / 1e12
    print(f"| {mode} | {impl} | {step_s:.3f} | {peak:.1f} | {resident:.1f} | {tflops:.0f} | "
          f"{tflops / CEILING_TFLOPS:.0%} | {compile_s:.0f} |")


if __name__ == "__main__":
  main()
