"""LTX-Video LoRA training (text to video; images train as one-frame videos).

  python main.py --config configs/ltx_video.py:tiny   # embedded tiny model and clips, CPU, no downloads
  python main.py --config configs/ltx_video.py --config.model.diffusers_path=/models/LTX-Video \
      --config.dataset.path=/data/my_clips
  python main.py --config configs/ltx_video.py \
      --config.model.diffusers_path=/models/LTX-Video \
      --config.model.single_file_path=/models/ltx-video-2b-v0.9.1.safetensors ...

Variants (the part after ':'): "" (bf16, rank 32) and "tiny" (a random tiny LTX-Video pipeline
generated on first use with a small synthetic set of captioned clips and images). Key names
follow diffusion-pipe; each is declared, with its default and what it does, in
diffpipe_jax/schema.py (the shared ones) or in models/ltx_video.py's `model_keys`.
"""
from diffpipe_jax.configs import common


def get_config(arg=""):
  common.check_variant(__file__, arg)
  c = common.base("ltx-video")
  c.dataset.resolutions = (512,)
  c.dataset.frame_buckets = (1, 33, 65)  # 1 + 8k frames: the VAE's temporal factor is 8
  c.sample_frames = 33
  if arg == "tiny":
    common.tiny_video(c, frame_buckets=(1, 9, 17))
    c.model.first_frame_conditioning_p = 0.5
  return c
