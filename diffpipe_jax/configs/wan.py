"""Wan 2.1 / 2.2 LoRA training (text to video; images train as one-frame videos).

  python main.py --config configs/wan.py:tiny   # embedded tiny model and clips, CPU, no downloads
  python main.py --config configs/wan.py --config.model.diffusers_path=/models/Wan2.1-T2V-1.3B-Diffusers \
      --config.dataset.path=/data/my_clips

Variants (the part after ':'): "" (bf16, rank 32) and "tiny" (a random tiny Wan pipeline
generated on first use with a small synthetic set of captioned clips and images). Key names
follow diffusion-pipe; each is declared, with its default and what it does, in
diffpipe_jax/schema.py (the shared ones) or in models/wan.py's `model_keys`.
"""
from diffpipe_jax.configs import common


def get_config(arg=""):
  common.check_variant(__file__, arg)
  c = common.base("wan")
  c.dataset.resolutions = (512,)
  c.dataset.frame_buckets = (1, 33)  # 1 + 4k frames: the VAE's temporal factor is 4
  c.sample_frames = 33
  if arg == "tiny":
    common.tiny_video(c, frame_buckets=(1, 5, 17))
  return c
