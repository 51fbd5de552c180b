"""LoRA training end to end, for every family (`conftest.FAMILIES`): the step learns, exports load
in diffusers, every remat, unrolled and swapped mode gives the same gradients, runs resume
exactly across placements, and `train.run` runs in-process."""
import copy
import dataclasses
import errno
import functools
import glob
import importlib.machinery
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conftest import (FAMILIES, MACHINERY_FAMILY, diffusers_modules, family_config, load_lora_in_diffusers,
                      xla_flags)
from tolerances import LORA_PARITY, assert_close, rel_err
from diffpipe_jax import (checkpoint, data, family as family_lib, lora, loop, models, optim, runtime,
                          sharding, stacks, train, training_step)
from diffpipe_jax.errors import UserError
from diffpipe_jax.convert import table
from diffpipe_jax.stacks import host_layers, is_layer_arrays, swapped_stacks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Samples (which the tiny variants draw every 2 epochs) are off in these runs, but where a test
# looks at them: each run would compile and run the sampler too.
NO_SAMPLES = {"sample_every_n_epochs": 0}


def tiny_config(model_type, **overrides):
  config = family_config(model_type)
  config.update_from_flattened_dict(NO_SAMPLES | overrides)
  return config


def config_file(model_type):
  return os.path.join(ROOT, "configs", model_type.replace("-", "_") + ".py")


def run_main(tmp_path, model_type, *args, output="out", devices=1, shared_compilation_cache=True):
  """main.py on the family's tiny variant (without samples, unless `args` set them), its model
  and images generated under tmp_path; compiled programs in the test session's cache
  (conftest.py), or else where the config says."""
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(devices))
  if not shared_compilation_cache:
    del env["JAX_COMPILATION_CACHE_DIR"]
  return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "--config",
                         config_file(model_type) + ":tiny", f"--config.output_dir={tmp_path}/{output}",
                         *no_samples(), *args],
                        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)


def no_samples():
  return [f"--config.{k}={v}" for k, v in NO_SAMPLES.items()]


def trained_adapter(model, config, steps, samples=2):
  """Runs the real jitted train step `steps` times on a synthetic dataset; returns (adapter, losses)."""
  fam = model.family
  batch = fam.random_batch(model.config, samples, seed=0)
  tx, _ = optim.make(config, steps)
  adapter = lora.init(model.params, fam.lora_targets, config.adapter.rank, jnp.float32, jax.random.key(0))
  state = dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))
  step = jax.jit(lambda s, b, k: training_step.train_step(
      s, model.params, b, k, grads=training_step.grad_fn(model, config),
      update=functools.partial(training_step.apply_gradients, tx=tx)))
  losses = []
  for i in range(steps):
    batches = jax.tree.map(lambda x: x.reshape(1, samples, *x.shape[1:]), batch)
    state, metrics = step(state, batches, jax.random.key(1))  # fixed noise: a pure overfit
    losses.append(float(metrics["loss"]))
  return state["lora"], losses


@pytest.fixture
def loaded(tiny_model):
  """(its tiny torch model, ours loaded from its diffusers folder, that path)."""
  path = tiny_model["formats"]["diffusers"]
  return tiny_model["torch"], models.load(tiny_model["family"].type, path, progress=False), path


def test_loss_goes_down_when_overfitting(loaded):
  _, model, _ = loaded
  _, losses = trained_adapter(model, tiny_config(model.family.type, **{"optimizer.lr": 3e-3}), 30)
  assert losses[-1] < 0.5 * losses[0], losses


def test_trained_lora_exports_to_diffusers(loaded, tmp_path):
  torch_model, model, _ = loaded
  fam = model.family
  adapter, _ = trained_adapter(model, tiny_config(fam.type, **{"optimizer.lr": 1e-2}), 5)
  path = lora.save(adapter, str(tmp_path / "epoch1"), fam, 4, np.float32)
  inputs = fam.random_inputs(model.config, batch=2, seed=7)
  ours = np.asarray(model.module.apply({"params": model.params, "lora": adapter}, **inputs))
  t = copy.deepcopy(torch_model)
  exported = {k[len(fam.lora_prefix):].rsplit(".lora_", 1)[0] for k in load_file(path)}
  assert load_lora_in_diffusers(fam, t, path, "trained") == diffusers_modules(fam, exported)
  with torch.no_grad():
    after = t(**{k: None if v is None else torch.from_numpy(v) for k, v in inputs.items()},
              return_dict=False)[0].numpy()
  base = np.asarray(model(**inputs))
  assert rel_err(after, base) > 1e-3  # training changed the model
  assert_close(ours, after, bound=LORA_PARITY)


def test_lora_dropout_acts_in_training_only(loaded):
  _, model, _ = loaded
  fam = model.family
  adapter = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  adapter = jax.tree.map(lambda x: x + 0.1, adapter)  # non-zero B
  batch = fam.random_batch(model.config, 2, seed=4)
  loss = lambda rate, seed: float(training_step.loss_fn(adapter, model.params, batch, jax.random.key(seed), model=model,
                                                config=tiny_config(fam.type, **{"adapter.dropout": rate})))
  assert loss(0.5, 0) != loss(0.0, 0)  # same noise and t, dropped LoRA inputs
  assert loss(0.0, 0) == loss(0.0, 0)


