"""LoRA training of any model family: `run(config)` is the whole job, what the training command
calls after its flags: `prepare` (the config checked, the data cached, the mesh, the model, the
state and its step) makes a `loop.Run`, and `loop.loop` trains it."""
import contextlib
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from diffpipe_jax import (axes, checkpoint, data, device_memory, errors, lora, loop, media, models,
                          optim, runtime, sampling, sequence, sharding, tiny, validate)
from diffpipe_jax import family as family_lib, metrics as metrics_lib
from diffpipe_jax.errors import UserError
from diffpipe_jax.training_step import init_state, make_step

COMPILATION_CACHE_BYTES = 16 * 2**30  # beyond this, the least recently used programs go


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


def encode_sample_prompts(config, family, encoders, size):
  """The sample prompts at the sample `size` (frames, height, width), encoded once (kept in
  output_dir/.sample_prompts/, beside the runs, for the next run, a resume and the other
  processes)."""
  return sampling.encode_prompts(family, encoders, sampling.prompt_lines(config.sample_prompts), *size,
                                 cache_dir=os.path.join(config.output_dir, ".sample_prompts"),
                                 images=config.sample_images, negative=config.sample_negative_prompt)


def split_cost(split, balanced) -> str:
  """What a manual `partition_split` plan costs beside the balanced one: a JAX array's shards
  have one size, so every stage stores as many layers of a stack as its fullest stage holds."""
  return (f"partition_split: each stage stores {split.layers_stored()} layers (padding included) "
          f"and idles {split.bubble():.0%} of the step; without partition_split the stages are "
          f"balanced: {balanced.layers_stored()} layers, {balanced.bubble():.0%} idle. Unlike "
          "DeepSpeed's, no split gives one GPU fewer weights than another")


def schedule(dataset) -> str:
  return (f"global batches {sorted(set(map(dataset.batch_size, dataset.groups)))}; "
          f"{dataset.steps_per_epoch} steps an epoch")


def from_process_0(text: str) -> str:
  """Process 0's string on every process (a multi-host run agrees on names this way)."""
  if jax.process_count() == 1:
    return text
  buf = np.zeros(1024, np.uint8)
  buf[:len(text.encode())] = np.frombuffer(text.encode(), np.uint8)
  return bytes(multihost_utils.broadcast_one_to_all(buf)).rstrip(b"\0").decode()


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


