"""LoRA training of any model family: `run(config)` is the whole job (data, model, state, the
update of `update.py`, evals, saves, the loop), and what `main.py` calls after its flags."""
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from diffpipe_jax import (checkpoint, data, device_memory, errors, lora, media, models, optim,
                          sample, sequence, sharding, stacks, tiny, validate)
from diffpipe_jax import family as family_lib, metrics as metrics_lib
from diffpipe_jax.errors import UserError
from diffpipe_jax.update import EVAL_QUANTILES, init_state, make_eval, make_step

COMPILATION_CACHE_BYTES = 16 * 2**30  # beyond this, the least recently used programs go
DIVERGENCE_BASELINE_STEPS = 10  # a later loss ten times these steps' median warns
ABORTED_EXIT_CODE = 128 + signal.SIGINT  # a shell's status of a process that Ctrl-C ended


def every(step: int, n: int) -> bool:
  """Whether a periodic action set to every `n` (steps or epochs; 0: never) is due at `step`."""
  return bool(n) and step % n == 0


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


def use_compilation_cache(directory: str):
  """Keeps compiled programs in `directory` (unless JAX_COMPILATION_CACHE_DIR names another)."""
  if directory and jax.config.jax_compilation_cache_dir is None:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)


def check_adapter(config, family, path):
  """The LoRA's targets less `adapter.exclude_modules` (`lora.select_targets`) and its rank
  (`lora.check_rank`), checked on the checkpoint's shapes before the datasets are cached and the
  weights loaded rather than after."""
  cfg = models.checkpoint_config(family.type, path)
  layer_params = models.abstract_params(family, family.make_module(cfg), cfg)
  targets = lora.select_targets(layer_params, family.lora_targets, config.adapter.exclude_modules)
  lora.check_rank(layer_params, targets, config.adapter.rank)


def eval_settings(train_settings, entry):
  """An eval set's dataset settings: its own dataset TOML (diffusion-pipe's eval_datasets), or a
  folder taking the training set's bucket settings."""
  if entry.get("toml_path"):
    return data.dataset_settings(dict(toml_path=entry.toml_path))
  return dataclasses.replace(train_settings, directories=(media.DirectorySettings(path=entry.path),))


def crossed(before: int, after: int, n: int) -> bool:
  """Whether a count went past a multiple of `n` (0: never) from `before` to `after`."""
  return bool(n) and after // n > before // n


def cache_datasets(config, family, encoders, regenerate, build=True):
  """Caches the training and eval datasets (the family's PyTorch `encoders` load when something
  needs encoding); with build=False, opens the caches another process built."""
  train_settings = data.dataset_settings(config.dataset)
  settings = {"train": train_settings, **{name: eval_settings(train_settings, e)
                                          for name, e in config.eval_datasets.items()}}
  if not build:
    return {name: data.open_cached_dataset(s, family.type) for name, s in settings.items()}
  return {name: data.cache_dataset(s, family.type, encoders, config.caching_batch_size, regenerate)
          for name, s in settings.items()}


def sampling_on(config) -> bool:
  return bool(config.sample_prompts) and bool(config.sample_every_n_epochs or config.sample_every_n_steps)


def encode_sample_prompts(config, family, encoders):
  """The sample prompts at the sample size, encoded once (kept in output_dir/.sample_prompts/, beside
  the runs, for the next run, a resume and the other processes)."""
  return sample.encode_prompts(family, encoders, sample.prompt_lines(config.sample_prompts),
                               *sample.size(config),
                               cache_dir=os.path.join(config.output_dir, ".sample_prompts"))


def split_cost(split, balanced) -> str:
  """What a manual `partition_split` plan costs beside the balanced one: a JAX array's shards
  have one size, so every stage stores as many layers of a stack as its fullest stage holds."""
  return (f"partition_split: each stage stores {split.layers_stored()} layers (padding included) "
          f"and idles {split.bubble():.0%} of the step; without partition_split the stages are "
          f"balanced: {balanced.layers_stored()} layers, {balanced.bubble():.0%} idle. Unlike "
          "DeepSpeed's, no split gives one GPU fewer weights than another")