def test_prodigy_logs_the_learning_rate_it_uses(tmp_path, monkeypatch):
  """train/lr is the schedule (1.0) times the estimate Prodigy's update used: its first, 1e-6."""
  monkeypatch.chdir(tmp_path)
  run = train.run(tiny_config(MACHINERY_FAMILY, **{
      "optimizer.type": "prodigy", "optimizer.lr": 1.0, "max_steps": 2, "eval_before_first_step": False,
      "eval_every_n_epochs": 0, "checkpoint_every_n_steps": 0, "output_dir": str(tmp_path / "run")}))
  lrs = [m["train/lr"] for m in read_metrics(run)]
  assert len(lrs) == 2 and lrs[0] == pytest.approx(1e-6), lrs


def read_metrics(run_dir, tag="train/loss"):
  """The lines of metrics.jsonl that hold `tag` (by default, the training steps')."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [m for m in map(json.loads, f) if tag in m]


def epoch_losses(run_dir):
  return [m["train/epoch_loss"] for m in read_metrics(run_dir, "train/epoch_loss")]


def swap_message(fam, path, blocks):
  """What a run prints when `blocks` blocks' weights are swapped to host memory."""
  swap = sharding.swapped_layers(fam.stacks(models.checkpoint_config(fam.type, path)), blocks)
  return "pinned host memory: " + ", ".join(f"{n} of the {name}, spread evenly" for name, n in swap)


def resume_refusals_are_one_line(tmp_path, name, run_a, run_b, args):
  """A resume into a run directory in use, or with settings that change the training state, and
  a start from a LoRA of another rank: each refused in one line, nothing written."""
  with checkpoint.lock_run_dir(run_b):  # while a process trains in it, a second one is refused
    refused = run_main(tmp_path, name, "--resume_from_checkpoint", *args, output="b")
  assert refused.returncode != 0, refused.stdout
  assert refused.stdout.strip().splitlines()[-1] == (
      f"error: the run directory {run_b} is in use by pid {os.getpid()} on host "
      f"{socket.gethostname()}; wait for it to finish or stop it"), refused.stdout
  config = lambda output, **overrides: tiny_config(name, **{"epochs": 4, "checkpoint_every_n_steps": 2,
                                                            "output_dir": str(tmp_path / output), **overrides})
  # a resume whose settings change the training state names them, before restoring anything
  with pytest.raises(UserError, match=f"^cannot resume {re.escape(run_b)}.*adapter.rank: 4 -> 8"):
    train.run(config("b", **{"adapter.rank": 8}), resume="latest")
  assert not os.path.exists(os.path.join(run_b, "config_resumed.json"))
  # starting from a LoRA of another rank: one line, and no run directory
  with pytest.raises(UserError, match="has rank 4, this adapter rank 8: set adapter.rank=4 to continue it$"):
    train.run(config("d", **{"adapter.rank": 8, "adapter.init_from_existing": f"{run_a}/epoch4"}))
  assert not glob.glob(str(tmp_path / "d" / "*"))
  # a complete run, before any work: max_steps only stops a run early (the case)
  with pytest.raises(UserError) as complete:
    train.run(config("a", max_steps=14), resume="latest")
  assert str(complete.value) == (
      f"--resume_from_checkpoint: {run_a} is complete: its checkpoint is at step 12, where "
      "epochs=4 (3 steps each) end (max_steps=14 only stops a run early); to train on, raise epochs "
      "(e.g. --config.epochs=5)")
  assert not os.path.exists(os.path.join(run_a, "config_resumed.json"))


def test_a_complete_run_is_not_resumed_the_line_names_the_limits_reached_and_what_extends_it(tmp_path):
  config, meta = tiny_config(MACHINERY_FAMILY), dict(step=12, steps_per_epoch=3)  # 4 epochs
  run = str(tmp_path)
  train.check_unfinished(run, meta, config)  # its last LoRA not exported yet (a full disk): resumed
  os.mkdir(tmp_path / "epoch4")

  def refusal(**overrides):
    config.update_from_flattened_dict(overrides)
    with pytest.raises(UserError) as e:
      train.check_unfinished(run, meta, config)
    return str(e.value).removeprefix(f"--resume_from_checkpoint: {run} is complete: its checkpoint is at step 12, ")

  assert refusal(max_steps=8) == ("where epochs=4 (3 steps each) end and max_steps=8 stops it; to train on, "
                                  "raise epochs (e.g. --config.epochs=5) and max_steps (0: no limit)")
  assert refusal(epochs=5) == "where max_steps=8 stops it; to train on, raise max_steps (0: no limit)"
  assert refusal(epochs=4, max_steps=20, lr_scheduler="cosine") == (
      "where epochs=4 (3 steps each) end (max_steps=20 only stops a run early); to train on, raise epochs "
      "(e.g. --config.epochs=7) (lr_scheduler='cosine' is then stretched over the new total: the "
      "learning rate rises again at step 12)")
  config.update_from_flattened_dict(dict(epochs=5, max_steps=0))
  train.check_unfinished(run, meta, config)  # steps left: resumed


def samples_written_at(run_dir, steps, config):
  """Each prompt's PNG (an image family) or MP4 and its prompt, at these steps only, and their
  TensorBoard images."""
  want = "png" if config.sample_frames == 1 else "mp4"
  assert sorted(os.listdir(os.path.join(run_dir, "samples"))) == sorted(f"step{s}" for s in steps)
  for step in steps:
    files = sorted(os.listdir(os.path.join(run_dir, "samples", f"step{step}")))
    assert files == sorted(f"{i:02d}.{ext}" for i in range(len(config.sample_prompts))
                           for ext in (want, "txt")), files
  images = [(v.tag, e.step) for e in board_events(run_dir) for v in e.summary.value if v.HasField("image")]
  assert sorted(images) == sorted((f"samples/{i:02d}", s) for i in range(len(config.sample_prompts))
                                  for s in steps), images


