"""The training loop over a prepared run (`train.prepare`): a step a batch, then its parts, each
an object with its own schedule and state: the `Saver` (LoRA exports and checkpoints, as
diffusion-pipe's saver), the `Evaluator`, the `Sampler`, and the `LossWatch` (non-finite and
diverging losses)."""
import contextlib
import dataclasses
import functools
import itertools
import os
import shutil
import signal
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from diffpipe_jax import (axes, checkpoint, data, errors, lora, metrics as metrics_lib, sampling, sharding,
                          stacks)
from diffpipe_jax.errors import UserError
from diffpipe_jax.training_step import EVAL_QUANTILES, make_eval

DIVERGENCE_BASELINE_STEPS = 10  # a later loss ten times these steps' median warns
ABORTED_EXIT_CODE = 128 + signal.SIGINT  # a shell's status of a process that Ctrl-C ended


@dataclasses.dataclass
class Run:
  """A run ready to train (`train.prepare`): the config as run, the mesh and the
  `placement`, the data, the frozen model, the training state in the placement's form and its
  step, and where it writes."""
  config: Any
  family: Any
  mesh: Any
  placement: Any
  run_dir: str
  resumed: bool
  is_main_process: bool  # the one that writes logs and exports
  dataset: data.Batches
  evals: dict  # name -> data.Batches
  prompts: Optional[sampling.Prompts]  # the sample prompts, encoded; None: no samples
  encoders: Any  # the family's torch side: the VAE decodes the samples
  model: Any
  state: dict
  step_fn: Callable  # (state, params, batches, key) -> (state, metrics)
  lr_fn: Callable
  checkpointer: checkpoint.Checkpointer
  to_layers: Callable  # the state in the plain layer form (checkpoints)
  lora_to_layers: Callable  # the LoRA in the plain layer form (exports)
  epoch_losses: list  # the losses of the epoch so far (a resumed epoch's before the resume)

  @property
  def total_steps(self) -> int:
    return planned_steps(self.config, self.dataset.steps_per_epoch)


def planned_steps(config, steps_per_epoch: int) -> int:
  """The steps a run trains in all: its epochs', or fewer where max_steps stops it early."""
  steps = config.epochs * steps_per_epoch
  return min(steps, config.max_steps) if config.max_steps else steps


def every(step: int, n: int) -> bool:
  """Whether a periodic action set to every `n` (steps or epochs; 0: never) is due at `step`."""
  return bool(n) and step % n == 0


def crossed(before: int, after: int, n: int) -> bool:
  """Whether a count went past a multiple of `n` (0: never) from `before` to `after`."""
  return bool(n) and after // n > before // n


@dataclasses.dataclass(frozen=True)
class Position:
  """Where the loop is after a step: the steps and examples done, the examples before the step,
  and the epoch the step belongs to (from 1)."""
  step: int
  examples: int
  examples_before: int
  steps_per_epoch: int

  @property
  def epoch(self) -> int:
    return (self.step - 1) // self.steps_per_epoch + 1

  @property
  def end_of_epoch(self) -> bool:
    return every(self.step, self.steps_per_epoch)

  def due(self, steps: int = 0, epochs: int = 0, examples: int = 0) -> bool:
    """Whether a part set to every `steps`, `epochs` or `examples` (0: never) runs now."""
    return (every(self.step, steps) or (self.end_of_epoch and every(self.epoch, epochs))
            or crossed(self.examples_before, self.examples, examples))


def last_good_checkpoint(run_dir: str) -> str:
  complete = checkpoint.complete_steps(run_dir)  # read on disk: safe in a signal handler too
  return ("none yet" if not complete else
          os.path.join(run_dir, f"{checkpoint.STEP_PREFIX}{complete[-1]}") + " is kept")


@contextlib.contextmanager
def space_for(what: str, run_dir: str):
  """A full disk while writing `what`: one line naming the last good checkpoint."""
  try:
    yield
  except Exception as e:
    if not errors.full_disk(e):
      raise
    raise UserError(f"no space left on the device while writing {what} (nothing half-written is "
                    f"left; the last good checkpoint: {last_good_checkpoint(run_dir)}); free space, then "
                    "--resume_from_checkpoint") from None