def eval_weights(params, config, layout):
  """The frozen weights the evals use: with `disable_block_swap_for_eval`, swapped layers copied
  to the device for their duration (faster evals, while the memory is there)."""
  swapped = config["disable_block_swap_for_eval"] and layout.swap
  return stacks.to_device(params) if swapped else params


def schedule(dataset) -> str:
  return (f"global batches {sorted(set(map(dataset.batch_size, dataset.groups)))}; "
          f"{dataset.steps_per_epoch} steps an epoch")


def split_micro_batches(batch, n: int) -> list:
  """A loaded batch of `n` consecutive micro-batches (`data.Batches.load`) -> the `n` of them."""
  return [jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:])[a], batch) for a in range(n)]


def from_process_0(text: str) -> str:
  """Process 0's string on every process (a multi-host run agrees on names this way)."""
  if jax.process_count() == 1:
    return text
  buf = np.zeros(1024, np.uint8)
  buf[:len(text.encode())] = np.frombuffer(text.encode(), np.uint8)
  return bytes(multihost_utils.broadcast_one_to_all(buf)).rstrip(b"\0").decode()


def peak_device_memory_gib():
  """Peak memory of the first local device so far (None where the backend does not report it)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats["peak_bytes_in_use"] / 2**30 if stats and "peak_bytes_in_use" in stats else None


def out_of_memory_advice(config) -> str:
  """What lowers device memory, with the config's current values (figures: BENCHMARKS.md)."""
  return (f"out of device memory. Settings that lower it: activation_checkpointing (now "
          f"{config.activation_checkpointing!r}; 'block' or 'block_offload' keep least), "
          f"blocks_to_swap (now {config.blocks_to_swap}), model.transformer_dtype='float8' (now "
          f"{config.model.transformer_dtype!r}), micro_batch_size_per_gpu (now "
          f"{config.micro_batch_size_per_gpu}), the dataset's resolutions, and caching_batch_size "
          f"(now {config.caching_batch_size}) while caching; BENCHMARKS.md has the memory of each")


def config_changes(run_dir: str, config) -> list:
  """"key: old -> new" for each setting that differs from the run's `config.json`."""
  with open(os.path.join(run_dir, "config.json")) as f:
    old = validate.flatten(json.load(f))
  new = validate.flatten(json.loads(metrics_lib.public_config(config).to_json_best_effort()))
  return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
          if old.get(k) != new.get(k)]


def check_resumable(run_dir: str, ckpt, config, abstract_state):
  """Before restoring: the checkpoint must hold the state this config trains (the same adapter
  and optimizer); otherwise the settings that changed since the run started are named."""
  saved, wanted = ckpt.saved_shapes(), checkpoint.shapes(abstract_state)
  if saved == wanted:
    return
  differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
  example = f"{differ[0]}: {saved.get(differ[0], 'absent')} saved, {wanted.get(differ[0], 'absent')} now"
  changes = "; ".join(config_changes(run_dir, config)) or "none found in config.json"
  raise UserError(f"cannot resume {run_dir}: its checkpoint holds another training state ({len(differ)} "
                  f"arrays differ, e.g. {example}); settings changed since the run started: {changes}. "
                  "Resume with the run's settings, or start a new run (adapter.init_from_existing "
                  "continues from an exported LoRA)")


def divergence(loss: float, grad_norm: float, first_losses: list) -> str | None:
  """Why a finite step looks diverged, or None: a gradient norm of 0 (the LoRA stopped
  learning), or a loss ten times its first steps' median."""
  if grad_norm == 0:
    return "the gradient norm is 0: the LoRA has stopped learning"
  if len(first_losses) == DIVERGENCE_BASELINE_STEPS and loss > 10 * np.median(first_losses):
    return f"the loss ({loss:.4g}) is over 10x its first steps' median ({np.median(first_losses):.4g})"
  return None