def board_events(run_dir):
  """The TensorBoard events of a run (its event files: TFRecords of Event protos)."""
  from tensorboardX.proto.event_pb2 import Event
  for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      yield Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4


@pytest.mark.parametrize("name", FAMILIES)
def test_resume_gives_the_same_run(tmp_path, monkeypatch, capsys, name):
  args = ["--config.epochs=4", "--config.checkpoint_every_n_steps=2"]  # 3 steps an epoch
  # the full run in-process (the trainer is importable): its files under tmp_path
  monkeypatch.chdir(tmp_path)
  # (with the tiny default's samples: every 2 epochs and before the first step; the runs compared
  # with it draw none, so sampling leaves training as it was)
  run_a = train.run(tiny_config(name, **{"epochs": 4, "checkpoint_every_n_steps": 2,
                                         "output_dir": str(tmp_path / "a"), "sample_every_n_epochs": 2}))
  fam = family_lib.get(name)
  # metrics.jsonl has the epochs' and the evals' losses beside the steps'
  assert [m["epoch"] for m in read_metrics(run_a, "train/epoch_loss")] == [1, 2, 3, 4]
  assert [m["step"] for m in read_metrics(run_a, "tiny_eval/loss")] == [0, 3, 6, 9, 12]
  samples_written_at(run_a, [0, 6, 12], family_config(name))
  config_b = lambda **overrides: tiny_config(name, epochs=4, checkpoint_every_n_steps=2,
                                             output_dir=str(tmp_path / "b"), **overrides)
  run_b = train.run(config_b(max_steps=5))  # stops mid-epoch
  if name == MACHINERY_FAMILY:
    resume_refusals_are_one_line(tmp_path, name, run_a, run_b, args)
  # resumed (the machinery's family: with all but one of the blocks' weights in host memory,
  # the last stack's first; the others compile nothing new)
  path = fam.checkpoint_path(tiny_config(name).model)
  blocks = sum(length for _, length, _ in fam.stacks(models.checkpoint_config(name, path))) - 1
  blocks = blocks if name == MACHINERY_FAMILY else 0
  capsys.readouterr()
  train.run(config_b(blocks_to_swap=blocks), resume="latest")
  out = capsys.readouterr().out
  assert "resumed" in out, out
  assert not blocks or swap_message(fam, path, blocks) in out, out
  losses_a = [m["train/loss"] for m in read_metrics(run_a)]
  losses_b = [m["train/loss"] for m in read_metrics(run_b)]
  assert len(losses_a) == len(losses_b) == 12
  assert_close(losses_b, losses_a, what="losses")
  # the epoch resumed in its middle (at step 5 of 4-6) averages all its steps
  assert_close(epoch_losses(run_b), epoch_losses(run_a), what="epoch losses")
  final_a = load_file(os.path.join(run_a, "epoch4", lora.WEIGHTS_NAME))
  final_b = load_file(os.path.join(run_b, "epoch4", lora.WEIGHTS_NAME))
  # Adam's step is about lr whatever the gradient's size, so rounding in a gradient near zero (of
  # swapped blocks, programs of their own) can move its entry by lr a step: entries were seen 1e-3
  # of their leaf's largest apart (0 on an AVX-512 EPYC) while the losses, which those entries
  # barely move, agreed to 1e-5. 1e-3 over the whole LoRA keeps that room.
  assert_close(final_b, final_a, bound=1e-3, what="the final LoRA")

  if name == MACHINERY_FAMILY:  # a family's own stacks over stages: tests/multidevice_check.py
    resumes_across_placements(tmp_path, name, args, losses_a)


def resumes_across_placements(tmp_path, name, args, losses_a):
  """The run of `test_resume_gives_the_same_run` (its losses `losses_a`) again across placements."""
  fam = family_lib.get(name)
  path = fam.checkpoint_path(tiny_config(name).model)
  # 5 steps on a 2-stage pipeline, each stage's tokens split over 2 devices (sequence
  # parallelism), resumed on 2 data-parallel devices (same global batch),
  half = run_main(tmp_path, name, "--config.max_steps=5", "--config.pipeline_stages=2",
                  "--config.sequence_parallel=2", *args, output="c", devices=4)
  assert half.returncode == 0 and f"stage 1: {fam.stacked[0]} " in half.stdout, half.stdout
  assert "'seq': 2" in half.stdout, half.stdout
  # ... with the layers unrolled (every stacked leaf stored per layer; per-block remat), 2 of
  # the last stack's blocks' weights in host memory, drawing samples (the sampler split into
  # programs per block, its batch over the data axis)
  resumed = run_main(tmp_path, name, "--resume_from_checkpoint", "--config.micro_batch_size_per_gpu=1",
                     "--config.unrolled=True", "--config.blocks_to_swap=2", "--config.sample_every_n_epochs=2",
                     *args, output="c", devices=2)
  assert resumed.returncode == 0 and "'data': 2" in resumed.stdout, resumed.stdout
  assert swap_message(fam, path, 2) in resumed.stdout, resumed.stdout
  (run_c,) = glob.glob(str(tmp_path / "c" / "*"))
  assert_close([m["train/loss"] for m in read_metrics(run_c)], losses_a, what="losses")
  samples_written_at(run_c, [6, 12], family_config(name))


