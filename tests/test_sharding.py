"""Multi-device training on 8 fake CPU devices, against the single-device result; the pipeline
plan and its storage layout."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import FAMILIES, MACHINERY_FAMILY
from diffpipe_jax import sharding
from diffpipe_jax.models import flux
from diffpipe_jax.sharding import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_layout_matches_one_device(tiny_models, name):
  """Data parallelism and pipelines of 2, 4 (with data parallelism) and 8 stages for every family;
  unrolled layers over 8 data-parallel devices (the same program split for every family) for the
  machinery's family."""
  layouts = "2x1,1x2,2x4,1x8" + (",8x1u" if name == MACHINERY_FAMILY else "")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "multidevice_check.py"), name,
                        tiny_models(name)["layouts"]["diffusers"], layouts],
                       env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_plan_covers_every_layer_once_and_stores_a_stage_share(stages):
  plan = pipeline.make_plan(flux.block_stacks(flux.FluxConfig()), stages, microbatches=8)
  for seg in plan.segments:
    held = [l for s in range(stages) for v in range(seg.visits) for l in plan.layers_on(seg, s, v)]
    assert sorted(held) == list(range(seg.length))
    layers = np.arange(seg.length * 2.0).reshape(seg.length, 2)
    staged = plan.to_stages(seg.name, layers)
    assert staged.shape[0] == stages and staged.shape[1] == seg.per_stage * seg.visits
    np.testing.assert_array_equal(plan.to_layers(seg.name, staged), layers)
    assert plan.valid(seg.name).sum() == seg.length
  # parameter memory per stage: a double block holds 36 D^2 weights, a single one 15 D^2
  weights = dict(transformer_blocks=36, single_transformer_blocks=15)
  stored = sum(weights[s.name] * s.per_stage * s.visits for s in plan.segments)
  total = 19 * 36 + 38 * 15
  assert stored <= 1.2 * total / stages, (stored / total, plan.describe())
  # circular visits beat a one-visit (GPipe) schedule with the same padding
  padding = 1 - 57 / sum(s.per_stage * s.visits * stages for s in plan.segments)
  assert plan.bubble() < (stages - 1) / (8 + stages - 1) + padding, plan.describe()
  assert f"stage {stages - 1}:" in plan.describe()


def test_two_stage_bubble_is_small_with_eight_microbatches():
  plan = pipeline.make_plan(flux.block_stacks(flux.FluxConfig()), 2, microbatches=8)
  assert plan.bubble() < (2 - 1) / (8 + 2 - 1)  # better than one visit per stage (GPipe)


def test_mesh_errors_name_the_fix():
  with pytest.raises(ValueError, match="does not divide"):
    sharding.make_mesh(3, jax.devices() * 2)
  with pytest.raises(ValueError, match="no sharding rule covers a/b"):
    sharding.tree_shardings(sharding.make_mesh(1), {"a": {"b": 1}}, rules=((r"c", sharding.P()),))