def check_unfinished(run_dir: str, meta: dict, config):
  """Refuses to resume a run whose checkpoint is at or past its planned steps, its LoRA exported
  there (it would train nothing), naming the limits it reached and what extends it. max_steps
  only stops a run early, as in diffusion-pipe: more epochs extend one (and a max_steps that
  stopped it, raised); a decaying learning rate schedule is then stretched over the new total
  (it is a function of the total, not saved state)."""
  step, per_epoch = meta["step"], meta["steps_per_epoch"]
  exports = [f"step{step}"] + ([f"epoch{step // per_epoch}"] if step % per_epoch == 0 else [])
  if step < loop.planned_steps(config, per_epoch) or not any(
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
      prepared = prepare(config, on_exit, resume, cache_only, regenerate_cache)
      return prepared and loop.loop(prepared)
  except Exception as e:
    if errors.out_of_memory(e) and not isinstance(e, UserError):
      raise UserError(out_of_memory_advice(config)) from e
    raise


def prepare(config, on_exit: contextlib.ExitStack, resume=None, cache_only=False,
            regenerate_cache=False) -> loop.Run | None:
  """Everything before the first step: the config checked, the datasets cached, the mesh, the
  frozen model placed on it, the training state (new or restored) and the step; None with
  `cache_only`. `on_exit` holds what must be released when the run ends (its directory's lock,
  the sequence-parallel context)."""
  use_compilation_cache(config.compilation_cache_dir)
  family = family_lib.get(config.model.type)
  validate.check(config, family)  # every value, before anything is written or loaded
  metrics_lib.check_wandb(config)
  memory = device_memory.Sharing(config.max_device_memory_gib)  # before JAX's backend starts
  is_main_process = jax.process_index() == 0  # the one that writes logs and exports

  # ---------------------------------------------------------------- mesh
  mesh = sharding.make_mesh(config.pipeline_stages, sequence_parallel=config.sequence_parallel)
  data_parallel = mesh.shape[axes.DATA]
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
  # the samples' size checked before the hours of caching, not after
  size = (sampling.checked_size(encoders, *sampling.size(config, encoders.pixel_multiple))
          if sampling_on(config) else None)
  if size:
    sampling.check_first_frames(encoders, len(sampling.prompt_lines(config.sample_prompts)),
                                config.sample_images)
  cached = prompts = None
  if is_main_process:
    cached = cache_datasets(config, family, encoders, regenerate_cache)
    prompts = encode_sample_prompts(config, family, encoders, size) if size else None
    encoders.release()
  memory.training()  # from here JAX's pool, and PyTorch the rest (samples' decoding)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("datasets cached")
    path = path or tiny.checkpoint_path(config, family)
    cached = cached or cache_datasets(config, family, encoders, regenerate_cache, build=False)
    if size and prompts is None:
      prompts = encode_sample_prompts(config, family, encoders, size)  # process 0's, read back
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
  total_steps = loop.planned_steps(config, steps_per_epoch)

  # ---------------------------------------------------------------- model (frozen), on the mesh
  block_stacks = family.stacks(models.checkpoint_config(family.type, path))
  placement = sharding.make_placement(mesh, block_stacks, accum, config.blocks_to_swap,
                                      runtime.unrolled_for(config),
                                      partition_split=config.partition_split,
                                      layers_around_stacks=family.layers_around_stacks)
  if placement.plan is not None:
    print(placement.plan.describe())
  if config.partition_split:
    print(split_cost(placement.plan, sharding.make_placement(mesh, block_stacks, accum).plan))
  if placement.swap:
    print("frozen weights in pinned host memory: " + ", ".join(
        f"{n} of the {name}, spread evenly" for name, n in placement.swap))
  model = models.load(family.type, path, dtype=jnp.dtype(config.model.dtype),
                      transformer_dtype=config.model.transformer_dtype,
                      runtime=runtime.Runtime.of(placement, config.activation_checkpointing),
                      placement=placement)

  # ---------------------------------------------------------------- adapter and optimizer
  # The state is created, checkpointed and exported in the stacked form, and trained in the
  # placement's (per pipeline stage, per layer): `placement.create` and `to_layers` convert, in jit.
  tx, lr_fn = optim.make(config, total_steps)
  make_state = functools.partial(init_state, layer_params=models.abstract_params(
      family, model.module, model.config), config=config, tx=tx, family=family)
  layer_state = jax.eval_shape(make_state, jax.random.key(config.seed))
  replicated = sharding.tree_shardings(mesh, layer_state)
  to_layers = jax.jit(placement.to_layers, out_shardings=replicated)  # checkpoints
  lora_to_layers = jax.jit(placement.to_layers, out_shardings=replicated["lora"])  # exports
  if resume is not None:
    check_resumable(run_dir, ckpt, config, layer_state)
    state, meta = ckpt.restore(abstract_state=jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layer_state, replicated))
    state = placement.create(lambda s: s, state)
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
    state = placement.create(make_state, jax.random.key(config.seed), existing)
    run_dir = from_process_0(checkpoint.new_run_dir(config.output_dir) if is_main_process else "")
    if is_main_process:
      on_exit.enter_context(checkpoint.lock_run_dir(run_dir))
    ckpt = checkpoint.Checkpointer(run_dir, keep=config.checkpoints_to_keep)
  if is_main_process:
    with open(os.path.join(run_dir, "config.json" if resume is None else "config_resumed.json"), "w") as f:
      f.write(metrics_lib.public_config(config).to_json_best_effort(indent=2))  # no API key
  print(f"run directory: {run_dir}; mesh {dict(mesh.shape)} over {len(jax.devices())} devices; "
        f"{schedule(dataset)}")

  return loop.Run(config=config, family=family, mesh=mesh, placement=placement, run_dir=run_dir,
                  resumed=resume is not None, is_main_process=is_main_process, dataset=dataset,
                  evals=evals, prompts=prompts, encoders=encoders, model=model, state=state,
                  step_fn=make_step(model, config, tx, placement), lr_fn=lr_fn, checkpointer=ckpt,
                  to_layers=to_layers, lora_to_layers=lora_to_layers, epoch_losses=epoch_losses)
