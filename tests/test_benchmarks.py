"""The GPU benchmark scripts run end to end on a tiny shape (CPU): the benchmark is not a test,
but a broken benchmark script should not wait for a GPU session to be found."""
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


def test_flux_step_benchmark_smoke():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "flux_step.py"), "--smoke",
                        "--layouts", "1x1,2x2", "--microbatches", "2"],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "diffpipe-jax" in line]
  assert len(rows) == 6, out  # no remat, per-block remat, fp8 base; on 1 and on 2x2 devices
  assert all(float(row.split("|")[6].strip(" x")) > 0 for row in rows), out  # speed-ups
