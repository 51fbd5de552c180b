"""The whole job as a user runs it, at full size on a GPU: caching (twice: the second reuses the
cache), training with evals, samples, LoRA exports and checkpoints at steps of their own, a
resume, and the sampling command with the exported LoRA, each `main.py` or `diffpipe_jax.sample`
process timed from outside (wall time, peak host memory, the GPU's peak memory as nvidia-smi
sees the whole process) and from the run's own record (each step's TensorBoard wall time). Then
`train_step.py` for the same shape and mode, the bare step, to compare the loop with. One table.

  python benchmarks/full_size.py --family flux --format diffusers --out /root/models/flux
  python benchmarks/full_size.py --dataset --out /root/data
  python benchmarks/full_job.py --family flux --models /root/models/flux --data /root/data \
      --card 80 --out $OUT/flux80           # the recipe for the card (80: the lent card as it is)
  python benchmarks/full_job.py ... --card 24   # both frameworks held to 24 GiB (max_device_memory_gib)

Each phase's log and the figures so far are written to --out as they come (a.json); `--phases`
runs some of them, the others' figures read from there, so that a job can span several calls
of a device lent for ten minutes at a time. `--smoke` runs the family's `:tiny` pipeline on the
CPU, a few steps, to test this script.
"""
import argparse
import glob
import json
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import textwrap
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each family's README recipe per card (the keys a user sets on the command line): its model
# files per format (`formats`, the model keys of the folder given to --models: full_size.py's
# format of that name; the first is the default), its data (full_size.py
# --dataset's folder) and the shape of its buckets (`dataset`), the bare step's shape and mode.
RECIPES = {
    "flux": dict(
        config="flux", data="images", formats=dict(diffusers=lambda m: dict(diffusers_path=m)),
        single_file="model.transformer_path",
        # three aspect-ratio buckets near 1024x1024 pixels: three shapes to compile, as a user's
        # mixed-aspect set gives
        dataset={"dataset.min_ar": 0.75, "dataset.max_ar": 1.333, "dataset.num_ar_buckets": 3},
        step=dict(model="flux", res=1024),
        cards={"80": dict(overrides={}, modes="per-block remat", swap=0),
               "24": dict(overrides={"model.transformer_dtype": "float8", "blocks_to_swap": 4},
                          modes="fp8 base + per-block remat (unrolled)", swap=4)}),
    "ltx-video": dict(  # 768x512x121 (the clips shorter than 121 frames are skipped)
        config="ltx_video", data="videos", formats=dict(diffusers=lambda m: dict(diffusers_path=m)),
        single_file="model.single_file_path",
        dataset={"dataset.resolutions": "(627,)", "dataset.min_ar": 1.5, "dataset.max_ar": 1.5,
                 "dataset.num_ar_buckets": 1, "dataset.frame_buckets": "(1, 121)"},
        step=dict(model="ltx-video", res=512, width=768, frames=121),
        cards={"80": dict(overrides={}, modes="per-block remat", swap=0),
               "24": dict(overrides={}, modes="per-block remat", swap=0)}),
    "hunyuan-video": dict(  # ComfyUI's files, as diffusion-pipe's example names them; 512x512x33
        config="hunyuan_video", data="videos", formats=dict(
            comfyui=lambda m: dict(
                transformer_path=f"{m}/hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors",
                vae_path=f"{m}/hunyuan_video_vae_bf16.safetensors",
                llm_path=f"{m}/llava-llama-3-8b-text-encoder-tokenizer",
                clip_path=f"{m}/clip-vit-large-patch14"),
            official=lambda m: dict(ckpt_path=m)),  # Tencent's ckpts folder
        dataset={"dataset.enable_ar_bucket": False, "dataset.frame_buckets": "(1, 33)"},
        step=dict(model="hunyuan-video", res=512, frames=33),
        cards={"80": dict(overrides={"model.transformer_dtype": "float8"},
                          modes="fp8 base + per-block remat", swap=0),
               # 20 swapped peak at 18.4 GiB, over JAX's 18 GiB of a 24 GiB card
               # (BENCHMARKS.md#hunyuan-step-swap)
               "24": dict(overrides={"model.transformer_dtype": "float8", "blocks_to_swap": 40},
                          modes="fp8 base + per-block remat (unrolled)", swap=40)}),
    "wan": dict(  # Wan 2.1 T2V 14B at its 480p size, 832x480x33
        config="wan", data="videos", formats=dict(
            diffusers=lambda m: dict(diffusers_path=m),
            # ComfyUI's transformer file; our Wan encoders read a diffusers folder, so `m` holds
            # both: the file, and full_size.py's `--wan 1.3b` diffusers folder (the same UMT5 and
            # VAE as the 14B's) in diffusers/
            comfyui=lambda m: dict(transformer_path=f"{m}/wan2.1_t2v_14B_bf16.safetensors",
                                   diffusers_path=f"{m}/diffusers")),
        single_file="model.transformer_path",  # another ComfyUI file (its fp8_e4m3fn one)
        # one bucket of 832x480 (res^2 ~ 832 * 480, ar 832/480; both sides multiples of 16): the
        # 768x512 clips are upscaled 1.08x and the 960x544 ones downscaled to cover it, cropped.
        # 33 frames at 16 fps (2.06 s): the 21 clips of 2.5 s or more; the three of 2 s (32
        # frames at 16 fps) are skipped, as the log says
        dataset={"dataset.resolutions": "(632,)", "dataset.min_ar": 1.733, "dataset.max_ar": 1.733,
                 "dataset.num_ar_buckets": 1, "dataset.frame_buckets": "(1, 33)"},
        step=dict(model="wan", res=480, width=832, frames=33),
        cards={"80": dict(overrides={}, modes="per-block remat", swap=0),
               # all 40 blocks swapped: as fast as 30, whose bare step's peak is too close to
               # JAX's 18 GiB (BENCHMARKS.md#wan-step)
               "24": dict(overrides={"model.transformer_dtype": "float8", "blocks_to_swap": 40},
                          modes="fp8 base + per-block remat (unrolled)", swap=40)}),
}
PROMPTS = ("a photograph of a red cube on a wooden table, morning light",
           "a watercolour of a lighthouse at dusk")


