"""FLUX.1 LoRA training.

  python main.py --config configs/flux.py:tiny     # embedded tiny model and data, CPU, no downloads
  python main.py --config configs/flux.py:tiny --cache_only   # cache latents and text, then exit
  python main.py --config configs/flux.py --config.model.diffusers_path=/models/FLUX.1-dev \
      --config.dataset.path=/data/my_images

Variants (the part after ':'): "" (FLUX.1-dev, bf16, rank 32) and "tiny" (a random tiny Flux
generated on first use with a small synthetic captioned image set). Key names follow
diffusion-pipe; each is declared, with its default and what it does, in diffpipe_jax/schema.py
(the shared ones) or in models/flux.py's `model_keys`.
"""
from diffpipe_jax.configs import common


def get_config(arg=""):
  common.check_variant(__file__, arg)
  c = common.base("flux")
  if arg == "tiny":
    common.tiny(c)
  return c