class Saver:
  """Exports the LoRA (every save_every_n_epochs/steps/examples, and always at the end) and
  checkpoints the training state (every checkpoint_every_n_steps/epochs/minutes, on a stop and
  at the last step), each whole or not at all."""

  def __init__(self, run: Run):
    self.run, self.last_export, self.last_checkpoint_time = run, None, time.time()

  def export(self, name: str, state, step: int):
    r = self.run
    adapter = r.lora_to_layers(state["lora"])
    if r.is_main_process:
      with space_for(f"the LoRA {name} in {r.run_dir}", r.run_dir):
        saved = lora.save(adapter, os.path.join(r.run_dir, name), r.family, r.config.adapter.rank,
                          np.dtype(jnp.dtype(r.config.save_dtype)))
      tqdm.write(f"saved LoRA: {saved}")
    self.last_export = step

  def exports(self, at: Position, state):
    c = self.run.config
    if at.due(epochs=c.save_every_n_epochs):
      self.export(f"epoch{at.epoch}", state, at.step)
    if at.due(steps=c.save_every_n_steps, examples=c.save_every_n_examples):
      self.export(f"step{at.step}", state, at.step)

  def checkpoint_due(self, at: Position) -> bool:
    c = self.run.config
    due = (at.due(steps=c.checkpoint_every_n_steps, epochs=c.checkpoint_every_n_epochs)
           or (c.checkpoint_every_n_minutes > 0
               and time.time() - self.last_checkpoint_time > 60 * c.checkpoint_every_n_minutes))
    if jax.process_count() > 1:  # every process must take part in a save: process 0's clock decides
      due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
    return due

  def checkpoint(self, step: int, state, epoch_losses: list):
    r = self.run
    per_epoch = r.dataset.steps_per_epoch
    epoch, batch_index = divmod(step, per_epoch)  # where the data continues from
    with space_for(f"checkpoint {checkpoint.STEP_PREFIX}{step} in {r.run_dir}", r.run_dir):
      r.checkpointer.save(step, r.to_layers(state), dict(
          step=step, epoch=epoch, batch_index=batch_index, steps_per_epoch=per_epoch,
          epoch_losses=epoch_losses))
    self.last_checkpoint_time = time.time()

  def finish(self, step: int, state):
    """A run always ends with an exported LoRA."""
    if self.last_export != step:
      per_epoch = self.run.dataset.steps_per_epoch
      self.export(f"step{step}" if step % per_epoch else f"epoch{step // per_epoch}", state, step)


def eval_weights(params, config, placement):
  """The frozen weights the evals use: with `disable_block_swap_for_eval`, swapped layers copied
  to the device for their duration (faster evals, while the memory is there)."""
  swapped = config["disable_block_swap_for_eval"] and placement.swap
  return stacks.to_device(params) if swapped else params


def split_micro_batches(batch, n: int) -> list:
  """A loaded batch of `n` consecutive micro-batches (`data.Batches.load`) -> the `n` of them."""
  return [jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:])[a], batch) for a in range(n)]


class Evaluator:
  """Each eval set's loss at the fixed t quantiles, with the same noise every time (every
  eval_every_n_steps/epochs/examples, and before the first step)."""

  def __init__(self, run: Run, metrics):
    self.run, self.metrics = run, metrics
    self.eval_fn = make_eval(run.model, run.config) if run.evals else None

  def due(self, at: Position) -> bool:
    c = self.run.config
    return bool(self.run.evals) and at.due(c.eval_every_n_steps, c.eval_every_n_epochs, c.eval_every_n_examples)

  def before_first_step(self) -> bool:
    return bool(self.run.evals) and self.run.config.eval_before_first_step

  def __call__(self, step: int, examples: int, state):
    r, accum = self.run, self.run.config.eval_gradient_accumulation_steps
    params = eval_weights(r.model.params, r.config, r.placement)
    for name, ev in r.evals.items():
      losses = []
      for i, batch in enumerate(ev.iterate(0, 0, jax.process_index(), jax.process_count())):
        for a, micro_batch in enumerate(split_micro_batches(batch, accum)):
          losses.append(self.eval_fn(state["lora"], params, sharding.global_batch(
              r.mesh, micro_batch, batch_axis=0), jax.random.key(i * accum + a)))
      losses = np.mean(losses, axis=0)
      self.metrics.write(step, {f"{name}/loss": losses.mean(), **{
          f"{name}/loss_quantile_{q:.2f}": v for q, v in zip(EVAL_QUANTILES, losses)}}, examples=examples)
      tqdm.write(f"eval {name} at step {step}: loss {losses.mean():.4f}")


