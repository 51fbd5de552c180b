"""The training step: flow-matching loss of the model with a LoRA, gradient accumulation over
micro-batches inside one jitted update."""
import jax
import jax.numpy as jnp
import optax

from diffpipe_jax import flow


EVAL_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def loss_fn(adapter, params, batch, key, *, model, config, quantile=None):
  """Flow-matching loss of one micro-batch; differentiated with respect to `adapter` only.
  With `quantile`, t is that quantile of the timestep distribution for every sample (evals)."""
  m = config.model
  latents = batch["latents"]
  k_t, k_noise, k_dropout = jax.random.split(key, 3)
  if quantile is None:
    t = flow.sample_timesteps(k_t, latents.shape[0], m.timestep_sample_method, m.sigmoid_scale)
  else:
    t = jnp.full((latents.shape[0],), flow.quantile_timesteps(quantile, m.timestep_sample_method,
                                                              m.sigmoid_scale))
  t = flow.shift_timesteps(t, m.shift, m.flux_shift, latents.shape[1])
  noise = jax.random.normal(k_noise, latents.shape, latents.dtype)
  inputs = model.family.training_inputs(model.config, batch, flow.noisy_latents(latents, noise, t),
                                        t, m.guidance)
  module = model.module.clone(lora_dropout=config.adapter.dropout if quantile is None else 0.0)
  pred = module.apply({"params": params, "lora": adapter}, **inputs, rngs={"dropout": k_dropout})
  return flow.mse(pred, noise - latents, batch.get("mask"))


def train_step(state, params, batches, key, *, tx, loss):
  """One optimizer update from a [accumulation, micro_batch, ...] stack of batches."""
  def micro(grads, batch_and_key):
    value, g = jax.value_and_grad(loss)(state["lora"], params, *batch_and_key)
    return jax.tree.map(jnp.add, grads, g), value

  n = jax.tree.leaves(batches)[0].shape[0]
  zeros = jax.tree.map(jnp.zeros_like, state["lora"])
  grads, losses = jax.lax.scan(micro, zeros, (batches, jax.random.split(key, n)))
  grads = jax.tree.map(lambda g: g / n, grads)
  updates, opt_state = tx.update(grads, state["opt_state"], state["lora"])
  new_state = dict(lora=jax.tree.map(jnp.add, state["lora"], updates), opt_state=opt_state,
                   step=state["step"] + 1)
  return new_state, dict(loss=losses.mean(), grad_norm=optax.tree.norm(grads))


def eval_losses(adapter, params, batch, key, *, model, config):
  """Losses at the fixed timestep quantiles, with noise fixed by `key` (a [Q] array)."""
  return jnp.stack([loss_fn(adapter, params, batch, key, model=model, config=config, quantile=q)
                    for q in EVAL_QUANTILES])
