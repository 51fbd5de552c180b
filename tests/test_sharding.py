"""Multi-device training on 8 fake CPU devices, against the single-device result; the pipeline
plan, diffusion-pipe's stage boundaries (partition_split) and the storage per stage."""
import ast
import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import FAMILIES, MACHINERY_FAMILY
from diffpipe_jax import axes, family as family_lib, sequence, sharding
from diffpipe_jax.errors import UserError
from diffpipe_jax.models import flux, layers
from diffpipe_jax.sharding import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flux's two stages at diffusion-pipe's stage boundary [4] (its tiny model's layers: embedding,
# 2 double blocks, 3 single blocks, final layer): both doubles and a single on stage 0, two
# singles on stage 1, so each stage pads both stacks to 2 layers and one holds no double block.
TWO_STAGES = {"flux": "1x2@4"}
# diffusion-pipe's layer counts of the released models (REFERENCE.md)
DIFFUSION_PIPE_LAYERS = {"flux": 59, "hunyuan-video": 63, "ltx-video": 30}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_placement_matches_one_device(tiny_models, name):
  """Data parallelism, pipelines of 2 and 8 stages, sequence parallelism over 4 devices and over
  2 with 2 data-parallel pipelines of 2 stages (2 x 2 x 2) for every family, token counts that
  do not divide by 4; the machinery's family also unrolled, over 8 data-parallel devices and
  over 8 sequence-parallel ones; Flux also over 2 sequence-parallel devices, and its two stages
  at diffusion-pipe's stage boundaries (`partition_split`)."""
  extra = {MACHINERY_FAMILY: ",8x1u,1x1x8u", "flux": ",1x1x2"}.get(name, "")
  placements = f"2x1,{TWO_STAGES.get(name, '1x2')},1x8,1x1x4,2x2x2{extra}"
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "multidevice_check.py"), name,
                        tiny_models(name)["formats"]["diffusers"], placements],
                       env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout


def test_one_device_of_sequence_parallelism_adds_nothing_to_the_program():
  """sequence_parallel=1 (the default; one GPU) traces attention and a block as without the
  'seq' axis: no sharding annotation, the same program."""
  q = jax.numpy.ones((2, 6, 3, 4))
  plain = str(jax.make_jaxpr(layers.attention)(q, q, q))
  with sequence.parallel(sharding.make_mesh(1, jax.devices()[:1], 1)):
    assert str(jax.make_jaxpr(layers.attention)(q, q, q)) == plain
  assert "sharding_constraint" not in plain
  with pytest.raises(UserError, match="pipeline_stages=1 x sequence_parallel=3 does not divide the 1 devices"):
    sharding.make_mesh(1, jax.devices()[:1], 3)


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


def diffusion_pipe_layers(fam, block_stacks):
  """The model's layers in diffusion-pipe's list: (stack name, block), None for the others."""
  layers = [None] * fam.layers_around_stacks[0]
  for (name, length, _), after in zip(block_stacks, fam.layers_around_stacks[1:]):
    layers += [(name, j) for j in range(length)] + [None] * after
  return layers


@pytest.mark.parametrize("name, split", [("flux", [20]), ("flux", [10, 30, 45]),
                                         ("hunyuan-video", [5, 21, 23, 60]), ("ltx-video", [2, 28])])
def test_partition_split_gives_each_stage_diffusion_pipes_layers(name, split):
  fam = family_lib.get(name)
  block_stacks = fam.stacks(fam.config_from_diffusers({}))  # the released model's
  layers, stages = diffusion_pipe_layers(fam, block_stacks), len(split) + 1
  assert len(layers) == DIFFUSION_PIPE_LAYERS[name]
  plan = pipeline.make_plan(block_stacks, stages, 8, pipeline.blocks_per_stage(
      block_stacks, fam.layers_around_stacks, split, stages))
  bounds = [0, *split, len(layers)]
  for seg in plan.segments:
    blocks = np.arange(seg.length * 2.0).reshape(seg.length, 2)
    staged, valid = plan.to_stages(seg.name, blocks), plan.valid(seg.name)
    for s in range(stages):
      held = [layer[1] for layer in layers[bounds[s]:bounds[s + 1]] if layer and layer[0] == seg.name]
      assert list(plan.layers_on(seg, s, 0)) == held
      np.testing.assert_array_equal(staged[s][valid[s]], blocks[held])  # its own blocks, in order
      assert not staged[s][~valid[s]].any()  # then zero padding
    np.testing.assert_array_equal(plan.to_layers(seg.name, staged), blocks)


