"""The GPU benchmark scripts run end to end on a tiny shape (CPU): the benchmark is not a test,
but a broken benchmark script should not wait for a GPU session to be found."""
import collections
import glob
import gzip
import json
import os
import subprocess
import sys

import pytest

from benchmarks import train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a PyTorch peer whose run without checkpointing runs out of GPU memory, as at --res 2048
OOM_PEER = """import json, sys
import torch
if sys.argv[sys.argv.index("--ckpt") + 1] == "0":
  raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
print(json.dumps(dict(step_s_median=2.0, peak_mem_gib=None)))  # no peak off the GPU
"""


def test_flux_forward_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "flux_forward.py"), "--smoke",
                        "--workdir", str(tmp_path)], env=env, check=True, stdout=subprocess.PIPE,
                       text=True).stdout
  assert "load from diffusers folder (s)" in out
  err = float(out.split("rel. error vs diffusers bf16")[1].split("|")[2])
  assert err < 2e-2, out


# a PyTorch peer that checks it is asked for the same video shape
VIDEO_PEER = """import json, sys
args = " ".join(sys.argv[1:])
assert "--res 64 --width 64 --frames 9 --txt 8 --rank 4" in args, args
assert sys.argv[2] in ("ltx", "hunyuan"), args
print(json.dumps(dict(step_s_median=0.5, peak_mem_gib=None)))
"""


@pytest.mark.parametrize("model,title", [
    ("ltx-video", "LTX-Video, smoke shape, 9 frames of 64x64 (8 video + 8 text tokens)"),
    ("hunyuan-video", "HunyuanVideo, smoke shape, 9 frames of 64x64 (48 video + 8 text tokens)")])
def test_video_step_benchmark_smoke(tmp_path, model, title):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  (tmp_path / "peer.py").write_text(VIDEO_PEER)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--model",
                        model, "--smoke", "--modes", "per-block remat", "--layouts", "1x1,1x2",
                        "--peer", str(tmp_path / "peer.py")],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  assert out.startswith(title), out
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert [(r[1], r[3], r[4]) for r in rows] == [
      ("no remat", "PyTorch peer", "1x1"), ("per-block remat", "diffpipe-jax", "1x1"),
      ("per-block remat", "PyTorch peer", "1x1"), ("per-block remat", "diffpipe-jax", "1x2")], out
  assert all(float(r[5]) > 0 for r in rows), out


def test_flux_step_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--smoke",
                        "--modes", "per-block remat,fp8 base + per-block remat", "--layouts", "1x1,2x2",
                        "--microbatches", "2", "--profile", str(tmp_path)],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "diffpipe-jax" in line]
  assert len(rows) == 4, out  # per-block remat, fp8 base; on 1 and on 2x2 devices
  assert all(float(row.split("|")[7].strip(" x")) > 0 for row in rows), out  # speed-ups
  assert len(glob.glob(str(tmp_path / "**" / "*.trace.json.gz"), recursive=True)) == 4


