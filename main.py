"""diffpipe-jax: LoRA training of diffusion transformers.

  python main.py --config configs/flux.py:tiny
  python main.py --config configs/flux.py:tiny --resume_from_checkpoint          # newest run
  python main.py --config configs/flux.py:tiny --resume_from_checkpoint=20261130_18-00-00
  python main.py --config configs/flux.py:tiny --cache_only [--regenerate_cache]
"""
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tensorboardX import SummaryWriter
from tqdm.auto import tqdm

from diffpipe_jax import cache, checkpoint, data, lora, media, models, optim, sharding, tiny, train
from diffpipe_jax.convert import CheckpointError

config_flags.DEFINE_config_file("config", None, "configs/*.py file, optionally :variant",
                                lock_config=True)
flags.DEFINE_string("resume_from_checkpoint", None,
                    "continue a run: a run directory name under output_dir, or no value (or "
                    "'latest') for the newest")
flags.DEFINE_bool("cache_only", False, "cache latents and text embeddings, then exit")
flags.DEFINE_bool("regenerate_cache", False, "rebuild the caches from scratch")
FLAGS = flags.FLAGS


def prepare_paths(config):
  """The configured checkpoint path; the tiny variant writes its pipeline and images on first use."""
  m = config.model
  path = m.transformer_path or m.diffusers_path
  if not path:
    raise app.UsageError("set --config.model.diffusers_path or --config.model.transformer_path "
                         "(or run the embedded default: --config configs/flux.py:tiny)")
  if config.generate_tiny:
    if not os.path.isfile(os.path.join(m.diffusers_path, "model_index.json")):
      print(f"writing the embedded tiny Flux pipeline to {m.diffusers_path}")
      tiny.save_flux_pipeline(m.diffusers_path)
    for folder, sizes in [(config.dataset.path, None)] + [
        (e.path, ((40, 40),)) for e in config.eval_datasets.values()]:
      if not os.path.isdir(folder):
        print(f"writing the embedded tiny image set to {folder}")
        tiny.write_image_dataset(folder, **({"sizes": sizes, "num_images": 4} if sizes else {}))
  return path


def cache_datasets(config, regenerate):
  """Caches the training and eval datasets (PyTorch encoders, released afterwards)."""
  if not config.model.diffusers_path:
    raise app.UsageError("caching needs model.diffusers_path for the VAE and text encoders")
  encoders = cache.ENCODERS[config.model.type].load(config.model.diffusers_path)
  train_settings = data.dataset_settings(config.dataset)
  eval_settings = {name: dataclasses.replace(train_settings, directories=(
      media.DirectorySettings(path=e.path),)) for name, e in config.eval_datasets.items()}
  cached = {name: data.cache_dataset(s, config.model.type, encoders, encoders.pixel_multiple,
                                     config.caching_batch_size, regenerate)
            for name, s in {"train": train_settings, **eval_settings}.items()}
  encoders.release()
  return cached


