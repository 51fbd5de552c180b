"""The flow-matching training objective that every family shares.

x_t = (1 - t) x_0 + t * noise, the model predicts the velocity noise - x_0, loss = fp32 MSE.
Timesteps follow diffusion-pipe's options: logit-normal or uniform, then an optional shift (a
family may shift by resolution instead: `Family.shift_timesteps`).
"""
import jax
import jax.numpy as jnp

TIMESTEP_METHODS = ("logit_normal", "uniform")


def shift_timesteps(t, shift=1.0):
  """t' = s t / (1 + (s - 1) t)."""
  return shift * t / (1 + (shift - 1) * t)


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


def mse(pred, target, mask=None):
  """fp32 mean squared error; with a [B, L] token mask, normalised by the mask's mean."""
  err = jnp.square(pred.astype(jnp.float32) - target.astype(jnp.float32)).mean(-1)
  if mask is None:
    return err.mean()
  return (err * mask).mean() / jnp.maximum(mask.mean(), 1e-8)