def test_flux_step_benchmark_smoke_of_split_and_swapped_steps(tmp_path):
  """The unrolled mode (its step split into programs per block), blocks_to_swap per mode, and a
  peer that runs out of memory: an OOM row, the rest of the table, `-` where nothing applies."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  (tmp_path / "peer.py").write_text(OOM_PEER)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--smoke",
                        "--modes", "no remat (unrolled),per-block remat (unrolled)", "--blocks_to_swap", "0,2",
                        "--peer", str(tmp_path / "peer.py")],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert [(r[1], r[2], r[3]) for r in rows] == [
      ("no remat", "0", "PyTorch peer"), ("no remat (unrolled)", "0", "diffpipe-jax"),
      ("per-block remat", "0", "PyTorch peer"), ("per-block remat (unrolled)", "2", "diffpipe-jax")], out
  assert rows[0][5:-1] == ["OOM"] + ["-"] * 9, out
  assert rows[2][5:-1] == ["2.000", "0.50"] + ["-"] * 6 + ["0.0%", "-"], out  # no peak off the GPU
  assert all(float(r[5]) > 0 for r in rows[1::2]), out  # step times
  assert "nan" not in out, out


def test_flux_step_table_of_runs_out_of_memory(tmp_path):
  """A run that dies of XLA's RESOURCE_EXHAUSTED is an OOM row, and the row of a layout whose 1x1
  run it was has no speed-up; a run that fails otherwise still stops the benchmark."""
  (tmp_path / "oom.py").write_text('raise SystemExit("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: '
                                   'Out of memory while trying to allocate 25769803776 bytes.")')
  (tmp_path / "bug.py").write_text('raise ValueError("a bug")')
  assert train_step.sub([sys.executable, str(tmp_path / "oom.py")]) == train_step.OOM
  with pytest.raises(subprocess.CalledProcessError):
    train_step.sub([sys.executable, str(tmp_path / "bug.py")])
  run = dict(step_s=1.0, samples_per_s=2.0, peak_gib=30.0, step_peak_gib=None, resident_gib=20.0,
             bubble=0.125, compile_s=40.0)
  lines = train_step.table({("per-block remat", 0, "1x1"): train_step.OOM, ("per-block remat", 0, "2x1"): run},
                          {}, flop=81e12)
  rows = [[c.strip() for c in line.split("|")][1:-1] for line in lines[2:]]
  assert rows == [["per-block remat", "0", "diffpipe-jax", "1x1", "OOM"] + ["-"] * 9,
                  ["per-block remat", "0", "diffpipe-jax", "2x1", "1.000", "2.00", "-", "30.00", "-",
                   "20.00", "81", "10%", "12.5%", "40"]], lines


def test_host_copy_benchmark_smoke():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_copy.py"), "--smoke"],
                       check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
  assert len(rows) == 5 and all(float(row.split("|")[2]) > 0 for row in rows), out


def test_trace_summary_counts_overlapping_gpu_work_once(tmp_path):
  gpu, host = 7, 1
  events = [dict(ph="M", name="process_name", pid=gpu, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=host, args=dict(name="/host:CPU")),
            dict(ph="X", pid=gpu, tid=1, ts=0, dur=600, name="nvjet_sm90_gemm"),
            dict(ph="X", pid=gpu, tid=2, ts=500, dur=200, name="loop_add_fusion_12"),  # overlaps
            dict(ph="X", pid=gpu, tid=1, ts=900, dur=100, name="loop_add_fusion_3"),
            dict(ph="X", pid=host, tid=1, ts=0, dur=5000, name="ThunkExecutor")]  # not GPU time
  folder = tmp_path / "run" / "plugins" / "profile" / "1"
  folder.mkdir(parents=True)
  with gzip.open(folder / "vm.trace.json.gz", "wt") as f:
    json.dump(dict(traceEvents=events), f)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "trace_summary.py"),
                        str(tmp_path), "--host", "3"], check=True, stdout=subprocess.PIPE, text=True).stdout
  assert "GPU busy 0.8 ms of 1.0 ms traced (80%); 3 device events" in out, out
  assert "| matmul | 0.6 | 75.0% |" in out and "| loop_add_fusion_N | 2 | 0.3 | 37.5% |" in out, out
  assert "| ThunkExecutor | 1 | 5.0 | 500.0% |" in out, out  # the host's events, listed apart


def test_sample_benchmark_smoke():
  """Ours and the diffusers pipeline on LTX-Video's smoke shape (classifier-free guidance: the
  pipeline's negative prompt arguments), one table."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sample_steps.py"), "--smoke",
                        "--model", "ltx-video", "--steps", "3", "--guidance", "3", "--unrolled"],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  assert out.startswith("LTX-Video, smoke shape") and "3 sampling steps, guidance 3, ours unrolled" in out, out
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert [r[1] for r in rows] == ["diffpipe-jax", "diffusers pipeline"], out
  assert all(float(r[2]) > 0 for r in rows), out


def test_kernel_benchmark_smoke():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_ceilings.py"), "--smoke"],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert len(rows) == 8 + 4 + 16 and all(float(r[2]) > 0 for r in rows), out


def deviceless_programs(*args) -> tuple:
  """(the output of benchmarks/deviceless.py --smoke *args, {(what, module): calls}), each
  program with kernels."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "deviceless.py"), "--smoke", *args],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.split("\n\n")[1].splitlines()[2:]]
  assert f"kernels: {sum(int(r[1]) * int(r[2]) for r in rows)}" in out, out
  assert all(int(r[2]) > 0 for r in rows), out
  calls = collections.Counter()
  for name, n, *_ in rows:
    calls[tuple(name.split(maxsplit=1)[1].rsplit(maxsplit=1))] += int(n)
  return out, calls


def test_deviceless_benchmark_smoke():
  """benchmarks/deviceless.py on the smoke Flux (2 double and 2 single blocks), compiled for the
  CPU: a training step's forward and backward programs for each block call, two sampling steps'
  programs for each block call, each with its kernels counted; and its count of a kernel's
  bytes and FLOPs on an HLO module written out."""
  from benchmarks import deviceless
  out, calls = deviceless_programs()
  for block in ("DoubleStreamBlock", "SingleStreamBlock"):
    assert calls["forward", block] == calls["backward", block] == 2, out
  out, calls = deviceless_programs("--sample", "2")
  assert calls["forward only", "DoubleStreamBlock"] == calls["forward only", "SingleStreamBlock"] == 4, out
  # a matmul's FLOPs and bytes from its HLO line, and a fused slice read as the slice
  hlo = """HloModule m

%fused (p0: f32[16,4], p1: f32[2,8]) -> f32[2,4] {
  %p0 = f32[16,4]{1,0} parameter(0)
  %p1 = f32[2,8]{1,0} parameter(1)
  %s = f32[8,4]{1,0} slice(%p0), slice={[0:8], [0:4]}
  ROOT %d = f32[2,4]{1,0} dot(%p1, %s), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[16,4], b: f32[2,8]) -> f32[2,4] {
  %a = f32[16,4]{1,0} parameter(0)
  %b = f32[2,8]{1,0} parameter(1)
  ROOT %f = f32[2,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
}
"""
  (kernel,) = deviceless.kernels(hlo)
  assert (kernel.kind, kernel.flops, kernel.bytes_in, kernel.bytes_out) == (
      "matmul", 2 * 8 * 2 * 4, 4 * (8 * 4 + 2 * 8), 4 * 2 * 4)