def test_config_mistakes_are_one_line_before_any_work(tmp_path, monkeypatch, name=MACHINERY_FAMILY):
  """(An override of a key that does not exist: tests/test_cli.py.)"""
  out = run_main(tmp_path, name, "--config.pipeline_stages=2", "--config.unrolled=True", devices=2)
  assert out.returncode != 0 and out.stdout.strip().splitlines()[-1].endswith("set unrolled=False"), out.stdout
  assert "Traceback" not in out.stdout, out.stdout  # a user's error is one line
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError, match=r"^activation_checkpointing='blok': must be one of"):
    train.run(tiny_config(name, output_dir=str(tmp_path / "out"), activation_checkpointing="blok"))
  # an exclusion that excludes nothing is refused before the datasets are cached
  with pytest.raises(UserError, match="entry 'to_qq' excludes no LoRA target"):
    train.run(tiny_config(name, **{"output_dir": str(tmp_path / "out"), "adapter.exclude_modules": ("to_qq",)}))
  assert not glob.glob(str(tmp_path / "**" / "*.npy"), recursive=True)


def fake_step(loss, grad_norm):
  """A `make_step` whose step only counts itself and reports `loss` and `grad_norm` (no compile)."""
  metrics = dict(loss=jnp.float32(loss), grad_norm=jnp.float32(grad_norm))
  return lambda *args: lambda state, params, batches, key: (dict(state, step=state["step"] + 1), metrics)


def fake_wandb(monkeypatch):
  """A wandb module whose runs log nothing and record the exit code each finishes with."""
  finished = []
  run = types.SimpleNamespace(log=lambda *args, **kwargs: None, define_metric=lambda *args, **kwargs: None,
                              finish=lambda exit_code=None: finished.append(exit_code))
  wandb = types.ModuleType("wandb")
  wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # libraries look for it on import
  wandb.Settings, wandb.init, wandb.errors = dict, lambda **kwargs: run, types.SimpleNamespace(Error=Exception)
  monkeypatch.setitem(sys.modules, "wandb", wandb)
  return finished


def test_wandb_finishes_a_failed_run_with_a_non_zero_exit_code(tmp_path, monkeypatch, name=MACHINERY_FAMILY):
  monkeypatch.chdir(tmp_path)
  finished = fake_wandb(monkeypatch)
  config = tiny_config(name, **{"output_dir": str(tmp_path / "out"), "eval_before_first_step": False,
                                "max_steps": 1, "monitoring.enable_wandb": True})
  monkeypatch.setattr(train, "make_step", fake_step(loss=1.0, grad_norm=1.0))
  train.run(config)
  monkeypatch.setattr(train, "make_step", fake_step(loss=float("nan"), grad_norm=1.0))
  with pytest.raises(UserError, match="non-finite loss"):
    train.run(config)
  assert finished == [0, 1]


def test_a_failure_in_the_first_evaluation_is_a_failed_start(tmp_path, monkeypatch, name=MACHINERY_FAMILY):
  """An error in the evaluation before the first step ends the W&B run as failed and keeps no
  run directory, as an error in the first step does."""
  monkeypatch.chdir(tmp_path)
  finished = fake_wandb(monkeypatch)

  def broken(*args):
    raise RuntimeError("the evaluation broke")
  monkeypatch.setattr(loop, "make_eval", lambda *args: broken)
  with pytest.raises(RuntimeError, match="the evaluation broke"):
    train.run(tiny_config(name, **{"output_dir": str(tmp_path / "out"), "eval_before_first_step": True,
                                   "monitoring.enable_wandb": True}))
  assert finished == [1] and os.listdir(tmp_path / "out") == []


def test_a_resumed_start_counts_the_examples_seen_once(tmp_path, monkeypatch, name=MACHINERY_FAMILY):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(train, "make_step", fake_step(loss=1.0, grad_norm=1.0))
  config = tiny_config(name, output_dir=str(tmp_path / "out"), eval_before_first_step=False,
                       eval_every_n_epochs=0, max_steps=2)
  train.run(config)
  counted, examples_seen = [], data.Batches.examples_seen
  monkeypatch.setattr(data.Batches, "examples_seen",
                      lambda self, step: counted.append(step) or examples_seen(self, step))
  config.max_steps = 3
  train.run(config, resume="latest")
  assert counted == [2]


