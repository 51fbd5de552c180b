"""diffpipe-jax: LoRA training of diffusion transformers.

  python main.py --config configs/flux.py:tiny
  python main.py --config configs/flux.py:tiny --resume_from_checkpoint          # newest run
  python main.py --config configs/flux.py:tiny --resume_from_checkpoint=20261130_18-00-00
"""
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

from diffpipe_jax import checkpoint, data, lora, models, optim, tiny, train
from diffpipe_jax.convert import CheckpointError

config_flags.DEFINE_config_file("config", None, "configs/*.py file, optionally :variant",
                                lock_config=True)
flags.DEFINE_string("resume_from_checkpoint", None,
                    "continue a run: a run directory name under output_dir, or no value (or "
                    "'latest') for the newest")
FLAGS = flags.FLAGS


def checkpoint_path(model_config):
  """The configured checkpoint, generating the embedded tiny model on first use if asked."""
  m = model_config
  path = m.transformer_path or m.diffusers_path
  if not path:
    raise app.UsageError("set --config.model.diffusers_path or --config.model.transformer_path "
                         "(or run the embedded default: --config configs/flux.py:tiny)")
  if m.generate_tiny and not os.path.isfile(os.path.join(path, "transformer", "config.json")):
    print(f"writing the embedded tiny Flux to {path}")
    tiny.save_flux_diffusers(tiny.build_flux(), path)
  return path


def peak_device_memory_gib():
  """Peak memory of the first local device so far (None where the backend does not report it)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats["peak_bytes_in_use"] / 2**30 if stats and "peak_bytes_in_use" in stats else None


def make_dataset(config, family, model_config):
  d = config.dataset
  if d.synthetic_samples > 0:
    return data.SyntheticDataset(family, model_config, d.synthetic_samples,
                                 d.synthetic_resolution // 16, d.synthetic_text_tokens, config.seed)
  raise app.UsageError("image/video datasets (dataset.path) are not implemented yet; use "
                       "--config.dataset.synthetic_samples=N for a synthetic cached dataset")


def main(argv):
  del argv
  config = FLAGS.config
  if config is None:
    raise app.UsageError("pass --config configs/flux.py[:variant]")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

  # ---------------------------------------------------------------- run directory
  resume = FLAGS.resume_from_checkpoint
  try:
    run_dir = (checkpoint.resolve_resume(config.output_dir, resume or "latest")
               if resume is not None else checkpoint.new_run_dir(config.output_dir))
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")
  with open(os.path.join(run_dir, "config.json" if resume is None else "config_resumed.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  print(f"run directory: {run_dir}; devices: {jax.devices()}")

  # ---------------------------------------------------------------- model (frozen)
  try:
    model = models.load(config.model.type, checkpoint_path(config.model),
                        dtype=jnp.dtype(config.model.dtype),
                        transformer_dtype=config.model.transformer_dtype,
                        remat=config.activation_checkpointing)
  except CheckpointError as e:
    sys.exit(f"error: {e}")
  family, params = model.family, model.params

  # ---------------------------------------------------------------- data
  dataset = make_dataset(config, family, model.config)
  micro, accum = config.micro_batch_size_per_gpu, config.gradient_accumulation_steps
  global_batch = micro * accum
  steps_per_epoch = len(dataset) // global_batch
  if steps_per_epoch == 0:
    sys.exit(f"error: the dataset has {len(dataset)} samples, fewer than one global batch "
             f"({micro} x {accum} accumulation steps); add data or lower the batch")
  total_steps = config.epochs * steps_per_epoch
  total_steps = min(total_steps, config.max_steps) if config.max_steps else total_steps

  # ---------------------------------------------------------------- adapter and optimizer
  adapter_dtype = jnp.dtype(config.adapter.dtype)
  init_adapter = functools.partial(lora.init, params, family.LORA_TARGETS, config.adapter.rank,
                                   adapter_dtype)
  tx, lr_fn = optim.make(config, total_steps)

  def init_state(key):
    adapter = init_adapter(key)
    return dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))

  abstract_state = jax.eval_shape(init_state, jax.random.key(config.seed))
  ckpt = checkpoint.Checkpointer(run_dir, keep=config.checkpoints_to_keep)
  if resume is not None:
    state, meta = ckpt.restore(abstract_state=abstract_state)
    print(f"resumed {run_dir} at step {meta['step']} (epoch {meta['epoch']})")
  else:
    state = jax.jit(init_state)(jax.random.key(config.seed))
    if config.adapter.init_from_existing:
      state["lora"] = lora.load(config.adapter.init_from_existing, abstract_state["lora"],
                                family.STACKED, family.LORA_PREFIX)
      state["opt_state"] = tx.init(state["lora"])

  # ---------------------------------------------------------------- update step
  step_fn = jax.jit(functools.partial(
      train.train_step, tx=tx, loss=functools.partial(train.loss_fn, model=model, config=config)),
      donate_argnums=(0,))

  last_saved_step = None

  def save_lora(name):
    nonlocal last_saved_step
    last_saved_step = step
    path = lora.save(state["lora"], os.path.join(run_dir, name), family.STACKED, family.LORA_PREFIX,
                     config.adapter.rank, np.dtype(jnp.dtype(config.save_dtype)))
    print(f"saved LoRA: {path}")

  def save_checkpoint(step):
    ckpt.save(step, state, dict(step=step, epoch=step // steps_per_epoch))

  # ---------------------------------------------------------------- loop
  writer = SummaryWriter(run_dir)
  metrics_log = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # the same, machine-readable
  key = jax.random.key(config.seed + 1)
  step = int(state["step"])
  last_checkpoint_time = time.time()
  epoch_losses = []
  bar = tqdm(total=total_steps, initial=step, desc="training", unit="step", dynamic_ncols=True)
  while step < total_steps:
    epoch, index = divmod(step, steps_per_epoch)
    batch = dataset.batch(epoch, index, global_batch)
    batches = jax.tree.map(lambda x: x.reshape(accum, micro, *x.shape[1:]), batch)
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