def user_config(path, family, models, data, format=None):
  """A config file as a user writes one: the family's config with their folders (`models` in
  `format`, by default the recipe's first), an eval set and sample prompts (eval_datasets entries
  cannot be added by --config overrides)."""
  recipe = RECIPES[family]
  model_keys = recipe["formats"][format or next(iter(recipe["formats"]))](models)
  with open(path, "w") as f:
    f.write(textwrap.dedent(f'''\
        from diffpipe_jax.configs import {recipe["config"]} as family


        def get_config(arg=""):
          c = family.get_config(arg)
          c.model.update({model_keys!r})
          c.dataset.path = {os.path.join(data, recipe["data"])!r}
          c.eval_datasets.held_out = dict(path={os.path.join(data, "eval")!r}, toml_path="")
          c.sample_prompts = {PROMPTS!r}
          return c
        '''))


def flags(overrides: dict) -> list:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


class GpuMemory:
  """The GPU's peak memory in use (MiB, nvidia-smi: every process's, contexts included) while
  it runs; None without nvidia-smi."""

  def __init__(self):
    try:
      self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                    "-lms", "200"], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
      self.proc, self.peak = None, None
      return
    self.peak = 0
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      if line.strip().isdigit():
        self.peak = max(self.peak, int(line.split()[0]))

  def stop(self):
    if self.proc:
      self.proc.terminate()
    return self.peak