class Sampler:
  """Each sample prompt drawn with the LoRA as it is, to <run>/samples/step<N>/ (process 0), every
  sample_every_n_steps/epochs and before the first step."""

  def __init__(self, run: Run, metrics):
    self.run, self.metrics = run, metrics
    self.steps, self.guidance = sampling.defaults(run.family, run.config)
    self.step = run.prompts and sampling.step_fn(run.model, run.config.model, self.guidance)

  def due(self, at: Position) -> bool:
    c = self.run.config
    return self.run.prompts is not None and at.due(c.sample_every_n_steps, c.sample_every_n_epochs)

  def before_first_step(self) -> bool:
    return self.run.prompts is not None and self.run.config.sample_before_first_step

  def __call__(self, step: int, examples: int, state):
    r = self.run
    latents = sampling.draw(r.model, r.model.params, state["lora"], r.config.model, r.prompts, self.steps,
                            self.guidance, r.config.sample_seed, rows=r.mesh.shape[axes.DATA], step=self.step,
                            place=functools.partial(sharding.whole_rows, r.mesh))
    if not r.is_main_process:
      return
    folder = os.path.join(r.run_dir, "samples", f"step{step}")
    with space_for(f"the samples in {folder}", r.run_dir):
      written = sampling.write(r.encoders, latents, r.prompts,
                               sampling.folder_paths(folder, len(r.prompts.texts), r.prompts.frames),
                               r.encoders.frame_rate or 24)
    for i, (_, pixels) in enumerate(written):
      self.metrics.image(step, f"samples/{i:02d}", sampling.preview(pixels), examples=examples)
    tqdm.write(f"samples at step {step}: {folder}")


def divergence(loss: float, grad_norm: float, first_losses: list) -> str | None:
  """Why a finite step looks diverged, or None: a gradient norm of 0 (the LoRA stopped
  learning), or a loss ten times its first steps' median."""
  if grad_norm == 0:
    return "the gradient norm is 0: the LoRA has stopped learning"
  if len(first_losses) == DIVERGENCE_BASELINE_STEPS and loss > 10 * np.median(first_losses):
    return f"the loss ({loss:.4g}) is over 10x its first steps' median ({np.median(first_losses):.4g})"
  return None


class LossWatch:
  """A non-finite loss or gradient norm stops the run; a diverging one warns, once a kind."""

  def __init__(self, run: Run):
    self.run, self.first_losses, self.warned = run, [], set()

  def __call__(self, step: int, loss: float, grad_norm: float):
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
      raise UserError(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; "
                      f"stopping. The last good checkpoint: {last_good_checkpoint(self.run.run_dir)}: "
                      "lower optimizer.lr or check the data, then --resume_from_checkpoint")
    if len(self.first_losses) < DIVERGENCE_BASELINE_STEPS:
      self.first_losses.append(loss)
    problem = divergence(loss, grad_norm, self.first_losses)
    if problem and problem.split(":")[0] not in self.warned:
      self.warned.add(problem.split(":")[0])
      tqdm.write(f"warning: at step {step} {problem}; training may have diverged (optimizer.lr="
                 f"{self.run.config.optimizer.lr:g}?): check the losses and the exported LoRAs")


class StopRequests:
  """SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption) ask the run to stop after the
  current step, with a checkpoint; a second SIGINT aborts at once: the process prints
  `on_abort()`'s line and exits as a kill would (checkpoints and exports are written whole or
  not at all), without waiting for the step: an exit that unwinds waits for an XLA compilation
  in progress, seconds, then crashed at teardown. Once a stop is asked, the handler stays until
  the process exits, so that a Ctrl-C while it winds down aborts quietly too. On several
  processes the signal may reach one of them: `requested` is every process's answer (all save
  together)."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, on_abort):
    self.received, self.on_abort = None, on_abort
    self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      # os.write: the code the signal interrupted may be inside a print
      os.write(sys.stderr.fileno(), f"\nerror: {self.on_abort()}\n".encode())
      os._exit(ABORTED_EXIT_CODE)
    self.received = signal.Signals(signum).name
    print(f"\n{self.received}: stopping after this step with a checkpoint (Ctrl-C again to abort now)",
          flush=True)

  def requested(self) -> bool:
    asked = self.received is not None
    if jax.process_count() > 1:
      asked = bool(multihost_utils.process_allgather(np.asarray(asked)).any())
    return asked

  def restore(self):
    """The handlers from before, unless a stop was asked (see above)."""
    if self.received is None:
      for s, handler in self.previous.items():
        signal.signal(s, handler)


def placed_batches(run: Run, start: int):
  """(bucket, its examples, the global batch on the mesh) of steps `start`, `start + 1`, ...
  through the epochs, each batch read and sent to the devices when asked for."""
  dataset, accum = run.dataset, run.config.gradient_accumulation_steps
  for epoch in itertools.count(start // dataset.steps_per_epoch):
    first = max(start - epoch * dataset.steps_per_epoch, 0)
    loaded = dataset.iterate(epoch, first, jax.process_index(), jax.process_count())
    for (bucket, rows), batch in zip(dataset.epoch(epoch)[first:], loaded):
      yield bucket, len(rows), sharding.global_batch(run.mesh, jax.tree.map(
          lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch))


def peak_device_memory_gib():
  """Peak memory of the first local device so far (None where the backend does not report it)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats["peak_bytes_in_use"] / 2**30 if stats and "peak_bytes_in_use" in stats else None


