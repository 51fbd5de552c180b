"""The flow-matching training objective that every family shares.

x_t = (1 - t) x_0 + t * noise, the model predicts the velocity noise - x_0; the loss is fp32 MSE,
or Huber or smooth L1 (`pointwise_loss`). Timesteps follow diffusion-pipe's options: logit-normal
or uniform, mapped into [min_t, max_t], then an optional shift (a family may shift by resolution
instead: `Family.shift_timesteps`).
"""
import functools

import jax
import jax.numpy as jnp

TIMESTEP_METHODS = ("logit_normal", "uniform")


def shift_timesteps(t, shift=1.0):
  """t' = s t / (1 + (s - 1) t)."""
  return shift * t / (1 + (shift - 1) * t)


def shift_by_config(model_config, t, latents=None):
  """`model.shift` at every resolution: the `Family.shift_timesteps` of a family whose shift
  does not follow the latents."""
  return shift_timesteps(t, model_config.shift)


def exponential_shift(t, mu):
  """t' = e^mu / (e^mu + 1/t - 1): the shift of diffusers' pipelines with dynamic shifting."""
  e_mu = jnp.exp(mu)
  return e_mu / (e_mu + 1 / t - 1)


def quantile_timesteps(q, method="logit_normal", sigmoid_scale=1.0):
  """The inverse CDF of the (unshifted) timestep distribution: fixed t for evaluation."""
  assert method in TIMESTEP_METHODS, method
  if method == "logit_normal":
    return jax.nn.sigmoid(jax.scipy.special.ndtri(q) * sigmoid_scale)
  return q


def sample_timesteps(key, batch, method="logit_normal", sigmoid_scale=1.0):
  """Unshifted training timesteps: the quantile function at uniform draws (see shift_timesteps)."""
  u = jax.random.uniform(key, (batch,), minval=1e-6, maxval=1 - 1e-6)
  return quantile_timesteps(u, method, sigmoid_scale)


def noisy_latents(latents, noise, t):
  t = t.reshape(-1, *[1] * (latents.ndim - 1)).astype(latents.dtype)
  return (1 - t) * latents + t * noise


def huber(err, delta):
  """torch.nn.functional.huber_loss per element: quadratic below `delta`, linear above."""
  magnitude = jnp.abs(err)
  return jnp.where(magnitude < delta, 0.5 * jnp.square(err), delta * (magnitude - 0.5 * delta))


def smooth_l1(err, beta):
  """torch.nn.functional.smooth_l1_loss per element: Huber with delta `beta`, divided by it."""
  return huber(err, beta) / beta


def pointwise_loss(huber_delta=0.0, smooth_l1_beta=0.0):
  """The loss of each element's error (the config's `huber_delta`, `smooth_l1_beta`): Huber or
  smooth L1 when its parameter is > 0 (at most one is), else the square."""
  if huber_delta > 0:
    return functools.partial(huber, delta=huber_delta)
  if smooth_l1_beta > 0:
    return functools.partial(smooth_l1, beta=smooth_l1_beta)
  return jnp.square


def loss(pred, target, mask=None, pointwise=jnp.square):
  """fp32 `pointwise` loss of the error, averaged over its last axis (packed latents' channels),
  then over the rest: with a mask of that shape ([B, L] tokens) or one that broadcasts to it,
  the masked mean normalised by the mask's mean."""
  err = pointwise(pred.astype(jnp.float32) - target.astype(jnp.float32)).mean(-1)
  if mask is None:
    return err.mean()
  return (err * mask).mean() / jnp.maximum(mask.mean(), 1e-8)