def test_readme_shows_the_lines_of_metrics_jsonl(tmp_path, monkeypatch, name=MACHINERY_FAMILY):
  """README's example of metrics.jsonl: each kind of line the trainer writes (a step's, an
  epoch's, an eval's), its keys in order (values elided, an eval's quantiles cut short)."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(train, "make_step", fake_step(loss=1.0, grad_norm=1.0))
  monkeypatch.setattr(loop, "make_eval", lambda *args: lambda *a: np.ones(len(training_step.EVAL_QUANTILES)))
  run = train.run(tiny_config(name, output_dir=str(tmp_path / "out"), eval_before_first_step=False,
                              max_steps=3))  # an epoch
  with open(os.path.join(run, "metrics.jsonl")) as f:
    written = {tuple(json.loads(line)) for line in f}
  with open(os.path.join(ROOT, "README.md")) as f:
    examples = re.findall(r'`(\{"step".*?\})`', " ".join(f.read().split()))
  shown = {tuple(re.findall(r'"([^"]+)":', example)) for example in examples}
  assert len(written) == len(shown) == 3, (written, shown)
  assert all(any(keys[:len(s)] == s for s in shown) for keys in written), (written, shown)
  assert all(any(keys[:len(s)] == s for keys in written) for s in shown), (written, shown)


@pytest.mark.parametrize("name", FAMILIES)
def test_out_of_memory_names_the_memory_settings_and_a_failed_start_keeps_no_run(tmp_path, monkeypatch, name):
  monkeypatch.chdir(tmp_path)

  def out_of_memory(*args):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
  monkeypatch.setattr(train, "make_step", lambda *args: out_of_memory)
  with pytest.raises(UserError, match=r"^out of device memory. Settings that lower it: "
                     r"activation_checkpointing \(now 'block'.*blocks_to_swap \(now 0\)"):
    train.run(tiny_config(name, output_dir=str(tmp_path / "out"), eval_before_first_step=False))
  assert os.listdir(tmp_path / "out") == []  # the run directory of a run that never stepped


@pytest.mark.parametrize("name", FAMILIES)
def test_a_full_disk_at_export_and_a_stalled_run_are_said_in_one_line(tmp_path, monkeypatch, capsys, name):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(train, "make_step", fake_step(loss=1.0, grad_norm=0.0))

  def full_disk(tensors, path, metadata=None):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(lora, "write_safetensors", full_disk)
  with pytest.raises(UserError, match=r"^no space left on the device while writing the LoRA epoch1 "
                     r"in .*nothing half-written is left; the last good checkpoint: none yet"):
    train.run(tiny_config(name, output_dir=str(tmp_path / "out"), eval_before_first_step=False))
  (run,) = glob.glob(str(tmp_path / "out" / "*"))
  assert not glob.glob(os.path.join(run, "*.tmp"))
  out = capsys.readouterr().out
  assert out.count("the gradient norm is 0: the LoRA has stopped learning") == 1, out  # warned once


def test_a_sample_size_the_vae_cannot_take_is_said_before_caching(tmp_path, monkeypatch, name=MACHINERY_FAMILY):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(train, "cache_datasets", lambda *args: pytest.fail("cached before the check"))
  with pytest.raises(UserError, match=r"^sample size: height 30 is not a multiple of"):
    train.run(tiny_config(name, output_dir=str(tmp_path / "out"), sample_prompts=("a red pattern",),
                          sample_every_n_epochs=1, sample_height=30))


def test_divergence_is_a_zero_gradient_or_a_loss_ten_times_the_first_steps():
  first = [1.0] * loop.DIVERGENCE_BASELINE_STEPS
  assert loop.divergence(1.2, 0.5, first) is None
  assert "gradient norm is 0" in loop.divergence(1.2, 0.0, first)
  assert "over 10x" in loop.divergence(11.0, 0.5, first)
  assert loop.divergence(11.0, 0.5, first[:3]) is None  # no baseline yet


def test_non_finite_loss_stops_with_a_message(tmp_path, name=MACHINERY_FAMILY):
  out = run_main(tmp_path, name, "--config.optimizer.lr=1e30", "--config.epochs=1",
                 "--config.compilation_cache_dir=xla", shared_compilation_cache=False)
  assert out.returncode != 0
  assert "non-finite loss" in out.stdout and "last good checkpoint" in out.stdout, out.stdout
  assert os.listdir(tmp_path / "xla"), "the compiled programs were not kept"


def test_float8_base_tracks_full_precision(loaded):
  """float8 storage covers the family's float8 targets (the blocks' Linears) and nothing else,
  with a scale per output channel, and trains as full precision does."""
  _, full, path = loaded
  fam = full.family
  fp8 = models.load(fam.type, path, transformer_dtype="float8", progress=False)
  flat = table.flatten(fp8.params)
  kernels = {p[:-1]: leaf for p, leaf in flat.items() if p[-1] == "kernel"}
  covered = {p for p in kernels if table.matches(".".join(p), fam.float8_targets)}
  assert covered and covered != set(kernels)
  for path, kernel in kernels.items():
    assert (kernel.dtype == jnp.float8_e4m3fn) == (path in covered), path
    scale = flat.get(path + ("kernel_scale",))
    assert (scale is not None) == (path in covered) and (
        scale is None or scale.shape == kernel.shape[:-2] + kernel.shape[-1:]), path
  config = tiny_config(fam.type, **{"optimizer.lr": 3e-3})
  _, losses = trained_adapter(full, config, 15)
  _, losses8 = trained_adapter(fp8, config, 15)
  # Flux: within 1% on 2026-12-02; tiny LTX-Video (heads of 8 channels) within 3.4%
  np.testing.assert_allclose(losses8, losses, rtol=0.05)
  assert losses8[-1] < 0.6 * losses8[0]


def equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it (scan bodies, checkpoints, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)


def host_copies(jaxpr):
  """The values a jaxpr moves to host memory."""
  return [v.aval for eqn in equations(jaxpr) if eqn.primitive.name == "device_put"
          for v in eqn.outvars if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host]


def test_remat_policies_and_unrolled_layers_give_the_same_gradients(loaded):
  """Each activation_checkpointing value in a scan, and no remat and "block_offload" unrolled,
  against no remat in a scan: same loss and gradients. Remat must shrink the temporaries, and
  "block_offload" (scanned) must send each block's input [B, tokens, D] to host memory. Unrolled, the placement stores every stacked
  leaf per layer, so that no stacked weight or LoRA (nor a slice of one) is in the program; the
  trainer runs it split into programs per block (`programs`), which must give the same."""
  _, model, path = loaded
  fam = model.family
  batch = fam.random_batch(model.config, 2, seed=0)
  adapter = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  adapter = jax.tree.map(lambda a: a + 0.01, adapter)  # B != 0: every gradient is nonzero
  inputs = (jax.tree.map(lambda x: x[None], batch), jax.random.split(jax.random.key(1), 1))
  unrolled = sharding.make_placement(sharding.make_mesh(1), fam.stacks(model.config), 1, unrolled=True)
  stacked_shapes = {a.shape for n in fam.stacked for a in jax.tree.leaves((model.params[n], adapter[n]))
                    if a.ndim >= 3}  # the kernels and LoRA matrices
  config = tiny_config(fam.type)
  results, temp_bytes = {}, {}
  # On the CPU "block_save_attention" computes as "block" does (XLA's attention has no cuDNN
  # forward to keep), and the programs offload alike for every family: one family checks both.
  machinery = fam.type == MACHINERY_FAMILY
  cases = ([(r, True) for r in runtime.REMAT_POLICIES if machinery or r != "block_save_attention"]
           + [("none", False)] + [("block_offload", False)] * machinery)
  for remat, scanned in cases:
    if scanned:
      run = dataclasses.replace(model, runtime=runtime.Runtime(remat))
      args = (adapter, model.params, *inputs)
      grads = training_step.grad_fn(run, config)
    else:
      run = models.load(fam.type, path, runtime=runtime.Runtime.of(unrolled, remat), placement=unrolled,
                        progress=False)
      args = (unrolled.to_stages(adapter), run.params, *inputs)
      loss, g = training_step.grad_fn(run, config)(*args)
      results["per block", remat] = loss, unrolled.to_layers(g)
      if remat != "none":  # (its programs offload: tests/test_programs.py)
        continue
      # the unrolled layers jitted whole, one program of every layer
      loss_and_grad = jax.value_and_grad(functools.partial(training_step.loss_fn, model=run, config=config))
      grads = lambda adapter, params, batches, keys: loss_and_grad(
          adapter, params, jax.tree.map(lambda x: x[0], batches), keys[0])
    compiled = jax.jit(grads).lower(*args).compile()
    loss, g = compiled(*args)
    results[remat, scanned] = loss, unrolled.to_layers(g)
    temp_bytes[remat, scanned] = compiled.memory_analysis().temp_size_in_bytes
    jaxpr = jax.make_jaxpr(grads)(*args).jaxpr
    offloaded = host_copies(jaxpr)
    assert (remat == "block_offload") == bool(offloaded), remat
    assert len({a.shape for a in offloaded}) <= 1 and all(a.shape[0] == 2 for a in offloaded)
    stacked = [v.aval.shape for eqn in equations(jaxpr) for v in eqn.invars
               if getattr(v.aval, "shape", None) in stacked_shapes]
    assert bool(stacked) == scanned, (remat, scanned, stacked)
  assert temp_bytes["block", True] < temp_bytes["none", True] / 2, temp_bytes
  loss, want = results["none", True]
  for key, (value, got) in results.items():
    assert_close(value, loss, what=f"{key}: loss")
    assert_close(got, want, what=f"{key}: gradients")


def test_the_unrolled_step_reads_the_lora_in_the_compute_dtype(tiny_models, name=MACHINERY_FAMILY):
  """Unrolled, the step's programs read the LoRA converted once to the compute dtype (by the
  update that made it): the same loss and gradient as from the float32 LoRA, and two steps
  equal the updates applied by hand to the float32 LoRA's gradients."""
  fam, path = family_lib.get(name), tiny_models(name)["formats"]["diffusers"]
  placement = sharding.make_placement(sharding.make_mesh(1), fam.stacks(models.checkpoint_config(
      fam.type, path)), 1, unrolled=True)
  model = models.load(fam.type, path, dtype=jnp.bfloat16, runtime=runtime.Runtime.of(placement),
                      placement=placement, progress=False)
  config = tiny_config(fam.type)
  tx, _ = optim.make(config, 10)
  layer_params = models.abstract_params(fam, model.module, model.config)
  adapter = jax.tree.map(lambda a: a + 0.01, lora.init(layer_params, fam.lora_targets, 4,
                                                       jnp.float32, jax.random.key(0)))
  state = placement.create(functools.partial(training_step.init_state, layer_params=layer_params,
                                          config=config, tx=tx, family=fam), None, adapter)
  batches = [jax.tree.map(lambda x: x[None], fam.random_batch(model.config, 2, seed=s)) for s in (0, 1)]
  keys = [jax.random.split(jax.random.key(s), 1) for s in (0, 1)]
  grads = training_step.grad_fn(model, config)
  loss, want = grads(state["lora"], model.params, batches[0], keys[0])
  loss_bf16, got = grads(lora.in_dtype(state["lora"], jnp.bfloat16), model.params, batches[0], keys[0])
  assert float(loss_bf16) == float(loss)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(g.astype(jnp.float32), w)

  by_hand = jax.jit(functools.partial(training_step.apply_gradients, tx=tx))
  plain = placement.to_layers(state)
  for batch, key in zip(batches, keys):
    loss, g = grads(placement.to_stages(plain["lora"]), model.params, batch, key)
    plain, _ = by_hand(plain, loss, placement.to_layers(g))
  step = training_step.make_step(model, config, tx, placement)
  for s, batch in enumerate(batches):
    state, _ = step(state, model.params, batch, jax.random.key(s))  # its keys: `keys`
  assert_close(placement.to_layers(state["lora"]), plain["lora"])