def peak_device_memory_gib():
  """Peak memory of the first local device so far (None where the backend does not report it)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats["peak_bytes_in_use"] / 2**30 if stats and "peak_bytes_in_use" in stats else None


def main(argv):
  del argv
  config = FLAGS.config
  if config is None:
    raise app.UsageError("pass --config configs/flux.py[:variant]")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

  # ---------------------------------------------------------------- mesh
  try:
    mesh = sharding.make_mesh(config.pipeline_stages)
  except ValueError as e:
    sys.exit(f"error: {e}")
  data_parallel = mesh.shape["data"]

  # ---------------------------------------------------------------- data (cached once)
  family = models.family(config.model.type)
  try:
    path = prepare_paths(config)
    cached = cache_datasets(config, FLAGS.regenerate_cache)
    micro, accum = config.micro_batch_size_per_gpu * data_parallel, config.gradient_accumulation_steps
    global_batch = micro * accum
    dataset = data.Batches(cached.pop("train"), global_batch, config.seed, family.position_ids)
    evals = {name: data.Batches(dirs, micro, config.seed, family.position_ids, name)
             for name, dirs in cached.items()}
  except (ValueError, media.MediaError) as e:
    sys.exit(f"error: {e}")
  if FLAGS.cache_only:
    print("cached; exiting (--cache_only)")
    return
  steps_per_epoch = dataset.steps_per_epoch
  total_steps = config.epochs * steps_per_epoch
  total_steps = min(total_steps, config.max_steps) if config.max_steps else total_steps

  # ---------------------------------------------------------------- run directory
  resume = FLAGS.resume_from_checkpoint
  try:
    run_dir = (checkpoint.resolve_resume(config.output_dir, resume or "latest")
               if resume is not None else checkpoint.new_run_dir(config.output_dir))
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")
  with open(os.path.join(run_dir, "config.json" if resume is None else "config_resumed.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  print(f"run directory: {run_dir}; mesh {dict(mesh.shape)} over {len(jax.devices())} devices; "
        f"global batch {global_batch}; {steps_per_epoch} steps an epoch")

  # ---------------------------------------------------------------- model (frozen)
  try:
    model = models.load(config.model.type, path, dtype=jnp.dtype(config.model.dtype),
                        transformer_dtype=config.model.transformer_dtype,
                        remat=config.activation_checkpointing,
                        put=lambda x: jax.device_put(x, sharding.NamedSharding(mesh, sharding.P())))
  except CheckpointError as e:
    sys.exit(f"error: {e}")
  params = model.params

  # ---------------------------------------------------------------- adapter and optimizer
  adapter_dtype = jnp.dtype(config.adapter.dtype)
  init_adapter = functools.partial(lora.init, params, family.LORA_TARGETS, config.adapter.rank,
                                   adapter_dtype)
  tx, lr_fn = optim.make(config, total_steps)

  def init_state(key):
    adapter = init_adapter(key)
    return dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))

  abstract_state = jax.eval_shape(init_state, jax.random.key(config.seed))
  state_shardings = sharding.tree_shardings(mesh, abstract_state)
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract_state, state_shardings)
  ckpt = checkpoint.Checkpointer(run_dir, keep=config.checkpoints_to_keep)
  if resume is not None:
    state, meta = ckpt.restore(abstract_state=abstract_state)
    if meta.get("steps_per_epoch", steps_per_epoch) != steps_per_epoch:
      sys.exit(f"error: {run_dir} was trained with {meta['steps_per_epoch']} steps an epoch, the "
               f"data now gives {steps_per_epoch}: the dataset or batch settings changed, so the "
               "run cannot continue where it stopped; start a new run")
    print(f"resumed {run_dir} at step {meta['step']} (epoch {meta['epoch']})")
  else:
    state = jax.jit(init_state, out_shardings=state_shardings)(jax.random.key(config.seed))
    if config.adapter.init_from_existing:
      state["lora"] = jax.device_put(lora.load(config.adapter.init_from_existing, abstract_state["lora"],
                                               family.STACKED, family.LORA_PREFIX), state_shardings["lora"])
      state["opt_state"] = jax.jit(tx.init, out_shardings=state_shardings["opt_state"])(state["lora"])

  # ---------------------------------------------------------------- update step
  step_fn = jax.jit(functools.partial(
      train.train_step, tx=tx, loss=functools.partial(train.loss_fn, model=model, config=config)),
      donate_argnums=(0,))
  eval_fn = jax.jit(functools.partial(train.eval_losses, model=model, config=config))

  def run_evals(step):
    """Each eval set's loss at the fixed t quantiles, with the same noise every time."""
    for name, ev in evals.items():
      batches = ev.iterate(0, 0, jax.process_index(), jax.process_count())
      losses = np.mean([eval_fn(state["lora"], params, sharding.global_batch(mesh, batch, batch_axis=0),
                                jax.random.key(i)) for i, batch in enumerate(batches)], axis=0)
      for q, value in zip(train.EVAL_QUANTILES, losses):
        writer.add_scalar(f"{name}/loss_quantile_{q:.2f}", value, step)
      writer.add_scalar(f"{name}/loss", losses.mean(), step)
      print(f"eval {name} at step {step}: loss {losses.mean():.4f}")

  last_saved_step = None

  def save_lora(name):
    nonlocal last_saved_step
    last_saved_step = step
    path = lora.save(state["lora"], os.path.join(run_dir, name), family.STACKED, family.LORA_PREFIX,
                     config.adapter.rank, np.dtype(jnp.dtype(config.save_dtype)))
    print(f"saved LoRA: {path}")

  def save_checkpoint(step):
    epoch, batch_index = divmod(step, steps_per_epoch)  # where the data continues from
    ckpt.save(step, state, dict(step=step, epoch=epoch, batch_index=batch_index,
                                steps_per_epoch=steps_per_epoch))

  # ---------------------------------------------------------------- loop
  writer = SummaryWriter(run_dir)
  metrics_log = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # the same, machine-readable
  key = jax.random.key(config.seed + 1)
  step = int(state["step"])
  last_checkpoint_time = time.time()
  epoch_losses = []
  if evals and config.eval_before_first_step and step == 0:
    run_evals(0)
  bar = tqdm(total=total_steps, initial=step, desc="training", unit="step", dynamic_ncols=True)
  batch_iter, iter_epoch = None, None
  while step < total_steps:
    epoch, index = divmod(step, steps_per_epoch)
    if iter_epoch != epoch:  # a new epoch, or a resumed run: the schedule continues exactly
      batch_iter, iter_epoch = dataset.iterate(epoch, index, jax.process_index(), jax.process_count()), epoch
    batch = next(batch_iter)
    batches = sharding.global_batch(mesh, jax.tree.map(
        lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch))
    state, metrics = step_fn(state, params, batches, jax.random.fold_in(key, step))
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
      sys.exit(f"error: non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step + 1}; "
               f"stopping. The last good checkpoint in {run_dir} is kept: lower optimizer.lr "
               "or check the data, then --resume_from_checkpoint")
    step += 1
    lr = float(lr_fn(step - 1))
    epoch_losses.append(loss)
    writer.add_scalar("train/loss", loss, step)
    writer.add_scalar("train/lr", lr, step)
    writer.add_scalar("train/grad_norm", grad_norm, step)
    metrics_log.write(json.dumps(dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm)) + "\n")
    metrics_log.flush()
    peak_gib = peak_device_memory_gib()
    if peak_gib is not None:
      writer.add_scalar("train/peak_memory_gib", peak_gib, step)
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", epoch=epoch + 1,
                    **({"peak_mem": f"{peak_gib:.1f}G"} if peak_gib is not None else {}))
    bar.update(1)

    end_of_epoch = step % steps_per_epoch == 0
    if end_of_epoch:
      writer.add_scalar("train/epoch_loss", float(np.mean(epoch_losses)), epoch + 1)
      epoch_losses = []
      if config.save_every_n_epochs and (epoch + 1) % config.save_every_n_epochs == 0:
        save_lora(f"epoch{epoch + 1}")
    if config.save_every_n_steps and step % config.save_every_n_steps == 0:
      save_lora(f"step{step}")
    if evals and ((config.eval_every_n_steps and step % config.eval_every_n_steps == 0) or (
        end_of_epoch and config.eval_every_n_epochs and (epoch + 1) % config.eval_every_n_epochs == 0)):
      run_evals(step)
    due = (config.checkpoint_every_n_steps and step % config.checkpoint_every_n_steps == 0) or (
        time.time() - last_checkpoint_time > 60 * config.checkpoint_every_n_minutes)
    if due or step == total_steps:
      save_checkpoint(step)
      last_checkpoint_time = time.time()
  bar.close()
  writer.close()
  metrics_log.close()
  if last_saved_step != step:  # always end with an exported LoRA
    save_lora(f"step{step}" if step % steps_per_epoch else f"epoch{step // steps_per_epoch}")
  print(f"done: {step} steps in {run_dir}")


def bare_resume_means_latest(argv):
  """`--resume_from_checkpoint` given without a value (as in diffusion-pipe) means the newest run."""
  flag = "--resume_from_checkpoint"
  return [f"{flag}=latest" if a == flag else a for a in argv]


if __name__ == "__main__":
  app.run(main, argv=bare_resume_means_latest(sys.argv))
