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
  grid = config.resolution // 16  # VAE /8, then 2x2 packing
  inputs = model.family.random_inputs(model.config, 1, grid, grid, config.text_tokens, config.seed)
  t0 = time.perf_counter()
  out = jax.block_until_ready(model(**inputs))
  print(f"forward (with compile): {time.perf_counter() - t0:.2f}s, output {out.shape} {out.dtype}")
  t0 = time.perf_counter()
  out = jax.block_until_ready(model(**inputs))
  print(f"forward: {(time.perf_counter() - t0) * 1e3:.1f}ms, output std {float(out.std()):.4f}, "
        f"finite: {bool(jnp.isfinite(out).all())}")


if __name__ == "__main__":
  app.run(main)