def test_swapped_blocks_stay_in_host_memory_and_give_the_same_gradients(loaded):
  """blocks_to_swap: the swapped layers' weights live in pinned host memory, are never kept as
  residuals for the backward pass (they are copied to the device again), and change nothing;
  each block is recomputed in the backward pass, not merged with the forward pass by XLA (the
  compiled temporaries stay those of per-block remat, plus one swapped layer)."""
  _, _, path = loaded
  fam = loaded[1].family
  mesh = sharding.make_mesh(1)
  config = tiny_config(fam.type)
  cfg = models.checkpoint_config(fam.type, path)
  block_stacks = fam.stacks(cfg)
  most = sum(length for _, length, _ in block_stacks) - 1  # all but one: over several stacks
  results, temps = {}, {}
  # none; 2 of the last stack's blocks (a resident one between them where it has 3); all but
  # one block; unrolled, each layer's weights an array of their own (`programs` copies them)
  for remat, swap, scanned in (("block", 0, True), ("none", 2, True), ("block", most, True),
                               ("block", most, False), ("none", 2, False)):
    placement = sharding.make_placement(mesh, block_stacks, 1, swap, unrolled=not scanned)
    model = models.load(fam.type, path, runtime=runtime.Runtime.of(placement, remat),
                        placement=placement, progress=False)
    assert placement.swap == sharding.swapped_layers(block_stacks, swap)
    if not results:
      abstract = models.abstract_params(fam, model.module, model.config)
      batch = fam.random_batch(model.config, 2, seed=0)
      adapter = lora.init(abstract, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
      adapter = jax.tree.map(lambda a: a + 0.01, adapter)
    args = (placement.to_stages(adapter), model.params, jax.tree.map(lambda x: x[None], batch),
            jax.random.split(jax.random.key(1), 1))
    if swap == most:  # disable_block_swap_for_eval: the evals on a device copy, the same losses
      on_device = loop.eval_weights(model.params, dict(disable_block_swap_for_eval=True), placement)
      assert all(a.sharding.memory_kind == "device" for a in jax.tree.leaves(on_device))
      evaluate = training_step.make_eval(model, config)
      assert_close(evaluate(args[0], on_device, batch, jax.random.key(2)),
                   evaluate(args[0], model.params, batch, jax.random.key(2)), what="eval loss")
    if not scanned:
      lengths = {name: length for name, length, _ in block_stacks}
      for name, n in placement.swap:
        want = [i in stacks.swap_positions(lengths[name], n) for i in range(lengths[name])]
        for leaf in jax.tree.leaves(model.params[name], is_leaf=is_layer_arrays):
          assert [a.sharding.memory_kind == "pinned_host" for a in leaf.arrays] == want, (name, n)
      loss, g = training_step.grad_fn(model, config)(*args)
      results[remat, swap, scanned] = loss, placement.to_layers(g)
      continue
    swapped = swapped_stacks(model.params)
    assert [host_layers(model.params[name]) for name, _ in placement.swap] == [n for _, n in placement.swap]
    assert len(swapped) == len(placement.swap)
    assert all(h.sharding.memory_kind == "pinned_host" for s in swapped for h in s.pinned_host)
    assert all(a.sharding.memory_kind == "device" for s in swapped for a in jax.tree.leaves(s.device))
    grads = training_step.grad_fn(model, config)
    results[remat, swap, scanned] = jax.jit(grads)(*args)
    temps[remat, swap] = jax.jit(grads).lower(*args).compile().memory_analysis().temp_size_in_bytes
    # each swapped layer is copied to the device twice, forward and backward, as one buffer:
    # never kept
    copies = [v for eqn in equations(jax.make_jaxpr(grads)(*args).jaxpr) for v in eqn.outvars
              if eqn.primitive.name == "device_put" and eqn.params["devices"] == (jax.memory.Space.Device,)]
    buffers = [h for s in swapped for h in s.pinned_host]
    assert len(copies) == 2 * len(buffers), (len(copies), len(buffers))
  # a few swapped layers at a time on the device (a buffer, its weights and the block's
  # recompute), not all of them (`buffers`: the last scanned run's, all but one block)
  assert temps["block", most] - temps["block", 0] < sum(h.nbytes for h in buffers), temps
  loss, want = results["block", 0, True]
  for key, (value, got) in results.items():
    assert_close(value, loss, what=f"{key}: loss")
    assert_close(got, want, what=f"{key}: gradients")
  # created in place (random init): the same weights, split the same way; the forward pass
  # of unrolled layers runs as programs per block
  plain, split, unrolled = (models.init_random(
      fam.type, cfg, jax.random.key(3), runtime=runtime.Runtime.of(placement), placement=placement)
      for placement in (sharding.make_placement(mesh, block_stacks, 1, swap, unrolled)
                     for swap, unrolled in ((0, False), (most, False), (most, True))))
  for name, n in sharding.swapped_layers(block_stacks, most):
    assert len(split.params[name].pinned_host) == n
  inputs = fam.random_inputs(cfg, batch=1, seed=6)
  for model in (split, unrolled):
    assert_close(model(**inputs), plain(**inputs))
  with pytest.raises(ValueError, match=f"the model has {most + 1} blocks"):
    sharding.make_placement(mesh, block_stacks, 1, most + 2)
  with pytest.raises(ValueError, match="blocks_to_swap needs pipeline_stages=1"):
    runtime.remat_policy("block", pipelined=True, swapped=True)


def test_two_processes_train_as_one_process_with_two_devices(tmp_path, name=MACHINERY_FAMILY):
  """A multi-host launch (2 processes, 1 CPU device each, gloo collectives) runs the same steps
  as one process with 2 devices: process 0 caches and exports, both checkpoint into one run.
  The launch also draws samples (each epoch), which process 0 alone writes; the losses show
  that sampling leaves training as it was."""
  args = ["--config.epochs=2", "--config.micro_batch_size_per_gpu=1", "--config.checkpoint_every_n_steps=4"]
  reference = run_main(tmp_path, name, *args, output="one", devices=2)
  assert reference.returncode == 0, reference.stdout
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(1),
             JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "main.py"), "--config", config_file(name) + ":tiny",
       f"--config.output_dir={tmp_path}/two", *args, "--config.sample_every_n_epochs=1",
       f"--coordinator_address=localhost:{port}",
       "--num_processes=2", f"--process_id={i}"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  (run_one,) = glob.glob(str(tmp_path / "one" / "*"))
  (run_two,) = glob.glob(str(tmp_path / "two" / "*"))  # one run directory for both processes
  assert_close([m["train/loss"] for m in read_metrics(run_two)], [m["train/loss"] for m in read_metrics(run_one)])
  assert os.path.isdir(os.path.join(run_two, "global_step4")) and os.path.isdir(os.path.join(run_two, "epoch2"))
  samples_written_at(run_two, [0, 3, 6], family_config(name))


