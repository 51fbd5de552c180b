"""Wan 2.1 / 2.2 LoRA training (text to video; images train as one-frame videos).

  python main.py --config configs/wan.py:tiny   # embedded tiny model and clips, CPU, no downloads
  python main.py --config configs/wan.py --config.model.diffusers_path=/models/Wan2.1-T2V-1.3B-Diffusers \
      --config.dataset.path=/data/my_clips

Variants (the part after ':'): "" (bf16, rank 32), "tiny" (a random tiny Wan 2.1 T2V pipeline
generated on first use with a small synthetic set of captioned clips and images), "tiny_i2v"
(the same as a 2.1 I2V pipeline: each clip's first frame through the input channels and CLIP;
samples from first frames, `sample_images`)
and "tiny_ti2v" (a 2.2 TI2V 5B pipeline, half its clips given their first frame clean). Key names
follow diffusion-pipe; each is declared, with its default and what it does, in
diffpipe_jax/schema.py (the shared ones) or in models/wan.py's `model_keys`.
"""
from diffpipe_jax import tiny
from diffpipe_jax.configs import common

TINY_KINDS = {"tiny_i2v": "i2v", "tiny_ti2v": "ti2v"}  # variants of the tiny I2V and TI2V pipelines


def get_config(arg=""):
  common.check_variant(__file__, arg, own=TINY_KINDS)
  c = common.base("wan")
  c.dataset.resolutions = (512,)
  c.dataset.frame_buckets = (1, 33)  # 1 + 4k frames: the VAE's temporal factor is 4
  c.sample_frames = 33
  if arg.startswith("tiny"):
    common.tiny_video(c, frame_buckets=(1, 5, 17))
  if arg in TINY_KINDS:
    c.model.diffusers_path = tiny.pipeline_dir("wan", TINY_KINDS[arg])
  if arg == "tiny_i2v":  # the samples start from two of the tiny eval set's images
    c.sample_images = tuple(f"{tiny.EVAL_IMAGES}/{i:03d}.png" for i in range(len(c.sample_prompts)))
  if arg == "tiny_ti2v":
    c.model.first_frame_conditioning_p = 0.5
  return c