def loop(run: Run) -> str:
  """Trains `run` to its last step: a step a batch (the next batch read and sent while it runs),
  its metrics, then the parts that are due; a stop asked by a signal ends after the step with a
  checkpoint. Returns the run directory."""
  config, state, dataset = run.config, run.state, run.dataset
  per_epoch, total, epoch_losses = dataset.steps_per_epoch, run.total_steps, run.epoch_losses
  step = int(state["step"])
  examples = dataset.examples_seen(step)
  metrics = metrics_lib.MetricWriter(run.run_dir, run.is_main_process, resumed_at=step if run.resumed else None,
                                     resumed_examples=examples if run.resumed else None, config=config)
  saver, watch = Saver(run), LossWatch(run)
  parts = (Evaluator(run, metrics), Sampler(run, metrics))  # in the order they run after a step

  def discard_failed_start():
    """A run that ends before its first step leaves no run directory: nothing to keep."""
    if step == 0 and not run.resumed and run.is_main_process:
      shutil.rmtree(run.run_dir, ignore_errors=True)

  def abort():
    discard_failed_start()
    return (f"aborted by a second Ctrl-C at step {step}; the last good checkpoint: "
            f"{last_good_checkpoint(run.run_dir)}")

  key = jax.random.key(config.seed + 1)
  bar = tqdm(total=total, initial=step, desc="training", unit="step", dynamic_ncols=True)
  upcoming, compiled = placed_batches(run, step), set()
  stop = StopRequests(on_abort=abort)
  failed = True  # until the last export: an error or a stop ends the W&B run as failed
  try:
    if step == 0:
      for part in parts:
        if part.before_first_step():  # the base model (the LoRA starts at zero), to compare with
          part(0, 0, state)
    batch = next(upcoming) if step < total else None
    while step < total:
      bucket, size, batches = batch  # bucket: (width, height, frames); a new one compiles the step
      if bucket not in compiled:
        width, height, frames = bucket
        bar.set_description(f"compiling the step for {width}x{height}"
                            + (f", {frames} frames" if frames > 1 else ""))
      state, step_metrics = run.step_fn(state, run.model.params, batches, jax.random.fold_in(key, step))
      # the next batch is read and copied while this step runs (the step is dispatched, not done)
      batch = next(upcoming) if step + 1 < total else None
      loss, grad_norm = float(step_metrics["loss"]), float(step_metrics["grad_norm"])
      if bucket not in compiled:
        compiled.add(bucket)
        bar.set_description("training")
      watch(step + 1, loss, grad_norm)
      step += 1
      at = Position(step, examples + size, examples, per_epoch)
      examples = at.examples
      lr = float(run.lr_fn(step - 1)) * float(step_metrics.get("estim_lr", 1.0))  # (Prodigy's estimate)
      epoch_losses.append(loss)
      peak_gib = peak_device_memory_gib()
      metrics.write(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                           **({"train/peak_memory_gib": peak_gib} if peak_gib is not None else {})},
                    examples=examples)
      bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", epoch=at.epoch,
                      **({"peak_mem": f"{peak_gib:.1f}G"} if peak_gib is not None else {}))
      bar.update(1)
      if at.end_of_epoch:
        metrics.write(step, {"train/epoch_loss": np.mean(epoch_losses)}, epoch=at.epoch, examples=examples)
        epoch_losses = []
      saver.exports(at, state)
      for part in parts:
        if part.due(at):
          part(step, examples, state)
      stopping = stop.requested()
      if saver.checkpoint_due(at) or stopping or step == total:
        saver.checkpoint(step, state, epoch_losses)
      if stopping:
        raise UserError(f"stopped by {stop.received or 'a signal to another process'} at step "
                        f"{step}: checkpoint {os.path.join(run.run_dir, checkpoint.STEP_PREFIX)}{step} "
                        "written; continue with --resume_from_checkpoint")
    saver.finish(step, state)
    failed = False
  finally:
    stop.restore()
    bar.close()
    metrics.close(failed)
    discard_failed_start()
  print(f"done: {step} steps in {run.run_dir}")
  return run.run_dir