def test_flux_partition_splits():
  """diffusion-pipe's Flux layers: embedding, 19 double blocks at 1-19, 38 single blocks at 20-57,
  final layer. Split [20]: stage 0 runs the double blocks, stage 1 the singles, each stack a
  pipeline of one visit: M + S - 1 ticks of its longest range."""
  block_stacks, around = flux.block_stacks(flux.FluxConfig()), flux.FAMILY.layers_around_stacks
  assert pipeline.blocks_per_stage(block_stacks, around, [10, 30, 45], 4) == ((9, 10, 0, 0), (0, 10, 15, 13))
  split = pipeline.blocks_per_stage(block_stacks, around, [20], 2)
  assert split == ((19, 0), (0, 38))
  plan = pipeline.make_plan(block_stacks, 2, 8, split)
  assert "stage 0: transformer_blocks 0-18; single_transformer_blocks - (+38 padding" in plan.describe()
  assert "stage 1: transformer_blocks -; single_transformer_blocks 0-37 (+19 padding" in plan.describe()
  assert plan.bubble() == pytest.approx(1 - 8 * 57 / 2 / ((8 + 1) * (19 + 38)))


@pytest.mark.parametrize("split, stages, message", [
    ([59], 2, r"partition_split=\[59\]: the model has 59 layers .*use increasing indices in 1\.\.58"),
    ([1], 2, r"stage 0 would hold layers 0-0, no block; .*blocks are layers 1-57 of the model's 59"),
    ([20, 58], 3, r"stage 2 would hold layers 58-58, no block"),
    ([20, 40], 2, r"partition_split=\[20, 40\]: 2 pipeline stages need 1 boundaries")])
def test_partition_split_errors_name_the_valid_range(split, stages, message):
  with pytest.raises(UserError, match=message):
    pipeline.blocks_per_stage(flux.block_stacks(flux.FluxConfig()), flux.FAMILY.layers_around_stacks,
                              split, stages)


def test_mesh_errors_name_the_fix():
  with pytest.raises(ValueError, match="does not divide"):
    sharding.make_mesh(3, jax.devices() * 2)
  with pytest.raises(ValueError, match="no sharding rule covers a/b"):
    sharding.tree_shardings(sharding.make_mesh(1), {"a": {"b": 1}}, rules=((r"c", axes.spec()),))


def test_only_axes_names_the_mesh_axes():
  """Placement is decided in one table (`diffpipe_jax/axes.py`): elsewhere in the package no
  string is a mesh axis's name and no PartitionSpec is built but by `axes.spec`."""
  found = []
  for path in sorted(glob.glob(os.path.join(ROOT, "diffpipe_jax", "**", "*.py"), recursive=True)):
    if path == axes.__file__:
      continue
    source = open(path).read()
    rows = sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and node.value in axes.MESH  # an axis's name
                   or getattr(node, "attr", getattr(node, "name", None)) in ("P", "PartitionSpec")})
    found += [f"{os.path.relpath(path, ROOT)}:{n}: {source.splitlines()[n - 1].strip()}" for n in rows]
  assert not found, ("mesh axes named outside diffpipe_jax/axes.py: build specs with "
                     "axes.spec(logical names...) and name a mesh axis as axes.DATA, STAGE or SEQ\n"
                     + "\n".join(found))
