"""The flow-matching objective: the losses diffusion-pipe's `huber_delta` and `smooth_l1_beta`
pick (torch's definitions), and the timestep range `model.min_t` / `model.max_t`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import family_config
from diffpipe_jax import flow, lora, training_step


def config(**overrides):
  c = family_config("flux")
  c.update_from_flattened_dict(overrides)
  return c


@pytest.mark.parametrize("options, torch_loss", [
    (dict(), lambda p, t: torch.nn.functional.mse_loss(p, t, reduction="none")),
    (dict(huber_delta=0.5), lambda p, t: torch.nn.functional.huber_loss(p, t, reduction="none", delta=0.5)),
    (dict(smooth_l1_beta=0.3),
     lambda p, t: torch.nn.functional.smooth_l1_loss(p, t, reduction="none", beta=0.3)),
], ids=["mse", "huber", "smooth_l1"])
def test_the_loss_is_torchs_with_and_without_a_mask(options, torch_loss):
  rng = np.random.default_rng(0)
  pred, target = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)  # errors on both sides of delta
  mask = (rng.uniform(size=(2, 6)) < 0.6).astype(np.float32)
  per_token = torch_loss(torch.from_numpy(pred), torch.from_numpy(target)).numpy().mean(-1)
  loss = lambda *mask: float(flow.loss(pred, target, *mask, pointwise=flow.pointwise_loss(**options)))
  np.testing.assert_allclose(loss(), per_token.mean(), rtol=1e-6)
  np.testing.assert_allclose(loss(mask), (per_token * mask).sum() / mask.sum(), rtol=1e-6)
  assert loss(mask) != pytest.approx(loss())  # the mask matters


def test_the_config_picks_the_loss_of_training_and_evals(flux):
  """A Huber delta or smooth L1 beta far above every error leaves the square's halves: 1/2 of
  the MSE and 1/(2 beta) of it."""
  fam = flux.family
  adapter = lora.init(flux.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  batch = fam.random_batch(flux.config, 2, seed=3)
  loss = lambda quantile=None, **options: float(training_step.loss_fn(
      adapter, flux.params, batch, jax.random.key(1), model=flux, config=config(**options), quantile=quantile))
  mse, eval_mse = loss(), loss(0.3)  # training's, an eval's
  np.testing.assert_allclose(loss(huber_delta=1e3), 0.5 * mse, rtol=1e-6)
  np.testing.assert_allclose(loss(0.3, smooth_l1_beta=1e3), 0.5e-3 * eval_mse, rtol=1e-6)
  assert loss(huber_delta=0.1) < 0.5 * mse  # the linear part, where errors exceed delta


def timesteps(model, key, quantile=None, **overrides):
  """The training (or an eval quantile's) timesteps of a batch of 512, as the model gets them."""
  batch = model.family.random_batch(model.config, 512, height=1, width=1, txt_len=1)
  inputs, *_ = training_step.model_inputs(batch, key, model=model, config=config(**overrides), quantile=quantile)
  return np.asarray(inputs["timestep"])


def test_timesteps_are_drawn_in_min_t_max_t_before_the_shift(flux):
  key = jax.random.key(4)
  today = np.asarray(flow.sample_timesteps(jax.random.split(key, 4)[0], 512))  # t before the range
  np.testing.assert_array_equal(timesteps(flux, key), today)  # the defaults change nothing
  ranged = timesteps(flux, key, **{"model.min_t": 0.2, "model.max_t": 0.4})
  assert ranged.min() >= 0.2 and ranged.max() <= 0.4 and ranged.max() - ranged.min() > 0.15
  np.testing.assert_allclose(ranged, 0.2 + 0.2 * today, rtol=1e-6)
  # the shift applies to the ranged t: s t / (1 + (s - 1) t)
  t = 0.2 + 0.2 * float(flow.quantile_timesteps(0.7))
  shifted = timesteps(flux, key, 0.7, **{"model.min_t": 0.2, "model.max_t": 0.4, "model.shift": 3.0})
  np.testing.assert_allclose(shifted, 3 * t / (1 + 2 * t), rtol=1e-6)
