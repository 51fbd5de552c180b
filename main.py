"""diffpipe-jax entry point.

  python main.py --config configs/flux.py:tiny

Until LoRA training lands (issue 3) this is a model smoke run: it loads the configured
transformer (generating the embedded tiny one on first use), runs one forward pass on random
latents of the configured size, and reports load time, compile time and forward time.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from diffpipe_jax import models, tiny
from diffpipe_jax.convert import CheckpointError

config_flags.DEFINE_config_file("config", None, "configs/*.py file, optionally :variant",
                                lock_config=True)
FLAGS = flags.FLAGS


def checkpoint_path(model_config):
  """The configured checkpoint, generating the embedded tiny model on first use if asked."""
  m = model_config
  path = m.transformer_path or m.diffusers_path
  if not path:
    raise app.UsageError("set --config.model.diffusers_path or --config.model.transformer_path "
                         "(or run the embedded default: --config configs/flux.py:tiny)")
  if m.generate_tiny and not os.path.isfile(os.path.join(path, "transformer", "config.json")):
    logging.info("writing the embedded tiny Flux to %s", path)
    tiny.save_flux_diffusers(tiny.build_flux(), path)
  return path


def random_inputs(cfg, resolution, text_tokens, seed):
  """Packed latents of a `resolution`^2 image (VAE /8, 2x2 packing) and random text states."""
  h = w = resolution // 16
  rng = np.random.default_rng(seed)
  ids = np.zeros((h, w, 3), np.float32)
  ids[..., 1], ids[..., 2] = np.arange(h)[:, None], np.arange(w)[None, :]
  return dict(
      hidden_states=rng.standard_normal((1, h * w, cfg.in_channels), np.float32),
      encoder_hidden_states=rng.standard_normal((1, text_tokens, cfg.joint_attention_dim), np.float32),
      pooled_projections=rng.standard_normal((1, cfg.pooled_projection_dim), np.float32),
      timestep=np.array([0.5], np.float32), img_ids=ids.reshape(-1, 3),
      txt_ids=np.zeros((text_tokens, 3), np.float32),
      guidance=np.array([1.0], np.float32) if cfg.guidance_embeds else None)


def main(argv):
  del argv
  config = FLAGS.config
  if config is None:
    raise app.UsageError("pass --config configs/flux.py[:variant]")
  path = checkpoint_path(config.model)
  print(f"devices: {jax.devices()}")
  t0 = time.perf_counter()
  try:
    model = models.load(config.model.type, path, dtype=jnp.dtype(config.model.dtype))
  except CheckpointError as e:
    sys.exit(f"error: {e}")
  jax.block_until_ready(model.params)
  n_params = sum(x.size for x in jax.tree.leaves(model.params))
  print(f"loaded {config.model.type} ({n_params / 1e6:.1f}M parameters) from {path} "
        f"in {time.perf_counter() - t0:.1f}s")
  inputs = random_inputs(model.config, config.resolution, config.text_tokens, config.seed)
  t0 = time.perf_counter()
  out = jax.block_until_ready(model(**inputs))
  print(f"forward (with compile): {time.perf_counter() - t0:.2f}s, output {out.shape} {out.dtype}")
  t0 = time.perf_counter()
  out = jax.block_until_ready(model(**inputs))
  print(f"forward: {(time.perf_counter() - t0) * 1e3:.1f}ms, output std {float(out.std()):.4f}, "
        f"finite: {bool(jnp.isfinite(out).all())}")


if __name__ == "__main__":
  app.run(main)
