"""A family's LoRA training step: the project's real step in several memory modes and any
(data, stage[, seq]) meshes, beside the family's PyTorch peer, in one call.

  python benchmarks/train_step.py --peer ../shared/bench/peer_torch_flux.py
  python benchmarks/train_step.py --modes "per-block remat" --meshes 1x1,2x1,1x2 --microbatches 8
  python benchmarks/train_step.py --modes "no remat (unrolled),per-block remat,fp8 base + per-block remat" \
      --blocks_to_swap 0,14,4   # issue 6's table
  python benchmarks/train_step.py --model ltx-video --res 512 --width 768 --frames 121 \
      --peer ../shared/bench/peer_torch_video.py
  python benchmarks/train_step.py --model hunyuan-video --res 512 --frames 33 \
      --peer ../shared/bench/peer_torch_video.py
  python benchmarks/train_step.py --model wan --wan 14b --res 480 --width 832 --frames 81 \
      --peer ../shared/bench/peer_torch_video.py   # --wan 1.3b; --wan 5b --res 704 --width 1280 --frames 121

The released shape with random weights (`SHAPES`: FLUX.1-dev at 1024^2 with 512 text tokens;
LTX-Video 2B at the given frames, height and width with 128 text tokens; HunyuanVideo 13B
likewise with 256; Wan 2.1 1.3B or 14B or 2.2 TI2V 5B with 512), LoRA rank 32 on every
block Linear (float32), AdamW, bf16 compute, `--batch` samples (1) per micro-batch and data-parallel
replica (a step of `--microbatches` M on D x S GPUs trains D * M samples; the pipeline runs the M
micro-batches as its microbatches). Modes: no rematerialisation, per-block rematerialisation,
and float8 (e4m3) frozen block weights with per-block remat. Each mode and mesh (and each peer
run) is its own process, so each peak memory is its own. Useful FLOPs are counted as the peers
count them (forward + input-gradient matmuls of the blocks' Linears, attention x3). A run that
runs out of device memory reads `OOM` in the table; `-` marks a figure that does not apply.
`--smoke` runs a tiny shape on the CPU to test the script itself. (Until 2026-12-03 this was
benchmarks/flux_step.py, Flux only: benchmarks/HISTORY.md's older commands name it.)
"""
import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the shapes import the project, wherever the script is started from
MODES = {"no remat": dict(remat="none", transformer_dtype=""),
         "no remat (unrolled)": dict(remat="none", transformer_dtype="", unrolled=True),
         "per-block remat (save dots)": dict(remat="block_save_dots", transformer_dtype=""),
         "per-block remat (save attention)": dict(remat="block_save_attention", transformer_dtype=""),
         "per-block remat": dict(remat="block", transformer_dtype=""),
         "per-block remat (unrolled)": dict(remat="block", transformer_dtype="", unrolled=True),
         "per-block remat (offload)": dict(remat="block_offload", transformer_dtype=""),
         "fp8 base + per-block remat": dict(remat="block", transformer_dtype="float8"),
         "fp8 base + per-block remat (unrolled)": dict(remat="block", transformer_dtype="float8",
                                                       unrolled=True),
         "fp8 base + per-block remat (offload)": dict(remat="block_offload", transformer_dtype="float8"),
         "fp8 base + per-block remat (offload, unrolled)": dict(remat="block_offload",
                                                                transformer_dtype="float8", unrolled=True)}