def run(name, args, out, env=None):
  """Runs a command; returns its wall time, exit code, peak host RSS (GiB), the GPU's peak (MiB)
  and its output as (seconds since start, line) pairs, every \\r-refreshed bar line included."""
  gpu, start = GpuMemory(), time.time()
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
  # a time limit's SIGTERM (timeout(1)) reaches the process being measured too, which stops as
  # a user's job would (a checkpoint, one line), so that nothing is left running on the GPU
  signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
  lines, log = [], open(os.path.join(out, f"{name}.log"), "w", buffering=1)  # as it comes
  pending, since = b"", 0.0  # a line's start, and when it came: a bar's \r line ends at the next
  while chunk := proc.stdout.read1(1 << 16):
    now = time.time() - start
    *done, rest = re.split(rb"[\r\n]", pending + chunk)
    for i, raw in enumerate(done):
      if raw.strip():
        lines.append((since if i == 0 and pending else now, raw.decode(errors="replace")))
        log.write(f"{lines[-1][0]:9.2f} {lines[-1][1]}\n")
    since = since if rest and not done and pending else now
    pending = rest
  log.close()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  return dict(seconds=time.time() - start, rc=proc.returncode, host_gib=usage.ru_maxrss / 2**20,
              gpu_mib=gpu.stop(), start=start, lines=lines)


def tensorboard_scalars(run_dir, tag):
  """(step, wall time, value) of every write of `tag` in a run's TensorBoard events."""
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      while header := f.read(12):  # length, its CRC
        (n,) = struct.unpack("<Q", header[:8])
        event = event_pb2.Event.FromString(f.read(n))
        f.read(4)
        out += [(event.step, event.wall_time, v.simple_value) for v in event.summary.value if v.tag == tag]
  return out


def step_times(steps, first, last):
  """{step: seconds since the step before} for the steps first..last (TensorBoard wall times)."""
  at = {s: t for s, t, _ in steps}
  return {s: at[s] - at[s - 1] for s in range(first + 1, last + 1) if s in at and s - 1 in at}


def bar_rate(result, desc):
  """Items a second of the largest tqdm bar named `desc` (a cache's, of several datasets'), from
  its first update past 0 to its last; None for fewer than two updates."""
  bars = []  # [(seconds, count)] per bar, a new bar where the count restarts
  for t, line in result["lines"]:
    m = re.search(rf"{desc}:[^|]*\|[^|]*\|\s*(\d+)/(\d+)", line)
    if m:
      n, total = int(m.group(1)), int(m.group(2))
      if not bars or n < bars[-1][-1][1] or total != bars[-1][-1][2]:
        bars.append([])
      bars[-1].append((t, n, total))
  done = [(t, n) for t, n, _ in max(bars, key=lambda b: b[0][2], default=[]) if n > 0]
  return (done[-1][1] - done[0][1]) / (done[-1][0] - done[0][0]) if len(done) > 1 and done[-1][0] > done[0][0] else None


def bar_span(result, desc):
  """Seconds from a tqdm bar's first line to its last update (loading's bar: the load's time)."""
  shown = [t for t, line in result["lines"] if re.search(rf"{desc}:", line)]
  return shown[-1] - shown[0] if shown else None


def steps_per_epoch(result):
  found = re.search(r"(\d+) steps an epoch", " ".join(line for _, line in result["lines"]))
  return found and int(found.group(1))


def run_dir_of(result):
  return next(line.split("run directory: ")[1].split(";")[0] for _, line in result["lines"]
              if "run directory: " in line)


