"""HunyuanVideo LoRA training (text to video; images train as one-frame videos).

  python main.py --config configs/hunyuan_video.py:tiny   # embedded tiny model and clips, CPU
  python main.py --config configs/hunyuan_video.py --config.model.ckpt_path=/models/hunyuan/ckpts \
      --config.dataset.path=/data/my_clips
  python main.py --config configs/hunyuan_video.py \
      --config.model.transformer_path=/models/hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors \
      --config.model.transformer_dtype=float8 --config.model.vae_path=... \
      --config.model.llm_path=... --config.model.clip_path=... --config.blocks_to_swap=40  # 24 GB

Variants (the part after ':'): "" (bf16, rank 32) and "tiny" (a random tiny HunyuanVideo
pipeline generated on first use, in diffusers' and Tencent's formats, with a small synthetic
set of captioned clips and images). Key names follow diffusion-pipe; each is declared, with its
default and what it does, in diffpipe_jax/schema.py (the shared ones) or in
models/hunyuan_video.py's `model_keys`. Speed and memory per setting: BENCHMARKS.md#hunyuan.
"""
from diffpipe_jax.configs import common


def get_config(arg=""):
  common.check_variant(__file__, arg)
  c = common.base("hunyuan-video")
  c.dataset.resolutions = (512,)
  c.dataset.frame_buckets = (1, 33)  # 1 + 4k frames: the VAE's temporal factor is 4
  c.sample_frames = 33
  if arg == "tiny":
    # at 24 fps and sides of 16 the tiny clips and images fill three buckets of four (64x64x17,
    # 80x48x5, 80x48x1): 3 steps an epoch, as the other families' tiny runs
    common.tiny_video(c, frame_buckets=(1, 5, 17))
  return c