CEILING_TFLOPS = 810.0  # measured bf16 matmul rate of the H200 (REFERENCE.md section 5)
OOM = "OOM"  # the result of a run that ran out of device memory
# how a process that ran out of device memory ends: torch's OutOfMemoryError, XLA's
# RESOURCE_EXHAUSTED, CUDA's CUDA_ERROR_OUT_OF_MEMORY
OOM_ERROR = re.compile(r"out[ _]?of[ _]?memory|RESOURCE_EXHAUSTED", re.IGNORECASE)
# the table's columns: a row's key, the header, how a figure is written
COLUMNS = (("mode", "mode", "{}"), ("swapped", "blocks swapped", "{}"),
           ("impl", "implementation", "{}"), ("mesh", "data x stage", "{}"),
           ("step_s", "step (s, median)", "{:.3f}"), ("rate", "samples/s", "{:.2f}"),
           ("speedup", "vs 1 GPU", "{:.2f}x"), ("peak", "peak memory / GPU (GiB)", "{:.2f}"),
           ("step_peak", "step's peak (GiB)", "{:.2f}"),
           ("resident", "weights + state / GPU (GiB)", "{:.2f}"), ("tflops", "TFLOP/s / GPU", "{:.0f}"),
           ("ceiling", f"of {CEILING_TFLOPS:.0f}", "{:.0%}"), ("bubble", "bubble (theory)", "{:.1%}"),
           ("compile_s", "compile (s)", "{:.0f}"))


@dataclasses.dataclass(frozen=True)
class Shape:
  """What a family's benchmark runs: its model config, a batch of `samples`, a sample's useful
  FLOPs (None for the smoke shape), the peer's arguments and the table's title."""
  cfg: object
  batch: Callable  # samples -> a batch of cached samples (numpy)
  flop: Optional[float]
  peer_args: list
  title: str


def flux_shape(a) -> Shape:
  from benchmarks.flux_forward import FLUX_DEV, SMOKE
  from diffpipe_jax.models import flux
  cfg = flux.config_from_diffusers(SMOKE if a.smoke else FLUX_DEV)
  grid = a.res // 16
  tokens, blocks, dim = grid * grid + a.txt, 57, 3072
  mm_fwd = blocks * 2 * (dim * 3 * dim + dim * dim + 2 * dim * 4 * dim) * tokens
  flop = 2 * mm_fwd + 3 * blocks * 4 * tokens * tokens * dim
  return Shape(cfg, lambda n: flux.random_batch(cfg, n, grid, grid, a.txt), None if a.smoke else flop,
               ["--res", str(a.res), "--txt", str(a.txt)],
               f"Flux, {'smoke' if a.smoke else 'FLUX.1-dev'} shape, {a.res}^2 ({tokens} tokens)")