def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_run_resumes_exactly(tmp_path, name=MACHINERY_FAMILY):
  """SIGTERM (a scheduler's preemption), then SIGINT (Ctrl-C): each run finishes its step, writes
  a checkpoint at it, says where and exits non-zero without a traceback; resuming twice gives
  the losses of a run never stopped (which is `test_resume_gives_the_same_run`'s 12 steps)."""
  args = ["--config.epochs=4", "--config.checkpoint_every_n_steps=0"]
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(1))
  command = [sys.executable, os.path.join(ROOT, "main.py"), "--config", config_file(name) + ":tiny",
             f"--config.output_dir={tmp_path}/out", *no_samples(), *args]
  stopped_at = []
  for signum, resume in ((signal.SIGTERM, []), (signal.SIGINT, ["--resume_from_checkpoint"])):
    proc = subprocess.Popen(command + resume, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = lambda: glob.glob(str(tmp_path / "out" / "*" / "metrics.jsonl"))
    lines = lambda: len(read_metrics(os.path.dirname(metrics()[0]))) if metrics() else 0
    start = time.time()
    while lines() < sum(stopped_at) + 2 and proc.poll() is None and time.time() - start < 300:
      time.sleep(0.05)
    proc.send_signal(signum)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and "Traceback" not in out, out
    (run,) = glob.glob(str(tmp_path / "out" / "*"))
    step = len(read_metrics(run))
    assert f"stopped by {signal.Signals(signum).name} at step {step}" in out, out
    assert os.path.isdir(os.path.join(run, f"global_step{step}")), out
    stopped_at.append(step)
  assert stopped_at[0] < stopped_at[1] < 12, stopped_at
  done = run_main(tmp_path, name, "--resume_from_checkpoint", *args)
  assert done.returncode == 0, done.stdout
  steps = [m["step"] for m in read_metrics(run)]
  assert steps == list(range(1, 13)), steps  # each resume continued where the checkpoint was
  full = run_main(tmp_path, name, *args, output="ref")
  assert full.returncode == 0, full.stdout
  (reference,) = glob.glob(str(tmp_path / "ref" / "*"))
  assert_close([m["train/loss"] for m in read_metrics(run)], [m["train/loss"] for m in read_metrics(reference)])
  assert_close(epoch_losses(run), epoch_losses(reference), what="epoch losses")


def test_a_second_ctrl_c_aborts_at_once_in_one_line_naming_the_last_good_checkpoint(
    tmp_path, name=MACHINERY_FAMILY):
  """The first Ctrl-C asks for a stop after the step; a second one, while the step or its
  checkpoint is on its way, exits at once with status 130 and one line, no traceback, and the
  checkpoint it names is complete."""
  command = [sys.executable, os.path.join(ROOT, "main.py"), "--config", config_file(name) + ":tiny",
             f"--config.output_dir={tmp_path}/out", *no_samples(), "--config.checkpoint_every_n_steps=1"]
  proc = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(1)),
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  metrics = lambda: glob.glob(str(tmp_path / "out" / "*" / "metrics.jsonl"))
  start = time.time()
  while not (metrics() and len(read_metrics(os.path.dirname(metrics()[0]))) >= 2) and time.time() - start < 300:
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out = []
  for line in proc.stdout:  # the first one handled: two signals at once would count as one
    out.append(line)
    if "stopping after this step" in line:
      break
  proc.send_signal(signal.SIGINT)
  aborted = time.time()
  out = "".join(out) + proc.communicate(timeout=60)[0]
  assert proc.returncode == 130 and "Traceback" not in out, out
  assert time.time() - aborted < 10, out
  (run,) = glob.glob(str(tmp_path / "out" / "*"))
  last = max(checkpoint.complete_steps(run))  # a checkpoint a step: the step's, or the one before
  found = re.fullmatch(r"error: aborted by a second Ctrl-C at step (\d+); the last good checkpoint: (.*) is kept",
                       out.strip().splitlines()[-1])
  assert found and int(found[1]) in (last, last + 1), out
  assert found[2] == os.path.join(run, f"global_step{last}"), out