PHASES = ("cache", "cache_again", "train", "resume", "sample_command", "train_step")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--family", choices=sorted(RECIPES), default="flux")
  p.add_argument("--models", help="the family's folder (full_size.py's format)")
  p.add_argument("--format", default=None, help="the folder's format (full_size.py --format), if "
                 "not the recipe's first (HunyuanVideo: comfyui or official; Wan: diffusers or "
                 "comfyui)")
  p.add_argument("--single_file", default="", help="the family's single file (Flux, Wan: "
                 "model.transformer_path; LTX-Video: model.single_file_path)")
  p.add_argument("--data", help="full_size.py --dataset's folder")
  p.add_argument("--card", choices=("80", "24"), default="80")
  p.add_argument("--epochs", type=int, default=2, help="the first compiles each bucket, the rest is steady")
  p.add_argument("--phases", default=",".join(PHASES), help="those to run now; the others' figures "
                 "are read from --out, so that a job can span several calls")
  p.add_argument("--skip_done", action="store_true", help="skip the phases whose figures --out "
                 "holds: the same command goes on where a call's time limit stopped it")
  p.add_argument("--out", required=True, help="the job's folder: runs, logs, figures (a.json)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config key beside the recipe's (--config.KEY=VALUE)")
  p.add_argument("--smoke", action="store_true", help="the :tiny pipeline on the CPU")
  a = p.parse_args()
  os.makedirs(a.out, exist_ok=True)
  recipe, card = RECIPES[a.family], RECIPES[a.family]["cards"][a.card]
  figures = os.path.join(a.out, "a.json")
  results = json.load(open(figures)) if os.path.exists(figures) else {}

  def record(name, result, **derived):
    results[name] = dict({k: v for k, v in result.items() if k not in ("lines", "start")}, **derived)
    with open(figures, "w") as f:
      json.dump(results, f, indent=1)
    if result["rc"]:
      print(f"{name} failed (rc {result['rc']}): {os.path.join(a.out, name + '.log')}", flush=True)
      print("\n".join(line for _, line in result["lines"][-15:]), flush=True)
      raise SystemExit(1)

  def earlier(phase, key):
    """A figure of a phase run before, in this call or an earlier one (a.json)."""
    if results.get(phase, {}).get("rc") != 0:
      raise SystemExit(f"--phases {a.phases} needs the {phase} phase's figures in {figures}: "
                       f"run that phase first")
    return results[phase][key]

  config = os.path.join(a.out, "job_config.py")
  if a.smoke:
    config_arg, keys = f"configs/{recipe['config']}.py:tiny", {"epochs": a.epochs}
  else:
    user_config(config, a.family, a.models, a.data, a.format)
    config_arg, keys = config, dict(recipe["dataset"], epochs=a.epochs, **card["overrides"])
    if a.single_file:
      keys[recipe["single_file"]] = a.single_file
  keys.update(kv.split("=", 1) for kv in a.set)
  if a.card != "80":
    keys["max_device_memory_gib"] = int(a.card)
  base = [sys.executable, "main.py", "--config", config_arg,
          "--config.output_dir=" + os.path.join(a.out, "runs"),
          "--config.compilation_cache_dir=" + os.path.join(a.out, "xla_cache")]
  env = dict(JAX_PLATFORMS="cpu") if a.smoke else {}
  phases = [p for p in a.phases.split(",") if not (a.skip_done and results.get(p, {}).get("rc") == 0)]

  # caching: from nothing (the encoders at this card's memory), then once more, reusing it
  for name, again in (("cache", ["--regenerate_cache"]), ("cache_again", [])):
    if name in phases:
      r = run(name, base + flags(keys) + ["--cache_only"] + again, a.out, env)
      record(name, r, latents_per_s=bar_rate(r, "caching latents"),
             captions_per_s=bar_rate(r, "caching captions"),
             steps_per_epoch=steps_per_epoch(r))

  # training: an eval, a sample, an export and a checkpoint each after a step of its own, after
  # the first epoch (which compiles each bucket): each one's time is its step's excess over the
  # median step. Then the last step's checkpoint and export; the resume trains the last two.
  if {"train", "resume"} & set(phases):
    per_epoch = earlier("cache", "steps_per_epoch")
    at = {k: per_epoch + 2 * (i + 1) for i, k in enumerate(("eval", "sample", "save", "checkpoint"))}
    total = max(a.epochs * per_epoch, at["checkpoint"] + 4)
    train_keys = dict(keys, epochs=-(-total // per_epoch), max_steps=total - 2, eval_before_first_step=False,
                      sample_before_first_step=False, eval_every_n_epochs=0, eval_every_n_steps=at["eval"],
                      sample_every_n_epochs=0, sample_every_n_steps=at["sample"], save_every_n_epochs=0,
                      save_every_n_steps=at["save"], checkpoint_every_n_steps=at["checkpoint"],
                      checkpoint_every_n_minutes=0)
  if "train" in phases:
    r = run("train", base + flags(train_keys), a.out, env)
    if r["rc"]:
      record("train", r)
    run_dir = run_dir_of(r)
    steps = tensorboard_scalars(run_dir, "train/loss")
    times = step_times(steps, 1, total - 2)
    # each bucket's first step compiles, a few of the first epoch's: the median of the rest is
    # the steady step
    steady = [t for s, t in times.items() if s - 1 not in at.values()]
    median = statistics.median(steady)
    uncompiled = [t for t in steady if t < 3 * median]  # the mean shows a periodic stall
    peaks = [v for _, _, v in tensorboard_scalars(run_dir, "train/peak_memory_gib")]
    record("train", r, run_dir=run_dir, steps=len(steps), first_step_s=steps[0][1] - r["start"],
           load_s=bar_span(r, "loading weights"), steady_step_s=median, steady_mean_s=statistics.mean(uncompiled),
           steady_steps=len(uncompiled),
           jax_peak_gib=max(peaks, default=None), **{f"{k}_s": times[s + 1] - median for k, s in at.items()},
           final_save_s=r["seconds"] - (steps[-1][1] - r["start"]))
  if {"resume", "sample_command"} & set(phases):
    run_dir = earlier("train", "run_dir")

  if "resume" in phases:  # the time to its first step
    r = run("resume", base + flags(dict(train_keys, max_steps=total)) + [
        f"--resume_from_checkpoint={os.path.basename(run_dir)}"], a.out, env)
    resumed = [s for s in tensorboard_scalars(run_dir, "train/loss") if s[1] > r["start"]]
    record("resume", r, first_step_s=resumed[0][1] - r["start"] if resumed else None)

  if "sample_command" in phases:  # with the last export
    lora = max(glob.glob(os.path.join(run_dir, "*", "pytorch_lora_weights.safetensors")), key=os.path.getmtime)
    sample_keys = {k: v for k, v in keys.items() if k.startswith(("model.", "blocks_to_swap", "max_device"))}
    r = run("sample_command", [sys.executable, "-m", "diffpipe_jax.sample", "--config", config_arg,
                               *flags(sample_keys), "--lora", lora, "--prompt", PROMPTS[0],
                               "--out", os.path.join(a.out, "sample_command")], a.out, env)
    record("sample_command", r, load_s=bar_span(r, "loading weights"), sampling_s=bar_span(r, "sampling"))

  if "train_step" in phases and not a.smoke:  # the bare step, same shape and mode
    step = recipe["step"]
    shape = [f"--{k}={v}" for k, v in step.items()]
    r = run("train_step", [sys.executable, "benchmarks/train_step.py", *shape, "--modes", card["modes"],
                           "--blocks_to_swap", str(card["swap"])], a.out)
    record("train_step", r, table=[line for _, line in r["lines"] if line.startswith("|")])
  print("\n".join(table(results)))


def table(results) -> list:
  """The job's figures, a row per process."""
  rows = ["| process | wall (s) | host peak (GiB) | GPU peak (GiB, nvidia-smi) | figures |", "|---|---|---|---|---|"]
  for name, r in results.items():
    figures = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                        if k not in ("seconds", "rc", "host_gib", "gpu_mib", "run_dir", "table") and v is not None)
    gpu = "-" if r["gpu_mib"] is None else f"{r['gpu_mib'] / 1024:.1f}"
    rows.append(f"| {name} | {r['seconds']:.1f} | {r['host_gib']:.1f} | {gpu} | {figures} |")
  return rows + results.get("train_step", {}).get("table", [])


if __name__ == "__main__":
  main()
