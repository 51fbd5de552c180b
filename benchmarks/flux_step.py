"""Flux LoRA training step: the project's real step in three memory modes and any (data, stage)
device layouts, beside the PyTorch peer, in one call.

  python benchmarks/flux_step.py --peer ../shared/bench/peer_torch_flux.py
  python benchmarks/flux_step.py --modes "per-block remat" --layouts 1x1,2x1,1x2 --microbatches 8
  python benchmarks/flux_step.py --modes "no remat (unrolled),per-block remat,fp8 base + per-block remat" \
      --blocks_to_swap 0,14,4   # issue 6's table

Full FLUX.1-dev shape with random weights, LoRA rank 32 on every block Linear (float32), AdamW,
bf16 compute, 1024x1024 (4096 image + 512 text tokens), one sample per micro-batch and
data-parallel replica (a step of `--microbatches` M on D x S GPUs trains D * M samples; the
pipeline runs the M micro-batches as its microbatches). Modes: no rematerialisation,
per-block rematerialisation, and float8 (e4m3) frozen block weights with per-block remat. Each
mode and layout (and each peer run) is its own process, so each peak memory is its own. Useful FLOPs are
counted as the peer counts them (forward + input-gradient matmuls, attention x3).
`--smoke` runs a tiny shape on the CPU to test the script itself.
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"no remat": dict(remat="none", transformer_dtype=""),
         "no remat (unrolled)": dict(remat="none", transformer_dtype="", unrolled=True),
         "per-block remat (save dots)": dict(remat="block_save_dots", transformer_dtype=""),
         "per-block remat": dict(remat="block", transformer_dtype=""),
         "per-block remat (unrolled)": dict(remat="block", transformer_dtype="", unrolled=True),
         "per-block remat (offload)": dict(remat="block_offload", transformer_dtype=""),
         "fp8 base + per-block remat": dict(remat="block", transformer_dtype="float8"),
         "fp8 base + per-block remat (unrolled)": dict(remat="block", transformer_dtype="float8",
                                                       unrolled=True),
         "fp8 base + per-block remat (offload)": dict(remat="block_offload", transformer_dtype="float8")}
CEILING_TFLOPS = 810.0  # measured bf16 matmul rate of the H200 (REFERENCE.md section 5)


def useful_flop(blocks, dim, tokens):
  mm_fwd = blocks * 2 * (dim * 3 * dim + dim * dim + 2 * dim * 4 * dim) * tokens
  return 2 * mm_fwd + 3 * blocks * 4 * tokens * tokens * dim


def run_mode(a, mode, layout_name, blocks_to_swap):
  import jax
  import jax.numpy as jnp
  from configs import flux as flux_configs
  from diffpipe_jax import models, optim, sharding, update
  from diffpipe_jax.models import flux
  from benchmarks.flux_forward import FLUX_DEV, SMOKE

  data, stages = map(int, layout_name.split("x"))
  cfg = flux.config_from_diffusers(SMOKE if a.smoke else FLUX_DEV)
  config = flux_configs.get_config("")
  config.adapter.rank = a.rank
  dtype = jnp.float32 if a.smoke else jnp.bfloat16
  devices = jax.devices()[:data * stages]
  if len(devices) < data * stages:
    raise SystemExit(f"layout {layout_name} needs {data * stages} devices, {len(devices)} visible")
  layout = sharding.make_layout(sharding.make_mesh(stages, devices), flux.block_stacks(cfg),
                                a.microbatches, int(blocks_to_swap), MODES[mode].get("unrolled", False),
                                **({"tick_overhead": a.tick_overhead} if a.tick_overhead else {}))
  if layout.plan:
    print(layout.plan.describe(), file=sys.stderr)
  model = models.init_random("flux", cfg, jax.random.key(0), dtype=dtype, layout=layout, **MODES[mode])
  tx, _ = optim.make(config, 1000)
  state = layout.create(functools.partial(
      update.init_state, layer_params=models.abstract_params(flux.FAMILY, model.module, cfg),
      config=config, tx=tx, family=flux.FAMILY), jax.random.key(1))
  grid = a.res // 16
  samples = data * a.microbatches  # one sample per microbatch and data-parallel replica
  batch = jax.tree.map(lambda x: x.reshape(a.microbatches, data, *x.shape[1:]).astype(
      dtype if x.ndim == 3 and x.shape[-1] != 3 else x.dtype),
      flux.random_batch(cfg, samples, grid, grid, a.txt))
  batches = sharding.global_batch(layout.mesh, batch)
  step = update.make_step(model, config, tx, layout)
  memory = lambda key: max((d.memory_stats() or {}).get(key, 0) for d in devices) / 2**30
  resident = memory("bytes_in_use")  # weights + state, per GPU
  t0 = time.perf_counter()
  step_peak = float("nan")  # known for a step of one program only
  if hasattr(step, "lower"):
    step = step.lower(state, model.params, batches, jax.random.key(2)).compile()
    # The step's own peak: what is resident plus its temporaries and fresh outputs. The
    # device's lifetime peak may instead come from creating the random weights.
    usage = step.memory_analysis()
    step_peak = resident + (usage.temp_size_in_bytes + usage.output_size_in_bytes
                            - usage.alias_size_in_bytes) / 2**30
  state, m = step(state, model.params, batches, jax.random.key(2))
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(a.steps + 2):
    t0 = time.perf_counter()
    state, m = step(state, model.params, batches, jax.random.key(3 + i))
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times[2:]))
  if a.profile:  # two more steps under the profiler, summarised by benchmarks/trace_summary.py
    jax.profiler.start_trace(os.path.join(a.profile, f"{mode}@{layout_name}".replace(" ", "_")))
    for i in range(2):
      state, m = step(state, model.params, batches, jax.random.key(100 + i))
    jax.block_until_ready(m)
    jax.profiler.stop_trace()
  return dict(step_s=step_s, samples_per_s=samples / step_s, compile_s=compile_s,
              peak_gib=memory("peak_bytes_in_use"), step_peak_gib=step_peak, resident_gib=resident,
              loss=float(m["loss"]),
              bubble=layout.plan.bubble() if layout.plan else 0.0,
              device=devices[0].device_kind, jax=jax.__version__)


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
  p.add_argument("--modes", default=",".join(m for m in MODES if "(" not in m))
  p.add_argument("--layouts", default="1x1", help="(data)x(stage) meshes, comma-separated: 1x1,2x1,1x2")
  p.add_argument("--microbatches", type=int, default=1,
                 help="micro-batches a step (gradient accumulation; the pipeline's microbatches)")
  p.add_argument("--tick_overhead", type=float, help="the pipeline plan's per-tick cost (layers)")
  p.add_argument("--profile", default="", help="a folder: also trace two steps of each run there")
  p.add_argument("--blocks_to_swap", default="0",
                 help="N blocks' frozen weights (single blocks first, spread evenly) in pinned host "
                      "memory (one stage only): one N for every mode, or one per mode, comma-separated")
  p.add_argument("--run", help=argparse.SUPPRESS)  # mode@layout@blocks_to_swap, in a subprocess of its own
  p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: tests the script")
  a = p.parse_args()
  if a.smoke:
    a.res, a.txt, a.steps, a.rank = 64, 8, 2, 4
  if a.run:
    print(json.dumps(run_mode(a, *a.run.split("@"))))
    return
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if a.smoke:
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  common = [sys.executable, os.path.abspath(__file__), "--res", str(a.res), "--txt", str(a.txt),
            "--rank", str(a.rank), "--steps", str(a.steps), "--microbatches", str(a.microbatches)]
  common += ["--profile", os.path.abspath(a.profile)] if a.profile else []
  common += ["--tick_overhead", str(a.tick_overhead)] if a.tick_overhead else []
  common += ["--smoke"] if a.smoke else []
  layouts, modes, swaps = a.layouts.split(","), a.modes.split(","), a.blocks_to_swap.split(",")
  swaps = swaps * len(modes) if len(swaps) == 1 else swaps
  if len(swaps) != len(modes):
    p.error(f"--blocks_to_swap: one number, or one per mode ({len(modes)}); got {a.blocks_to_swap!r}")
  ours = {(m, int(n), l): sub(common + ["--run", f"{m}@{l}@{n}"], env)
          for m, n in zip(modes, swaps) for l in layouts}
  peer = {}
  for ckpt in (0, 1) if a.peer else ():
    peer[ckpt] = sub([sys.executable, a.peer, "--res", str(a.res), "--txt", str(a.txt),
                      "--rank", str(a.rank), "--ckpt", str(ckpt)])
  tokens = (a.res // 16) ** 2 + a.txt
  flop = useful_flop(57, 3072, tokens) if not a.smoke else float("nan")
  first = next(iter(ours.values()))
  print(f"Flux LoRA r{a.rank} step, {'smoke' if a.smoke else 'FLUX.1-dev shape'}, {a.res}^2 "
        f"({tokens} tokens), bf16, AdamW, {a.microbatches} micro-batch(es) of 1 per data replica, "
        f"{first['device']}, jax {first['jax']}; useful {flop / 1e12:.1f} TFLOP/sample")
  print("| mode | blocks swapped | implementation | data x stage | step (s, median) | samples/s | vs 1 GPU | "
        "peak memory / GPU (GiB) | step's peak (GiB) | weights + state / GPU (GiB) | TFLOP/s / GPU | "
        "of 810 | bubble (theory) | compile (s) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for (mode, swapped, layout), r in ours.items():
    gpus = np.prod([int(n) for n in layout.split("x")])
    one = ours.get((mode, swapped, "1x1"))
    rows.append((mode, swapped, "diffpipe-jax", layout, r["step_s"], r["samples_per_s"],
                 r["samples_per_s"] / one["samples_per_s"] if one else float("nan"), r["peak_gib"],
                 r["step_peak_gib"], r["resident_gib"], flop * r["samples_per_s"] / gpus / 1e12,
                 r["bubble"], r["compile_s"]))
  for c, r in peer.items():
    rows.append((("no remat", "per-block remat")[c], 0, "PyTorch peer", "1x1", r["step_s_median"],
                 1 / r["step_s_median"], float("nan"), r["peak_mem_gib"], float("nan"), float("nan"),
                 flop / r["step_s_median"] / 1e12, 0.0, float("nan")))
  for mode, swapped, impl, layout, step_s, rate, speedup, peak, step_peak, resident, tflops, bubble, compile_s in sorted(
      rows, key=lambda r: (list(MODES).index(r[0]), r[1], r[3])):
    print(f"| {mode} | {swapped} | {impl} | {layout} | {step_s:.3f} | {rate:.2f} | {speedup:.2f}x | {peak:.2f} | "
          f"{step_peak:.2f} | {resident:.2f} | {tflops:.0f} | {tflops / CEILING_TFLOPS:.0%} | "
          f"{bubble:.1%} | {compile_s:.0f} |")


if __name__ == "__main__":
  main()
