"""Checkpoints: exact round trips, keep-last-N, restore into a target, half-written saves are
skipped, and `--resume_from_checkpoint` resolves to the right run or fails clearly."""
import errno
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffpipe_jax import checkpoint, errors
from diffpipe_jax.errors import UserError


def make_state(seed=0):
  rng = np.random.default_rng(seed)
  return dict(lora=dict(a=jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                        b=dict(kernel=jnp.asarray(rng.normal(size=(3,)), jnp.float32))),
              count=jnp.asarray(rng.integers(0, 100, size=(2, 2)), jnp.int32),
              step=jnp.asarray(seed, jnp.int32))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def saved_run(tmp_path, steps, keep=3):
  run_dir = str(tmp_path / "run")
  ckpt = checkpoint.Checkpointer(run_dir, keep=keep)
  for s in steps:
    ckpt.save(s, make_state(s), dict(step=s, epoch=s // 10))
  return run_dir, ckpt


def test_round_trip(tmp_path):
  run_dir, _ = saved_run(tmp_path, [5])
  assert os.path.isdir(os.path.join(run_dir, "global_step5"))
  state, meta = checkpoint.Checkpointer(run_dir).restore()
  assert_trees_equal(state, make_state(5))
  assert meta == dict(step=5, epoch=0)


def test_keeps_the_last_n(tmp_path):
  run_dir, ckpt = saved_run(tmp_path, [10, 20, 30, 40], keep=2)
  assert sorted(n for n in os.listdir(run_dir) if n.startswith("global_step")) == [
      "global_step30", "global_step40"]
  assert ckpt.latest_step() == 40
  state, meta = ckpt.restore(30)
  assert_trees_equal(state, make_state(30))
  assert meta["step"] == 30


def test_restore_into_an_abstract_target(tmp_path):
  run_dir, ckpt = saved_run(tmp_path, [3])
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          make_state(0))
  state, _ = ckpt.restore(abstract_state=abstract)
  assert_trees_equal(state, make_state(3))
  assert all(isinstance(x, jax.Array) and x.sharding == sharding for x in jax.tree.leaves(state))
  unsharded = jax.eval_shape(make_state)  # what the trainer passes: no shardings
  assert_trees_equal(ckpt.restore(abstract_state=unsharded)[0], make_state(3))


@pytest.mark.parametrize("kill", ["no_marker", "tmp_dir"])
def test_half_written_checkpoint_is_ignored(tmp_path, caplog, kill):
  run_dir, _ = saved_run(tmp_path, [10, 20])
  if kill == "no_marker":  # a step dir whose commit never happened
    bad = os.path.join(run_dir, "global_step99")
    shutil.copytree(os.path.join(run_dir, "global_step20"), bad)
    os.remove(os.path.join(bad, "commit_success.txt"))
  else:  # orbax's own staging dir, killed before the rename
    bad = os.path.join(run_dir, "global_step99.orbax-checkpoint-tmp-1234")
    shutil.copytree(os.path.join(run_dir, "global_step20"), bad)
  with caplog.at_level(logging.WARNING):
    ckpt = checkpoint.Checkpointer(run_dir, keep=3)
  assert any(bad in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
  assert ckpt.latest_step() == 20
  state, meta = ckpt.restore()
  assert_trees_equal(state, make_state(20))
  assert meta == dict(step=20, epoch=2)
  ckpt.save(99, make_state(99), dict(step=99, epoch=9))  # the same step saves over the wreck
  assert ckpt.latest_step() == 99
  assert_trees_equal(checkpoint.Checkpointer(run_dir).restore()[0], make_state(99))


def test_new_run_dir(tmp_path):
  a, b = checkpoint.new_run_dir(str(tmp_path)), checkpoint.new_run_dir(str(tmp_path))
  assert a != b and os.path.isdir(a) and os.path.isdir(b)
  for path in (a, b):
    assert os.path.dirname(path) == str(tmp_path)
    assert re.match(r"^\d{8}_\d{2}-\d{2}-\d{2}", os.path.basename(path))


def test_resolve_resume(tmp_path):
  out = str(tmp_path / "runs")
  old, new = os.path.join(out, "20250101_10-00-00"), os.path.join(out, "20250102_09-00-00")
  for run_dir in (old, new):
    checkpoint.Checkpointer(run_dir).save(1, make_state(), dict(step=1))
  os.makedirs(os.path.join(out, "20250103_08-00-00"))  # newer but never checkpointed
  assert checkpoint.resolve_resume(out, "") is None
  assert checkpoint.resolve_resume(out, None) is None
  for latest in ("latest", "true", "True"):
    assert checkpoint.resolve_resume(out, latest) == new
  assert checkpoint.resolve_resume(out, "20250101_10-00-00") == old
  assert checkpoint.resolve_resume(out, old) == old
  with pytest.raises(UserError, match="20250105_00-00-00.*20250101_10-00-00"):
    checkpoint.resolve_resume(out, "20250105_00-00-00")
  with pytest.raises(ValueError, match="20250103_08-00-00 has no complete checkpoint"):
    checkpoint.resolve_resume(out, "20250103_08-00-00")


def test_resolve_resume_without_a_complete_checkpoint(tmp_path):
  out = str(tmp_path / "runs")
  half = os.path.join(out, "20250101_10-00-00", "global_step10")
  os.makedirs(half)  # killed before the commit marker
  with pytest.raises(UserError, match=f"no run under {re.escape(out)} has a complete"):
    checkpoint.resolve_resume(out, "latest")
  with pytest.raises(UserError, match="no run under"):
    checkpoint.resolve_resume(str(tmp_path / "missing"), "latest")


def test_a_full_disk_keeps_the_last_checkpoint_and_frees_the_failed_one(tmp_path, monkeypatch):
  run_dir, ckpt = saved_run(tmp_path, [1])
  real_save = checkpoint.ocp.CheckpointManager.save

  def full_disk(self, step, *args, **kwargs):  # orbax wrote part of the step, then the disk filled
    os.makedirs(os.path.join(run_dir, f"global_step{step}.orbax-checkpoint-tmp-1"))
    raise RuntimeError("save failed") from OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_disk)
  with pytest.raises(RuntimeError) as failed:
    ckpt.save(2, make_state(2), dict(step=2))
  assert errors.full_disk(failed.value)
  assert sorted(os.listdir(run_dir)) == ["global_step1"]  # the tmp dir is gone, step 1 intact
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", real_save)
  assert_trees_equal(checkpoint.Checkpointer(run_dir).restore()[0], make_state(1))


def test_saved_shapes_are_read_without_restoring(tmp_path):
  run_dir, _ = saved_run(tmp_path, [3])
  ckpt = checkpoint.Checkpointer(run_dir)  # a resumed process's: it has saved nothing yet
  assert ckpt.saved_shapes() == checkpoint.shapes(make_state(3)) == {
      "lora/a": ((4, 3), "float32"), "lora/b/kernel": ((3,), "float32"), "count": ((2, 2), "int32"),
      "step": ((), "int32")}
