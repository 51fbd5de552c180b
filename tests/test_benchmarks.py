"""The GPU benchmark scripts run end to end on a tiny shape (CPU): the benchmark is not a test,
but a broken benchmark script should not wait for a GPU session to be found."""
import glob
import gzip
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flux_forward_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "flux_forward.py"), "--smoke",
                        "--workdir", str(tmp_path)], env=env, check=True, stdout=subprocess.PIPE,
                       text=True).stdout
  assert "load from diffusers folder (s)" in out
  err = float(out.split("rel. error vs diffusers bf16")[1].split("|")[2])
  assert err < 2e-2, out


def test_flux_step_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "flux_step.py"), "--smoke",
                        "--layouts", "1x1,2x2", "--microbatches", "2", "--profile", str(tmp_path)],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "diffpipe-jax" in line]
  assert len(rows) == 6, out  # no remat, per-block remat, fp8 base; on 1 and on 2x2 devices
  assert all(float(row.split("|")[7].strip(" x")) > 0 for row in rows), out  # speed-ups
  assert len(glob.glob(str(tmp_path / "**" / "*.trace.json.gz"), recursive=True)) == 6


def test_flux_step_benchmark_smoke_of_split_and_swapped_steps():
  """The unrolled mode (its step split into programs per block) and blocks_to_swap per mode."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "flux_step.py"), "--smoke",
                        "--modes", "no remat (unrolled),per-block remat (unrolled)", "--blocks_to_swap", "0,2"],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "diffpipe-jax" in line]
  assert [(r[1].strip(), r[2].strip()) for r in rows] == [("no remat (unrolled)", "0"),
                                                          ("per-block remat (unrolled)", "2")], out
  assert all(float(r[5]) > 0 for r in rows), out  # step times


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
                        str(tmp_path)], check=True, stdout=subprocess.PIPE, text=True).stdout
  assert "GPU busy 0.8 ms of 1.0 ms traced (80%); 3 device events" in out, out
  assert "| matmul | 0.6 | 75.0% |" in out and "| loop_add_fusion_N | 2 | 0.3 | 37.5% |" in out, out
