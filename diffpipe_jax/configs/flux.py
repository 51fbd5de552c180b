"""FLUX.1 LoRA training.

  python main.py --config configs/flux.py:tiny     # embedded tiny model and data, CPU, no downloads
  python main.py --config configs/flux.py:tiny --cache_only   # cache latents and text, then exit
  python main.py --config configs/flux.py --config.model.diffusers_path=/models/FLUX.1-dev \
      --config.dataset.path=/data/my_images

Variants (the part after ':'): "" (FLUX.1-dev, bf16, rank 32) and "tiny" (a random tiny Flux
generated on first use with a small synthetic captioned image set). Key names follow
diffusion-pipe; the shared ones are in configs/common.py.
"""
from diffpipe_jax.configs import common


def get_config(arg=""):
  common.check_variant(__file__, arg)
  c = common.base("flux")
  c.model.diffusers_path = ""  # a diffusers pipeline folder (holds transformer/, vae/, text encoders)
  c.model.transformer_path = ""  # or a BFL single file (flux1-dev.safetensors); wins if set
  c.model.flux_shift = False  # FluxPipeline's resolution-dependent shift instead of model.shift
  c.model.guidance = 1.0  # the guidance embedding's input in training (FLUX.1-dev)
  if arg == "tiny":
    common.tiny(c)
  return c