def ltx_video_shape(a) -> Shape:
  from diffpipe_jax.models import ltx_video
  cfg = ltx_video.LTXVideoConfig(  # the 2B model: diffusers' defaults
      **(dict(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, num_layers=2,
              caption_channels=24, in_channels=8, out_channels=8) if a.smoke else {}))
  width = a.width or a.res
  grid = ((a.frames - 1) // ltx_video.VAE_TEMPORAL_RATIO + 1, a.res // ltx_video.VAE_SPATIAL_RATIO,
          width // ltx_video.VAE_SPATIAL_RATIO)
  tokens, d, layers = int(np.prod(grid)), cfg.inner_dim, cfg.num_layers
  # per block: self-attention q, k, v, out and the MLP (4 + 8 D^2 a video token), cross-attention
  # q and out (2 D^2 a video token) and k, v (2 D^2 a text token)
  mm_fwd = layers * 2 * d * d * (14 * tokens + 2 * a.txt)
  flop = 2 * mm_fwd + 3 * layers * 4 * (tokens * tokens + tokens * a.txt) * d
  return Shape(cfg, lambda n: ltx_video.random_batch(cfg, n, *grid, a.txt), None if a.smoke else flop,
               ["--model", "ltx", "--res", str(a.res), "--width", str(width), "--frames", str(a.frames),
                "--txt", str(a.txt)],
               f"LTX-Video, {'smoke' if a.smoke else '2B'} shape, {a.frames} frames of {width}x{a.res} "
               f"({tokens} video + {a.txt} text tokens)")


def hunyuan_video_shape(a) -> Shape:
  from diffpipe_jax.models import hunyuan_video
  cfg = hunyuan_video.HunyuanVideoConfig(  # the released 13B model: diffusers' defaults
      **(dict(num_attention_heads=2, attention_head_dim=32, num_layers=1, num_single_layers=2,
              text_embed_dim=24, pooled_projection_dim=20, in_channels=8, out_channels=8,
              rope_axes_dim=(4, 14, 14)) if a.smoke else {}))
  width = a.width or a.res
  # the VAE's 4x temporal and 8x spatial factors, then the 1x2x2 patch
  grid = ((a.frames - 1) // 4 + 1, a.res // 16, width // 16)
  tokens, d = int(np.prod(grid)), cfg.inner_dim
  blocks = cfg.num_layers + cfg.num_single_layers
  # a double block (each stream its own weights) and a single one both take 12 D^2 a token
  mm_fwd = blocks * 2 * 12 * d * d * (tokens + a.txt)
  flop = 2 * mm_fwd + 3 * blocks * 4 * (tokens + a.txt) ** 2 * d
  return Shape(cfg, lambda n: hunyuan_video.random_batch(cfg, n, *grid, a.txt),
               None if a.smoke else flop,
               ["--model", "hunyuan", "--res", str(a.res), "--width", str(width), "--frames",
                str(a.frames), "--txt", str(a.txt)],
               f"HunyuanVideo, {'smoke' if a.smoke else '13B'} shape, {a.frames} frames of "
               f"{width}x{a.res} ({tokens} video + {a.txt} text tokens)")


# Wan's released transformers (Wan-AI's config.json, diffusers' names): width, heads, MLP width,
# blocks, latent channels and the VAE's spatial factor (`--wan`)
WAN = {"1.3b": (1536, 12, 8960, 30, 16, 8), "14b": (5120, 40, 13824, 40, 16, 8),
       "5b": (3072, 24, 14336, 30, 48, 16)}


def wan_shape(a) -> Shape:
  from diffpipe_jax.models import wan
  dim, heads, ffn, layers, channels, spatial = WAN[a.wan]
  cfg = wan.WanConfig(**(dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=40, num_layers=2,
                              text_dim=24, in_channels=8, out_channels=8) if a.smoke else dict(
      num_attention_heads=heads, attention_head_dim=dim // heads, ffn_dim=ffn, num_layers=layers,
      in_channels=channels, out_channels=channels)))
  width = a.width or a.res
  # the VAE's 4x temporal and 8x (2.2 5B: 16x) spatial factors, then the 1x2x2 patch
  grid = ((a.frames - 1) // 4 + 1, a.res // (2 * spatial), width // (2 * spatial))
  tokens, d = int(np.prod(grid)), cfg.inner_dim
  # per block and video token: self-attention q, k, v, out (4 D^2), cross-attention q, out (2 D^2)
  # and the MLP (2 D ffn); per text token the cross-attention's k, v (2 D^2)
  mm_fwd = cfg.num_layers * 2 * (tokens * (6 * d * d + 2 * d * cfg.ffn_dim) + a.txt * 2 * d * d)
  flop = 2 * mm_fwd + 3 * cfg.num_layers * 4 * (tokens * tokens + tokens * a.txt) * d
  return Shape(cfg, lambda n: wan.random_batch(cfg, n, *grid, a.txt), None if a.smoke else flop,
               ["--model", "wan", "--wan", a.wan, "--res", str(a.res), "--width", str(width),
                "--frames", str(a.frames), "--txt", str(a.txt)],
               f"Wan, {'smoke' if a.smoke else a.wan.upper()} shape, {a.frames} frames of "
               f"{width}x{a.res} ({tokens} video + {a.txt} text tokens)")


SHAPES = {"flux": flux_shape, "ltx-video": ltx_video_shape, "hunyuan-video": hunyuan_video_shape,
          "wan": wan_shape}
# each family's --res and --txt when not given
DEFAULTS = {"flux": (1024, 512), "ltx-video": (512, 128), "hunyuan-video": (512, 256), "wan": (480, 512)}


def as_cached(batch, dtype):
  """A random batch with its latents and text in the compute dtype, as the cache holds them."""
  import jax
  return jax.tree.map(lambda x: x.astype(
      dtype if x.dtype == np.float32 and x.ndim == 3 and x.shape[-1] != 3 else x.dtype), batch)


def run_mode(a, mode, mesh_name, blocks_to_swap):
  import importlib
  import jax
  import jax.numpy as jnp
  from diffpipe_jax import family as family_lib, models, optim, runtime, sharding, training_step

  data, stages, seq = map(int, (mesh_name.split("x") + ["1"])[:3])
  family, shape = family_lib.get(a.model), SHAPES[a.model](a)
  config = importlib.import_module(f"diffpipe_jax.configs.{a.model.replace('-', '_')}").get_config("")
  config.adapter.rank = a.rank
  dtype = jnp.float32 if a.smoke else jnp.bfloat16
  devices = jax.devices()[:data * stages * seq]
  if len(devices) < data * stages * seq:
    raise SystemExit(f"mesh {mesh_name} needs {data * stages * seq} devices, {len(devices)} visible")
  mesh = sharding.make_mesh(stages, devices, seq)
  if seq > 1:
    jax.set_mesh(mesh)  # what this process (one run) traces splits its tokens (`sequence.parallel`)
  placement = sharding.make_placement(mesh, family.stacks(shape.cfg), a.microbatches,
                                      int(blocks_to_swap), MODES[mode].get("unrolled", False),
                                      **({"tick_overhead": a.tick_overhead} if a.tick_overhead else {}))
  if placement.plan:
    print(placement.plan.describe(), file=sys.stderr)
  model = models.init_random(a.model, shape.cfg, jax.random.key(0), dtype=dtype,
                             placement=placement, transformer_dtype=MODES[mode]["transformer_dtype"],
                             runtime=runtime.Runtime.of(placement, MODES[mode]["remat"]))
  tx, _ = optim.make(config, 1000)
  state = placement.create(functools.partial(
      training_step.init_state, layer_params=models.abstract_params(family, model.module, shape.cfg),
      config=config, tx=tx, family=family), jax.random.key(1))
  samples = data * a.microbatches * a.batch  # `batch` a microbatch and data-parallel replica
  batch = jax.tree.map(lambda x: x.reshape(a.microbatches, data * a.batch, *x.shape[1:]),
                       as_cached(shape.batch(samples), dtype))
  batches = sharding.global_batch(placement.mesh, batch)
  step = training_step.make_step(model, config, tx, placement)
  memory = lambda key: max((d.memory_stats() or {}).get(key, 0) for d in devices) / 2**30
  resident = memory("bytes_in_use")  # weights + state, per GPU
  t0 = time.perf_counter()
  step_peak = None  # known for a step of one program only
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
    jax.profiler.start_trace(os.path.join(a.profile, f"{mode}@{mesh_name}".replace(" ", "_")))
    for i in range(2):
      state, m = step(state, model.params, batches, jax.random.key(100 + i))
    jax.block_until_ready(m)
    jax.profiler.stop_trace()
  return dict(step_s=step_s, samples_per_s=samples / step_s, compile_s=compile_s,
              peak_gib=memory("peak_bytes_in_use"), step_peak_gib=step_peak, resident_gib=resident,
              loss=float(m["loss"]),
              bubble=placement.plan.bubble() if placement.plan else 0.0,
              device=devices[0].device_kind, jax=jax.__version__)


def sub(args, env=None):
  """The JSON line that a run's process prints last, or OOM if it died out of device memory: one
  run's OOM leaves the other rows. Its stderr is captured to tell, then passed on."""
  proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                        cwd=ROOT)
  sys.stderr.write(proc.stderr)
  if proc.returncode and OOM_ERROR.search(proc.stderr):
    return OOM
  proc.check_returncode()
  return json.loads(proc.stdout.strip().splitlines()[-1])


def of_ceiling(tflops):
  return None if tflops is None else tflops / CEILING_TFLOPS


def our_row(key, r, ours, flop):
  """Our run `key` (mode, blocks swapped, mesh) as a row; `ours`, every run, gives its mode's
  1x1 rate for the speed-up. `flop` (a sample's useful FLOPs) is None where not counted."""
  mode, swapped, mesh = key
  row = dict(mode=mode, swapped=swapped, impl="diffpipe-jax", mesh=mesh)
  if r == OOM:
    return dict(row, step_s=OOM)
  one = ours.get((mode, swapped, "1x1"), OOM)
  gpus = np.prod([int(n) for n in mesh.split("x")])
  tflops = None if flop is None else flop * r["samples_per_s"] / gpus / 1e12
  return dict(row, step_s=r["step_s"], rate=r["samples_per_s"],
              speedup=None if one == OOM else r["samples_per_s"] / one["samples_per_s"],
              peak=r["peak_gib"], step_peak=r["step_peak_gib"], resident=r["resident_gib"],
              tflops=tflops, ceiling=of_ceiling(tflops), bubble=r["bubble"], compile_s=r["compile_s"])


def peer_row(ckpt, r, flop):
  """The peer's run (`ckpt` 1: gradient checkpointing, our per-block remat) as a row."""
  row = dict(mode=("no remat", "per-block remat")[ckpt], swapped=0, impl="PyTorch peer", mesh="1x1")
  if r == OOM:
    return dict(row, step_s=OOM)
  tflops = None if flop is None else flop / r["step_s_median"] / 1e12
  return dict(row, step_s=r["step_s_median"], rate=1 / r["step_s_median"], peak=r["peak_mem_gib"],
              tflops=tflops, ceiling=of_ceiling(tflops), bubble=0.0)


def cell(value, spec):
  """A figure as `spec` writes it; `-` where it does not apply (None), a word (OOM) as it is."""
  if value is None:
    return "-"
  return value if isinstance(value, str) else spec.format(value)


def table(ours, peer, flop):
  """The markdown table of our runs ({(mode, blocks swapped, mesh): result}) and the peer's
  ({ckpt: result}), a result being a run's JSON or OOM, in MODES' order."""
  rows = [our_row(key, r, ours, flop) for key, r in ours.items()]
  rows += [peer_row(ckpt, r, flop) for ckpt, r in peer.items()]
  rows.sort(key=lambda row: (list(MODES).index(row["mode"]), row["swapped"], row["mesh"]))
  lines = ["| " + " | ".join(label for _, label, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  return lines + ["| " + " | ".join(cell(row.get(key), spec) for key, _, spec in COLUMNS) + " |"
                  for row in rows]


def shape_arguments(frames: int) -> argparse.ArgumentParser:
  """A parser with the shape's flags (`SHAPES`' arguments); `shape_defaults` fills them in."""
  p = argparse.ArgumentParser()
  p.add_argument("--model", choices=sorted(SHAPES), default="flux")
  p.add_argument("--res", type=int, help="height in pixels (default: flux 1024, video models 512)")
  p.add_argument("--width", type=int, default=0, help="width in pixels, video models (default: = res)")
  p.add_argument("--frames", type=int, default=frames, help="video frames, video models")
  p.add_argument("--txt", type=int, help="text tokens (default: flux 512, ltx-video 128, hunyuan-video "
                 "256, wan 512)")
  p.add_argument("--wan", choices=sorted(WAN), default="14b",
                 help="wan: 2.1 T2V 1.3B or 14B, 2.2 TI2V 5B (its 48-channel, 16x VAE)")
  p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: tests the script")
  return p


def shape_defaults(a):
  """The family's --res and --txt where not given; the smoke shape's sizes with --smoke."""
  default_res, default_txt = DEFAULTS[a.model]
  a.res, a.txt = a.res or default_res, a.txt or default_txt
  if a.smoke:
    a.res, a.width, a.frames, a.txt = 64, 0, 9, 8
  return a


def main():
  p = shape_arguments(frames=121)
  p.add_argument("--rank", type=int, default=32)
  p.add_argument("--steps", type=int, default=8, help="timed steps, ours and the peer's, after warm-up")
  p.add_argument("--peer", default="", help="path of the family's peer (peer_torch_flux.py, "
                 "peer_torch_video.py): run it too, --ckpt 0 and 1")
  p.add_argument("--peer_ckpt", default="0,1", help="the peer's --ckpt values to run (0: no gradient "
                 "checkpointing, 1: per block); 1 alone where 0 cannot fit the card")
  p.add_argument("--modes", default=",".join(m for m in MODES if "(" not in m))
  p.add_argument("--meshes", default="1x1", help="(data)x(stage)[x(seq)] meshes, comma-separated: "
                 "1x1,2x1,1x2,1x1x2")
  p.add_argument("--batch", type=int, default=1, help="samples a micro-batch and data replica")
  p.add_argument("--microbatches", type=int, default=1,
                 help="micro-batches a step (gradient accumulation; the pipeline's microbatches)")
  p.add_argument("--tick_overhead", type=float, help="the pipeline plan's per-tick cost (layers)")
  p.add_argument("--profile", default="", help="a folder: also trace two steps of each run there")
  p.add_argument("--blocks_to_swap", default="0",
                 help="N blocks' frozen weights (single blocks first, spread evenly) in pinned host "
                      "memory (one stage only): one N for every mode, or one per mode, comma-separated")
  p.add_argument("--run", help=argparse.SUPPRESS)  # mode@mesh@blocks_to_swap, in a subprocess of its own
  a = shape_defaults(p.parse_args())
  if a.smoke:
    a.steps, a.rank = 2, 4
  if a.run:
    print(json.dumps(run_mode(a, *a.run.split("@"))))
    return
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if a.smoke:
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  common = [sys.executable, os.path.abspath(__file__), "--model", a.model, "--res", str(a.res),
            "--width", str(a.width), "--frames", str(a.frames), "--txt", str(a.txt), "--wan", a.wan,
            "--rank", str(a.rank), "--steps", str(a.steps), "--microbatches", str(a.microbatches),
            "--batch", str(a.batch)]
  common += ["--profile", os.path.abspath(a.profile)] if a.profile else []
  common += ["--tick_overhead", str(a.tick_overhead)] if a.tick_overhead else []
  common += ["--smoke"] if a.smoke else []
  meshes, modes, swaps = a.meshes.split(","), a.modes.split(","), a.blocks_to_swap.split(",")
  swaps = swaps * len(modes) if len(swaps) == 1 else swaps
  if len(swaps) != len(modes):
    p.error(f"--blocks_to_swap: one number, or one per mode ({len(modes)}); got {a.blocks_to_swap!r}")
  ours = {(m, int(n), l): sub(common + ["--run", f"{m}@{l}@{n}"], env)
          for m, n in zip(modes, swaps) for l in meshes}
  shape = SHAPES[a.model](a)
  peer = {ckpt: sub([sys.executable, a.peer, *shape.peer_args, "--rank", str(a.rank), "--ckpt", str(ckpt),
                     "--steps", str(a.steps)])
          for ckpt in (map(int, a.peer_ckpt.split(",")) if a.peer else ())}
  flop = shape.flop
  ran = next((r for r in ours.values() if r != OOM), dict(device="(every run OOM)", jax="-"))
  useful = "" if flop is None else f"; useful {flop / 1e12:.1f} TFLOP/sample"
  print(f"{shape.title}, LoRA r{a.rank} step, bf16, AdamW, {a.microbatches} micro-batch(es) of {a.batch} per "
        f"data replica, {ran['device']}, jax {ran['jax']}{useful}")
  print("\n".join(table(ours, peer, flop)))


if __name__ == "__main__":
  main()