def planned_steps(config, steps_per_epoch: int) -> int:
  """The steps a run trains in all: its epochs', or fewer where max_steps stops it early."""
  steps = config.epochs * steps_per_epoch
  return min(steps, config.max_steps) if config.max_steps else steps


def check_unfinished(run_dir: str, meta: dict, config):
  """Refuses to resume a run whose checkpoint is at or past its planned steps, its LoRA exported
  there (it would train nothing), naming the limits it reached and what extends it. max_steps
  only stops a run early, as in diffusion-pipe: more epochs extend one (and a max_steps that
  stopped it, raised); a decaying learning rate schedule is then stretched over the new total
  (it is a function of the total, not saved state)."""
  step, per_epoch = meta["step"], meta["steps_per_epoch"]
  exports = [f"step{step}"] + ([f"epoch{step // per_epoch}"] if step % per_epoch == 0 else [])
  if step < planned_steps(config, per_epoch) or not any(
      os.path.isdir(os.path.join(run_dir, name)) for name in exports):  # (a full disk): export it
    return
  reached, extend = [], []
  if config.epochs * per_epoch <= step:
    epochs = max(config.epochs + 1, -(-config.max_steps // per_epoch))  # to max_steps, if set
    reached.append(f"epochs={config.epochs} ({per_epoch} steps each) end")
    extend.append(f"epochs (e.g. --config.epochs={epochs})")
  if 0 < config.max_steps <= step:
    reached.append(f"max_steps={config.max_steps} stops it")
    extend.append("max_steps (0: no limit)")
  early = (f" (max_steps={config.max_steps} only stops a run early)"
           if config.max_steps > step else "")
  stretched = (f" (lr_scheduler={config.lr_scheduler!r} is then stretched over the new total: the "
               f"learning rate rises again at step {step})"
               if config.lr_scheduler != "constant" and not config.force_constant_lr else "")
  raise UserError(f"--resume_from_checkpoint: {run_dir} is complete: its checkpoint is at step {step}, "
                  f"where {' and '.join(reached)}{early}; to train on, raise {' and '.join(extend)}"
                  f"{stretched}")


def run(config, *, resume=None, cache_only=False, regenerate_cache=False):
  """Trains a LoRA as `config` says (its keys: schema.py); `resume`: a run directory name under
  `output_dir`, or "latest", to continue. Returns the run directory (None with `cache_only`).
  A user's mistake (and the device running out of memory) raises `UserError`."""
  try:
    with contextlib.ExitStack() as on_exit:  # the run directory's lock, until the run returns
      return train(config, resume, cache_only, regenerate_cache, on_exit)
  except Exception as e:
    if errors.out_of_memory(e) and not isinstance(e, UserError):
      raise UserError(out_of_memory_advice(config)) from e
    raise


def train(config, resume, cache_only, regenerate_cache, on_exit: contextlib.ExitStack):
  """`run`'s body; `on_exit` holds what must be released when it returns or raises."""
  use_compilation_cache(config.compilation_cache_dir)
  family = family_lib.get(config.model.type)
  validate.check(config, family)  # every value, before anything is written or loaded
  metrics_lib.check_wandb(config)
  memory = device_memory.Sharing(config.max_device_memory_gib)  # before JAX's backend starts
  is_main_process = jax.process_index() == 0  # the one that writes logs and exports

  # ---------------------------------------------------------------- mesh
  mesh = sharding.make_mesh(config.pipeline_stages, sequence_parallel=config.sequence_parallel)
  data_parallel = mesh.shape["data"]
  on_exit.enter_context(sequence.parallel(mesh))  # what is traced splits its tokens over 'seq'

  # ---------------------------------------------------------------- a resumed run's directory
  run_dir = None
  if resume is not None:  # found and locked first: a run in use is refused before any work
    run_dir = from_process_0(checkpoint.resolve_resume(config.output_dir, resume or "latest")
                             if is_main_process else "")
    if is_main_process:
      on_exit.enter_context(checkpoint.lock_run_dir(run_dir))
    ckpt = checkpoint.Checkpointer(run_dir, keep=config.checkpoints_to_keep)
    check_unfinished(run_dir, ckpt.meta(), config)

  # ---------------------------------------------------------------- data (cached once)
  # Process 0 writes the tiny default and the caches (a shared filesystem); the others wait for
  # it, then read them. The encoders load their models only when something needs encoding (and
  # for samples the VAE alone, when decoding).
  path = tiny.checkpoint_path(config, family) if is_main_process else None
  if path is not None:
    check_adapter(config, family, path)
  encoders = family_lib.torch_side(family).load_encoders(config.model)
  cached = prompts = None
  if is_main_process:
    cached = cache_datasets(config, family, encoders, regenerate_cache)
    prompts = encode_sample_prompts(config, family, encoders) if sampling_on(config) else None
    encoders.release()
  memory.training()  # from here JAX's pool, and PyTorch the rest (samples' decoding)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("datasets cached")
    path = path or tiny.checkpoint_path(config, family)
    cached = cached or cache_datasets(config, family, encoders, regenerate_cache, build=False)
    if sampling_on(config) and prompts is None:
      prompts = encode_sample_prompts(config, family, encoders)  # process 0's, read back
  config = data.config_as_run(config, data.dataset_settings(config.dataset))
  accum, eval_accum = config.gradient_accumulation_steps, config.eval_gradient_accumulation_steps
  micro = data.micro_batch_sizes(config.micro_batch_size_per_gpu, config.image_micro_batch_size_per_gpu)
  eval_micro = (data.micro_batch_sizes(config.eval_micro_batch_size_per_gpu)
                if config.eval_micro_batch_size_per_gpu else micro)
  dataset = data.Batches(cached.pop("train"), lambda b: micro(b) * data_parallel * accum, config.seed,
                         family.position_ids, micro_batches=accum, uncond_fraction=config.uncond_fraction)
  evals = {name: data.Batches(dirs, lambda b: eval_micro(b) * data_parallel * eval_accum, config.seed,
                              family.position_ids, name, micro_batches=eval_accum)
           for name, dirs in cached.items()}
  steps_per_epoch = dataset.steps_per_epoch
  if cache_only:
    print(f"cached; exiting (--cache_only): {schedule(dataset)}")
    return None
  total_steps = planned_steps(config, steps_per_epoch)

  # ---------------------------------------------------------------- model (frozen), on the mesh
  block_stacks = family.stacks(models.checkpoint_config(family.type, path))
  unrolled = stacks.unrolled_for(config)
  layout = sharding.make_layout(mesh, block_stacks, accum, config.blocks_to_swap, unrolled,
                                partition_split=config.partition_split,
                                layers_around_stacks=family.layers_around_stacks)
  if layout.plan is not None:
    print(layout.plan.describe())
  if config.partition_split:
    print(split_cost(layout.plan, sharding.make_layout(mesh, block_stacks, accum).plan))
  if layout.swap:
    print("frozen weights in pinned host memory: " + ", ".join(
        f"{n} of the {name}, spread evenly" for name, n in layout.swap))
  model = models.load(family.type, path, dtype=jnp.dtype(config.model.dtype),
                      transformer_dtype=config.model.transformer_dtype,
                      remat=config.activation_checkpointing, unrolled=unrolled, layout=layout)
  params = model.params

  # ---------------------------------------------------------------- adapter and optimizer
  # The state is created, checkpointed and exported in the plain layer layout, and trained in
  # the layout's (per pipeline stage, per layer): `layout.create` and `to_layers` convert, in jit.
  tx, lr_fn = optim.make(config, total_steps)
  make_state = functools.partial(init_state, layer_params=models.abstract_params(
      family, model.module, model.config), config=config, tx=tx, family=family)
  layer_state = jax.eval_shape(make_state, jax.random.key(config.seed))
  replicated = sharding.tree_shardings(mesh, layer_state)
  to_layers = jax.jit(layout.to_layers, out_shardings=replicated)  # checkpoints
  lora_to_layers = jax.jit(layout.to_layers, out_shardings=replicated["lora"])  # exports
  if resume is not None:
    check_resumable(run_dir, ckpt, config, layer_state)
    state, meta = ckpt.restore(abstract_state=jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layer_state, replicated))
    state = layout.create(lambda s: s, state)
    if meta.get("steps_per_epoch", steps_per_epoch) != steps_per_epoch:
      raise UserError(f"{run_dir} was trained with {meta['steps_per_epoch']} steps an epoch, the "
                      f"data now gives {steps_per_epoch}: the dataset or batch settings changed, so "
                      "the run cannot continue where it stopped; start a new run")
    print(f"resumed {run_dir} at step {meta['step']} (epoch {meta['epoch']})")
    # its epoch's losses so far, so that the epoch's loss is the whole epoch's (a checkpoint of
    # an earlier version has none: that epoch's loss then averages the steps after the resume)
    epoch_losses = meta.get("epoch_losses", [])
  else:
    epoch_losses = []
    existing = None
    if config.adapter.init_from_existing:
      try:
        existing = lora.load(config.adapter.init_from_existing, layer_state["lora"], family)
      except UserError as e:
        raise UserError(f"adapter.init_from_existing={config.adapter.init_from_existing!r}: {e}") from None
    state = layout.create(make_state, jax.random.key(config.seed), existing)
    run_dir = from_process_0(checkpoint.new_run_dir(config.output_dir) if is_main_process else "")
    if is_main_process:
      on_exit.enter_context(checkpoint.lock_run_dir(run_dir))
    ckpt = checkpoint.Checkpointer(run_dir, keep=config.checkpoints_to_keep)
  if is_main_process:
    with open(os.path.join(run_dir, "config.json" if resume is None else "config_resumed.json"), "w") as f:
      f.write(metrics_lib.public_config(config).to_json_best_effort(indent=2))  # no API key
  print(f"run directory: {run_dir}; mesh {dict(mesh.shape)} over {len(jax.devices())} devices; "
        f"{schedule(dataset)}")

  # ---------------------------------------------------------------- step, evals, saves
  step_fn = make_step(model, config, tx, layout)
  eval_fn = make_eval(model, config, layout)
  step = int(state["step"])
  examples = dataset.examples_seen(step)
  resumed = resume is not None
  metrics = metrics_lib.MetricWriter(run_dir, is_main_process, resumed_at=step if resumed else None,
                                     resumed_examples=examples if resumed else None,
                                     config=config)

  def run_evals(step):
    """Each eval set's loss at the fixed t quantiles, with the same noise every time."""
    eval_params = eval_weights(params, config, layout)
    for name, ev in evals.items():
      losses = []
      for i, batch in enumerate(ev.iterate(0, 0, jax.process_index(), jax.process_count())):
        for a, micro_batch in enumerate(split_micro_batches(batch, eval_accum)):
          losses.append(eval_fn(state["lora"], eval_params, sharding.global_batch(
              mesh, micro_batch, batch_axis=0), jax.random.key(i * eval_accum + a)))
      losses = np.mean(losses, axis=0)
      metrics.write(step, {f"{name}/loss": losses.mean(), **{
          f"{name}/loss_quantile_{q:.2f}": v for q, v in zip(EVAL_QUANTILES, losses)}}, examples=examples)
      tqdm.write(f"eval {name} at step {step}: loss {losses.mean():.4f}")

  sample_steps, sample_guidance = sample.defaults(family, config)
  sample_step = prompts and sample.step_fn(model, config.model, sample_guidance, layout.pipeline,
                                           split=layout.unrolled)

  def run_samples(step):
    """Each sample prompt drawn with the LoRA as it is, to <run>/samples/step<N>/ (process 0)."""
    latents = sample.draw(model, params, state["lora"], config.model, prompts, sample_steps,
                          sample_guidance, config.sample_seed, rows=data_parallel,
                          step=sample_step, place=functools.partial(sharding.whole_rows, mesh))
    if is_main_process:
      folder = os.path.join(run_dir, "samples", f"step{step}")
      with space_for(f"the samples in {folder}"):
        written = sample.write(encoders, latents, prompts,
                               sample.folder_paths(folder, len(prompts.texts), prompts.frames),
                               encoders.frame_rate or 24)
      for i, (_, pixels) in enumerate(written):
        metrics.image(step, f"samples/{i:02d}", sample.preview(pixels), examples=examples)
      tqdm.write(f"samples at step {step}: {folder}")

  def last_good_checkpoint():
    complete = checkpoint.complete_steps(run_dir)  # read on disk: safe in a signal handler too
    return ("none yet" if not complete else
            os.path.join(run_dir, f"{checkpoint.STEP_PREFIX}{complete[-1]}") + " is kept")

  def discard_failed_start():
    """A run that ends before its first step leaves no run directory: nothing to keep."""
    if step == 0 and resume is None and is_main_process:
      shutil.rmtree(run_dir, ignore_errors=True)

  def abort():
    discard_failed_start()
    return f"aborted by a second Ctrl-C at step {step}; the last good checkpoint: {last_good_checkpoint()}"

  @contextlib.contextmanager
  def space_for(what):
    """A full disk while writing `what`: one line naming the last good checkpoint."""
    try:
      yield
    except Exception as e:
      if not errors.full_disk(e):
        raise
      raise UserError(f"no space left on the device while writing {what} (nothing half-written is "
                      f"left; the last good checkpoint: {last_good_checkpoint()}); free space, then "
                      "--resume_from_checkpoint") from None

  def save_lora(name):
    adapter = lora_to_layers(state["lora"])
    if is_main_process:
      with space_for(f"the LoRA {name} in {run_dir}"):
        saved = lora.save(adapter, os.path.join(run_dir, name), family, config.adapter.rank,
                          np.dtype(jnp.dtype(config.save_dtype)))
      tqdm.write(f"saved LoRA: {saved}")

  def save_checkpoint(step, epoch_losses):
    epoch, batch_index = divmod(step, steps_per_epoch)  # where the data continues from
    with space_for(f"checkpoint {checkpoint.STEP_PREFIX}{step} in {run_dir}"):
      ckpt.save(step, to_layers(state), dict(step=step, epoch=epoch, batch_index=batch_index,
                                             steps_per_epoch=steps_per_epoch,
                                             epoch_losses=epoch_losses))

  def placed_batches(start):
    """(bucket, its examples, the global batch on the mesh) of steps `start`, `start + 1`, ...
    through the epochs, each batch read and sent to the devices when asked for."""
    for epoch in itertools.count(start // steps_per_epoch):
      first = max(start - epoch * steps_per_epoch, 0)
      loaded = dataset.iterate(epoch, first, jax.process_index(), jax.process_count())
      for (bucket, rows), batch in zip(dataset.epoch(epoch)[first:], loaded):
        yield bucket, len(rows), sharding.global_batch(mesh, jax.tree.map(
            lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch))

  # ---------------------------------------------------------------- loop
  key = jax.random.key(config.seed + 1)
  last_checkpoint_time, last_saved_step = time.time(), None
  first_losses, warned = [], set()
  bar = tqdm(total=total_steps, initial=step, desc="training", unit="step", dynamic_ncols=True)
  upcoming, compiled = placed_batches(step), set()
  stop = StopRequests(on_abort=abort)
  failed = True  # until the last export: an error or a stop ends the W&B run as failed
  try:
    if evals and config.eval_before_first_step and step == 0:
      run_evals(0)
    if prompts is not None and config.sample_before_first_step and step == 0:
      run_samples(0)  # the base model (the LoRA starts at zero): what samples are compared with
    batch = next(upcoming) if step < total_steps else None
    while step < total_steps:
      epoch = step // steps_per_epoch
      bucket, size, batches = batch  # bucket: (width, height, frames); a new one compiles the step
      examples_before, examples = examples, examples + size
      if bucket not in compiled:
        width, height, frames = bucket
        bar.set_description(f"compiling the step for {width}x{height}"
                            + (f", {frames} frames" if frames > 1 else ""))
      state, step_metrics = step_fn(state, params, batches, jax.random.fold_in(key, step))
      # the next batch is read and copied while this step runs (the step is dispatched, not done)
      batch = next(upcoming) if step + 1 < total_steps else None
      loss, grad_norm = float(step_metrics["loss"]), float(step_metrics["grad_norm"])
      if bucket not in compiled:
        compiled.add(bucket)
        bar.set_description("training")
      if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        raise UserError(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step + 1}; "
                        f"stopping. The last good checkpoint: {last_good_checkpoint()}: lower "
                        "optimizer.lr or check the data, then --resume_from_checkpoint")
      step += 1
      first_losses = first_losses if len(first_losses) == DIVERGENCE_BASELINE_STEPS else first_losses + [loss]
      problem = divergence(loss, grad_norm, first_losses)
      if problem and problem.split(":")[0] not in warned:
        warned.add(problem.split(":")[0])
        tqdm.write(f"warning: at step {step} {problem}; training may have diverged (optimizer.lr="
                   f"{config.optimizer.lr:g}?): check the losses and the exported LoRAs")
      lr = float(lr_fn(step - 1)) * float(step_metrics.get("estim_lr", 1.0))  # (Prodigy's estimate)
      epoch_losses.append(loss)
      peak_gib = peak_device_memory_gib()
      metrics.write(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                           **({"train/peak_memory_gib": peak_gib} if peak_gib is not None else {})},
                    examples=examples)
      bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", epoch=epoch + 1,
                      **({"peak_mem": f"{peak_gib:.1f}G"} if peak_gib is not None else {}))
      bar.update(1)

      end_of_epoch = every(step, steps_per_epoch)
      if end_of_epoch:
        metrics.write(step, {"train/epoch_loss": np.mean(epoch_losses)}, epoch=epoch + 1, examples=examples)
        epoch_losses = []
      if end_of_epoch and every(epoch + 1, config.save_every_n_epochs):
        save_lora(f"epoch{epoch + 1}")
        last_saved_step = step
      if every(step, config.save_every_n_steps) or crossed(examples_before, examples,
                                                           config.save_every_n_examples):
        save_lora(f"step{step}")
        last_saved_step = step
      if evals and (every(step, config.eval_every_n_steps) or (
          end_of_epoch and every(epoch + 1, config.eval_every_n_epochs)) or crossed(
              examples_before, examples, config.eval_every_n_examples)):
        run_evals(step)
      if prompts is not None and (every(step, config.sample_every_n_steps) or (
          end_of_epoch and every(epoch + 1, config.sample_every_n_epochs))):
        run_samples(step)
      due = (every(step, config.checkpoint_every_n_steps)
             or (end_of_epoch and every(epoch + 1, config.checkpoint_every_n_epochs))
             or (config.checkpoint_every_n_minutes > 0
                 and time.time() - last_checkpoint_time > 60 * config.checkpoint_every_n_minutes))
      if jax.process_count() > 1:  # every process must take part in a save: process 0's clock decides
        due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
      stopping = stop.requested()
      if due or stopping or step == total_steps:
        save_checkpoint(step, epoch_losses)
        last_checkpoint_time = time.time()
      if stopping:
        raise UserError(f"stopped by {stop.received or 'a signal to another process'} at step "
                        f"{step}: checkpoint {os.path.join(run_dir, checkpoint.STEP_PREFIX)}{step} "
                        "written; continue with --resume_from_checkpoint")
    if last_saved_step != step:  # always end with an exported LoRA
      save_lora(f"step{step}" if step % steps_per_epoch else f"epoch{step // steps_per_epoch}")
    failed = False
  finally:
    stop.restore()
    bar.close()
    metrics.close(failed)
    discard_failed_start()
  print(f"done: {step} steps in {run_dir}")
  return run_dir
