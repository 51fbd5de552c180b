"""Multi-device training on 8 fake CPU devices, against the single-device result."""
import os
import subprocess
import sys

import jax
import pytest

from diffpipe_jax import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_data_parallel_matches_one_device(flux_checkpoints):
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "multidevice_check.py"),
                        flux_checkpoints["dev"]["diffusers"]],
                       env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout


def test_mesh_errors_name_the_fix():
  with pytest.raises(ValueError, match="does not divide"):
    sharding.make_mesh(3, jax.devices() * 2)
  with pytest.raises(ValueError, match="not implemented yet"):
    sharding.make_mesh(2, jax.devices() * 2)
  with pytest.raises(ValueError, match="no sharding rule covers a/b"):
    sharding.tree_shardings(sharding.make_mesh(1), {"a": {"b": 1}}, rules=((r"c", sharding.P()),))
