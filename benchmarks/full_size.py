"""Full-size checkpoints of random weights in the formats users download, and a dataset of real
media files, for running the whole job at full size on a GPU machine that reaches no model hub
(issue 51). It runs there (16 cores, 64 GiB of disk: write one format at a time):

  python benchmarks/full_size.py --family flux --format diffusers --out /data/FLUX.1-dev
  python benchmarks/full_size.py --family flux --format single_file --out /data/flux
  python benchmarks/full_size.py --family ltx-video --format diffusers --out /data/LTX-Video
  python benchmarks/full_size.py --family ltx-video --format single_file --out /data/ltx
  python benchmarks/full_size.py --family hunyuan-video --format comfyui --out /data/hunyuan
  python benchmarks/full_size.py --family hunyuan-video --format official --out /data/hunyuan/ckpts
  python benchmarks/full_size.py --family wan --format diffusers --out /data/Wan2.1-T2V-14B-Diffusers
  python benchmarks/full_size.py --family wan --format comfyui --out /data/wan   # + --fp8
  python benchmarks/full_size.py --family wan --format diffusers --wan 1.3b --out /data/wan/diffusers
  python benchmarks/full_size.py --dataset --out /data/media

Disk at full size (`--dry-run` lists every weight file's bytes and writes nothing):

  flux diffusers          33.7 GB  FLUX.1-dev: transformer/ (3 shards), text_encoder/ (CLIP-L),
                                   text_encoder_2/ (T5-XXL, 2 shards), vae/, tokenizers,
                                   scheduler/, model_index.json; all bf16
  flux single_file        23.8 GB  flux1-dev.safetensors (BFL's names, bf16)
  ltx-video diffusers     15.2 GB  LTX-Video 2B 0.9.1: transformer/, vae/, text_encoder/ (T5-XXL,
                                   2 shards), tokenizer/, scheduler/, model_index.json; all bf16
  ltx-video single_file    5.7 GB  ltx-video-2b-v0.9.1.safetensors (transformer + VAE, bf16)
  hunyuan-video comfyui   31.5 GB  hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors,
                                   hunyuan_video_vae_bf16.safetensors,
                                   llava-llama-3-8b-text-encoder-tokenizer/ (fp16, 4 shards),
                                   clip-vit-large-patch14/ (CLIPModel, float32)
  hunyuan-video official  44.4 GB  hunyuan-video-t2v-720p/transformers/mp_rank_00_model_states.pt
                                   (bf16), hunyuan-video-t2v-720p/vae/ (float32), text_encoder/,
                                   text_encoder_2/: diffusion-pipe's model.ckpt_path
  wan diffusers           40.2 GB  Wan2.1-T2V-14B-Diffusers: transformer/ (6 shards), text_encoder/
                                   (UMT5-XXL, 3 shards), vae/, tokenizer/, scheduler/,
                                   model_index.json; all bf16 (--wan 1.3b: 14.5 GB, the
                                   transformer one file, the same encoders)
  wan comfyui             28.6 GB  wan2.1_t2v_14B_bf16.safetensors (Wan's names; --fp8: the
                                   fp8_e4m3fn file, 14.5 GB; --wan 1.3b: 2.8 GB), the transformer
                                   alone: ComfyUI's encoder files are not read (our Wan encoders
                                   load from a diffusers folder), so the job takes it as
                                   model.transformer_path beside a `wan diffusers` folder as
                                   model.diffusers_path, the 1.3B's (the 14B's encoders, and both
                                   fit the disk: 43 GB)
  dataset                < 0.1 GB  images/ (40), videos/ (24 H.264 clips), eval/ (4), captions

The tensor lists are the real classes' (instantiated on the meta device from the released
configs below) under the released names, dtypes and shards; each file streams to disk tensor by
tensor, as consecutive slices of a pool of random values per (dtype, initial value), so that
the host holds the pools (0.3 to 1 GB) whatever the model's size and writing runs at disk speed.
Weights are drawn as the models initialise them and as `models.init_random` draws the GPU
benchmarks' weights: Linear and convolution weights N(0, 1/fan_in), norms 1, biases 0, and
embeddings N(0, 0.02^2). `--shrink` writes the same structure with small dimensions (the CPU
tests).
"""
import argparse
import collections
import concurrent.futures
import dataclasses
import io
import json
import math
import os
import pickle
import resource
import struct
import sys
import threading
import time
import zipfile
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diffpipe_jax import media, tiny  # noqa: E402
from diffpipe_jax.convert import table  # noqa: E402
from diffpipe_jax.convert.tensorfile import DTYPES  # noqa: E402
from diffpipe_jax.encoders import hunyuan_video as hunyuan_side  # noqa: E402
from diffpipe_jax.encoders import ltx_video as ltx_side  # noqa: E402
from diffpipe_jax.encoders import wan as wan_side  # noqa: E402
from diffpipe_jax.files import atomic_write  # noqa: E402
from diffpipe_jax.models import flux, hunyuan_video, ltx_video, wan  # noqa: E402
from benchmarks.train_step import WAN  # noqa: E402  (the released Wan sizes)

# ------------------------------------------------------------------------------------------------
# The released configs, as the repos' config.json files hold them.
# ------------------------------------------------------------------------------------------------

RELEASED = dict(
    # black-forest-labs/FLUX.1-dev transformer/config.json
    flux_transformer=dict(
        patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    # black-forest-labs/FLUX.1-dev vae/config.json
    flux_vae=dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024,
        scaling_factor=0.3611, shift_factor=0.1159, latents_mean=None, latents_std=None,
        force_upcast=True, use_quant_conv=False, use_post_quant_conv=False,
        mid_block_add_attention=True),
    # black-forest-labs/FLUX.1-dev text_encoder/config.json: openai/clip-vit-large-patch14's text tower
    clip_text=dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
        num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
        hidden_act="quick_gelu", layer_norm_eps=1e-5, attention_dropout=0.0, dropout=0.0,
        initializer_range=0.02, initializer_factor=1.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2),
    # black-forest-labs/FLUX.1-dev text_encoder_2/config.json (and LTX-Video's): google/t5-v1_1-xxl
    t5_xxl=dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24,
        num_heads=64, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        dropout_rate=0.1, layer_norm_epsilon=1e-6, initializer_factor=1.0,
        feed_forward_proj="gated-gelu", is_encoder_decoder=True, use_cache=True, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False, classifier_dropout=0.0),
    # Lightricks/LTX-Video (0.9.1, diffusers format) transformer/config.json
    ltx_transformer=dict(
        in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
        attention_head_dim=64, cross_attention_dim=2048, num_layers=28,
        activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
        norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096, attention_bias=True,
        attention_out_bias=True),
    # Lightricks/LTX-Video 0.9.1 vae/config.json (diffusers' scripts/convert_ltx_to_diffusers.py):
    # the timestep-conditioned decoder with noise injection and residual upsamplers
    ltx_vae=dict(
        in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(128, 256, 512, 512),
        down_block_types=("LTXVideoDownBlock3D",) * 4, decoder_block_out_channels=(256, 512, 1024),
        layers_per_block=(4, 3, 3, 3, 4), decoder_layers_per_block=(5, 6, 7, 8),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, True, True, True), downsample_type=("conv",) * 4,
        upsample_residual=(True, True, True), upsample_factor=(2, 2, 2),
        timestep_conditioning=True, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6,
        scaling_factor=1.0, encoder_causal=True, decoder_causal=False),
    # hunyuanvideo-community/HunyuanVideo transformer/config.json (Tencent's HYVideo-T/2-cfgdistill)
    hunyuan_transformer=dict(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
        num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
        patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
        pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
        image_condition_type=None),
    # hunyuanvideo-community/HunyuanVideo vae/config.json (Tencent's 884-16c-hy VAE)
    hunyuan_vae=dict(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, act_fn="silu", norm_num_groups=32, scaling_factor=0.476986,
        spatial_compression_ratio=8, temporal_compression_ratio=4, mid_block_add_attention=True),
    # Kijai/llava-llama-3-8b-text-encoder-tokenizer config.json (hunyuanvideo-community/
    # HunyuanVideo text_encoder/'s too): the language model of xtuner/llava-llama-3-8b-v1_1,
    # LLaMA-3-8B with its vocabulary grown for LLaVA's tokens and padded to 128320 rows
    llama_3_8b=dict(
        vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001),
    # openai/clip-vit-large-patch14 config.json (CLIPModel: both towers)
    clip_l=dict(
        projection_dim=768, logit_scale_init_value=2.6592,
        text_config=dict(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
            num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
            hidden_act="quick_gelu", layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
            eos_token_id=2),
        vision_config=dict(
            hidden_size=1024, intermediate_size=4096, projection_dim=768, num_hidden_layers=24,
            num_attention_heads=16, image_size=224, patch_size=14, hidden_act="quick_gelu",
            layer_norm_eps=1e-5)),
    # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (`--wan 1.3b`: the 1.3B's widths,
    # heads, MLP and depth from train_step.py's WAN)
    wan_transformer=dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
        added_kv_proj_dim=None, rope_max_seq_len=1024),
    # Wan2.1-T2V-*-Diffusers vae/config.json; its 16 latents_mean and latents_std are diffusers'
    # AutoencoderKLWan defaults (the released values)
    wan_vae=dict(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0),
    # Wan2.1-T2V-*-Diffusers text_encoder/config.json: google/umt5-xxl's encoder
    umt5_xxl=dict(
        vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24,
        num_heads=64, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        dropout_rate=0.1, layer_norm_epsilon=1e-6, initializer_factor=1.0,
        feed_forward_proj="gated-gelu", is_encoder_decoder=True, use_cache=True, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False,
        classifier_dropout=0.0, scalable_attention=True),
)

# The released files' shard size per model (what their save_pretrained was given): FLUX.1-dev's
# transformer 3 shards, T5-XXL 2, the LLaMA 4, Wan's transformer and UMT5 5 GB each (here in
# bf16: 6 and 3 shards; Wan 2.1's float32 release has 12 and 5); every other model is one file.
MAX_SHARD_SIZE = dict(flux_transformer="10GB", t5_xxl="5GB", llama_3_8b="5GB",
                      wan_transformer="5GB", umt5_xxl="5GB")
ONE_FILE = "20GB"

# --shrink: the same structure in small, odd dimensions (several blocks of each kind, odd head
# counts, widths of their own; text and pooled widths follow the shrunk encoders), and shard sizes
# that split the shrunk models into as many shards as the released ones.
SHRUNK = dict(
    flux_transformer=dict(num_layers=2, num_single_layers=3, attention_head_dim=32,
                          num_attention_heads=3, joint_attention_dim=40, pooled_projection_dim=24,
                          axes_dims_rope=(4, 14, 14)),
    flux_vae=dict(block_out_channels=(16, 24, 32, 32), layers_per_block=1, norm_num_groups=8),
    clip_text=dict(vocab_size=1000, hidden_size=24, intermediate_size=40, projection_dim=24,
                   num_hidden_layers=2, num_attention_heads=2),
    t5_xxl=dict(vocab_size=320, d_model=40, d_kv=8, d_ff=72, num_layers=2, num_decoder_layers=2,
                num_heads=5),
    ltx_transformer=dict(in_channels=16, out_channels=16, num_attention_heads=4,
                         attention_head_dim=8, cross_attention_dim=32, num_layers=3,
                         caption_channels=40),
    ltx_vae=dict(latent_channels=16, block_out_channels=(8, 16, 32, 32),
                 decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
                 decoder_layers_per_block=(1, 1, 2, 1)),
    hunyuan_transformer=dict(num_attention_heads=3, attention_head_dim=32, num_layers=2,
                             num_single_layers=3, text_embed_dim=48, pooled_projection_dim=24,
                             rope_axes_dim=(4, 14, 14)),
    hunyuan_vae=dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1),
    llama_3_8b=dict(vocab_size=1000, bos_token_id=257, eos_token_id=258,  # the tiny tokenizer's
                    hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2),
    clip_l=dict(projection_dim=20,
                text_config=dict(vocab_size=1000, hidden_size=24, intermediate_size=40, projection_dim=20,
                                 num_hidden_layers=2, num_attention_heads=2),
                vision_config=dict(hidden_size=16, intermediate_size=24, projection_dim=20,
                                   num_hidden_layers=1, num_attention_heads=2, image_size=28)),
    # the 16 latent channels kept: the VAE's 16 released latent statistics go with them
    wan_transformer=dict(num_attention_heads=3, attention_head_dim=14, text_dim=40, freq_dim=16,
                         ffn_dim=56, num_layers=3),
    wan_vae=dict(base_dim=8, dim_mult=[1, 2, 3, 3]),
    umt5_xxl=dict(vocab_size=320, d_model=40, d_kv=8, d_ff=72, num_layers=3, num_decoder_layers=3,
                  num_heads=3),
)
SHRUNK_SHARD_SIZE = dict(flux_transformer="1MB", t5_xxl="50KB", llama_3_8b="110KB",
                         wan_transformer="32KB", umt5_xxl="40KB")


def config(name: str, shrink: bool) -> dict:
  """A released config, or its shrunk variant (nested configs updated key by key)."""
  released = RELEASED[name]
  if not shrink:
    return released
  return {k: {**released[k], **v} if isinstance(v, dict) else v
          for k, v in {**released, **SHRUNK[name]}.items()}


def max_shard_size(name: str, shrink: bool) -> str:
  """The shard size save_pretrained was (or, shrunk, is) given for a model."""
  return (SHRUNK_SHARD_SIZE if shrink else MAX_SHARD_SIZE).get(name, ONE_FILE)


# ------------------------------------------------------------------------------------------------
# Tensors: name, shape, dtype and how their values are drawn.
# ------------------------------------------------------------------------------------------------

NORMAL, CONSTANT = "normal", "constant"
EMBEDDING_STD = 0.02
SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                     torch.float8_e4m3fn: "F8_E4M3"}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a file: `init` is (NORMAL, std) or (CONSTANT, value); `dtype` safetensors'."""
  name: str
  shape: Tuple[int, ...]
  dtype: str
  init: Tuple[str, float]

  @property
  def numel(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.numel * np.dtype(DTYPES[self.dtype]).itemsize


# Parameters and buffers of modules of no standard kind, by name: as the classes initialise them.
OTHER_INITS = {
    "scale_shift_table": lambda module, shape: (NORMAL, shape[-1] ** -0.5),  # LTX's randn / sqrt(dim)
    "per_channel_scale1": lambda module, shape: (CONSTANT, 0.0),  # LTX VAE's noise injection
    "per_channel_scale2": lambda module, shape: (CONSTANT, 0.0),
    "timestep_scale_multiplier": lambda module, shape: (CONSTANT, 1000.0),  # LTX VAE's decoder
    "latents_mean": lambda module, shape: (CONSTANT, 0.0),
    "latents_std": lambda module, shape: (CONSTANT, 1.0),
    "logit_scale": lambda module, shape: (CONSTANT, module.config.logit_scale_init_value),  # CLIP
    "class_embedding": lambda module, shape: (NORMAL, EMBEDDING_STD),  # CLIP's vision tower
}


def initial_value(module, name: str, shape) -> Tuple[str, float]:
  """How a parameter of `module` is drawn: Linear and convolution weights N(0, 1/fan_in) (as
  `models.init_random`), biases 0, embeddings N(0, 0.02^2), norm weights 1, the rest by name."""
  if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
    return (NORMAL, math.prod(shape[1:]) ** -0.5) if name == "weight" else (CONSTANT, 0.0)
  if isinstance(module, torch.nn.Embedding):
    return NORMAL, EMBEDDING_STD
  if "norm" in type(module).__name__.lower():  # Wan VAE's WanRMS_norm scales by `gamma`
    return CONSTANT, 1.0 if name in ("weight", "gamma") else 0.0
  if name in OTHER_INITS:
    return OTHER_INITS[name](module, shape)
  raise ValueError(f"no initial value for {type(module).__name__}.{name} {tuple(shape)}")


def model_tensors(model, keys, dtype) -> Dict[str, Tensor]:
  """The `keys` of a (meta-device) model's state dict as tensors of `dtype` (a torch dtype)."""
  owners = {}
  for prefix, module in model.named_modules(remove_duplicate=False):
    for name, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
      owners[f"{prefix}.{name}" if prefix else name] = (module, name, tuple(value.shape))
  tensors = {}
  for key in keys:
    module, name, shape = owners[key]
    tensors[key] = Tensor(key, shape, SAFETENSORS_DTYPE[dtype], initial_value(module, name, shape))
  return tensors


def fused(tensors: Dict[str, Tensor], rows) -> Dict[str, Tensor]:
  """`table.to_single_file` on tensor specs: the fused modules' tensors, each its parts' rows
  (which are drawn alike: q, k and v share a fan-in)."""
  out = {}
  for name, (parts, _) in table.single_file_parts(tensors, rows).items():
    first = tensors[parts[0]]
    assert all(tensors[p].init == first.init for p in parts), parts
    rows_total = sum(tensors[p].shape[0] for p in parts)
    out[name] = Tensor(name, (rows_total, *first.shape[1:]), first.dtype, first.init)
  return out


# ------------------------------------------------------------------------------------------------
# Random pools and streamed files.
# ------------------------------------------------------------------------------------------------

POOL_VALUES = 64 << 20  # values per pool at most: a larger tensor repeats its pool, shifted
GENERATE_CHUNK = 4 << 20  # values one thread draws at a time


class Pools:
  """One array per (dtype, init) of the given tensors, drawn on first use (by threads), as long
  as the largest of its tensors or `pool_values`; a tensor's values are consecutive slices of its
  pool from an offset its name gives, wrapping around."""

  def __init__(self, tensors, pool_values=POOL_VALUES):
    self.sizes = {}
    for t in tensors:
      key = (t.dtype, t.init)
      self.sizes[key] = min(pool_values, max(self.sizes.get(key, 0), t.numel))
    self._pools = {}
    self._locks = {key: threading.Lock() for key in self.sizes}

  @property
  def nbytes(self) -> int:
    return sum(n * np.dtype(DTYPES[dtype]).itemsize for (dtype, _), n in self.sizes.items())

  def __getitem__(self, key) -> np.ndarray:
    with self._locks[key]:
      if key not in self._pools:
        self._pools[key] = draw_pool(*key, self.sizes[key])
      return self._pools[key]


def draw_pool(dtype: str, init, size: int) -> np.ndarray:
  """`size` values of `init` cast to `dtype`; normal ones drawn in parallel chunks, each from a
  generator seeded by the key and its chunk (the same pools every run)."""
  kind, value = init
  if kind == CONSTANT:
    return np.full(size, value, DTYPES[dtype])
  pool = np.empty(size, DTYPES[dtype])
  starts = range(0, size, GENERATE_CHUNK)
  seeds = np.random.SeedSequence(zlib.crc32(repr((dtype, init)).encode())).spawn(len(starts))

  def draw(seed, start):
    values = np.random.default_rng(seed).standard_normal(min(GENERATE_CHUNK, size - start), np.float32)
    values *= value
    pool[start:start + len(values)] = values

  with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as threads:
    list(threads.map(draw, seeds, starts))
  return pool


def tensor_chunks(tensor: Tensor, pools: Pools):
  """The tensor's bytes, as memoryviews of its pool: from the offset its name gives, cyclically."""
  pool = pools[(tensor.dtype, tensor.init)]
  remaining, offset = tensor.numel, zlib.crc32(tensor.name.encode()) % len(pool)
  while remaining:
    n = min(remaining, len(pool) - offset)
    yield memoryview(pool[offset:offset + n].view(np.uint8))
    remaining, offset = remaining - n, 0


@dataclasses.dataclass(frozen=True)
class WeightFile:
  """A weight file to write under the output folder: safetensors (with string `metadata`), or a
  torch pickle (`.pt`) holding the state dict, under the key `under` if given."""
  path: str
  tensors: Tuple[Tensor, ...]
  metadata: Optional[dict] = None
  under: Optional[str] = None

  @property
  def nbytes(self) -> int:
    return sum(t.nbytes for t in self.tensors)


def safetensors_header(tensors, metadata) -> bytes:
  """The length-prefixed JSON header of `tensors` laid out in this order, padded to 8 bytes."""
  header = {"__metadata__": metadata} if metadata else {}
  start = 0
  for t in tensors:
    header[t.name] = dict(dtype=t.dtype, shape=list(t.shape), data_offsets=[start, start + t.nbytes])
    start += t.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: str, file: WeightFile, pools: Pools):
  """The header, then each tensor's bytes, in safetensors' order (wider dtypes first, by name)."""
  order = sorted(file.tensors, key=lambda t: (-np.dtype(DTYPES[t.dtype]).itemsize, t.name))

  def write(f):
    f.write(safetensors_header(order, file.metadata))
    for t in order:
      for chunk in tensor_chunks(t, pools):
        f.write(chunk)
  atomic_write(path, write)


# torch.save's zip format: `archive/data.pkl` (the pickled object, tensors as persistent ids of
# their storages), `archive/byteorder`, one `archive/data/<key>` record per storage with its data
# 64-byte aligned (torch pads the local header's extra field, as here), `archive/version`.
TORCH_STORAGES = {"BF16": "BFloat16Storage", "F16": "HalfStorage", "F32": "FloatStorage"}
TORCH_ALIGNMENT = 64
ZIP64_EXTRA = 20  # the zip64 field of a local header written with force_zip64
PADDING_FIELD = 0x4246  # "FB", the extra field id torch pads with


class _Storage:
  def __init__(self, key: str, tensor: Tensor):
    self.key, self.tensor = key, tensor


class _TensorReference:
  """Pickles as torch.save pickles a contiguous tensor of `storage`."""

  def __init__(self, storage: _Storage):
    self.storage = storage

  def __reduce_ex__(self, protocol):
    shape = self.storage.tensor.shape
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return torch._utils._rebuild_tensor_v2, (self.storage, 0, shape, strides, False,
                                             collections.OrderedDict())


def torch_pickle(state) -> bytes:
  """`state` as torch.save's data.pkl: protocol 2, storages as persistent ids."""
  class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
      if isinstance(obj, _Storage):
        return ("storage", getattr(torch, TORCH_STORAGES[obj.tensor.dtype]), obj.key, "cpu",
                obj.tensor.numel)
      return None
  buffer = io.BytesIO()
  Pickler(buffer, protocol=2).dump(state)
  return buffer.getvalue()


def aligned_record(name: str, size: int, offset: int) -> zipfile.ZipInfo:
  """A stored zip entry whose data, its local header starting at `offset`, starts 64-aligned."""
  info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
  info.file_size = size
  header = 30 + len(name.encode()) + ZIP64_EXTRA + 4  # fixed part, name, zip64 field, our field
  pad = -(offset + header) % TORCH_ALIGNMENT
  info.extra = struct.pack("<HH", PADDING_FIELD, pad) + b"\0" * pad
  return info


def write_torch(path: str, file: WeightFile, pools: Pools):
  """torch.save's zip format written a tensor at a time (torch.save needs them all in memory);
  `torch.load(..., weights_only=True)` reads it, memory-mapped or not."""
  storages = [_Storage(str(i), t) for i, t in enumerate(file.tensors)]
  state = collections.OrderedDict((s.tensor.name, _TensorReference(s)) for s in storages)
  data_pkl = torch_pickle({file.under: state} if file.under else state)

  def write(f):
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
      archive.writestr("archive/data.pkl", data_pkl)
      archive.writestr("archive/byteorder", sys.byteorder)
      for s in storages:
        info = aligned_record(f"archive/data/{s.key}", s.tensor.nbytes, f.tell())
        with archive.open(info, "w", force_zip64=True) as record:
          for chunk in tensor_chunks(s.tensor, pools):
            record.write(chunk)
      archive.writestr("archive/version", "3\n")
  atomic_write(path, write)


def write_weight_file(out: str, file: WeightFile, pools: Pools) -> float:
  """Writes one weight file under `out`; returns the seconds it took."""
  start = time.perf_counter()
  path = os.path.join(out, file.path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  (write_torch if path.endswith(".pt") else write_safetensors)(path, file, pools)
  return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------
# Components and formats.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
  """What a format writes: weight files, and small files (configs, indexes, tokenizers) as
  (path under the output folder, write(full path))."""
  weights: List[WeightFile] = dataclasses.field(default_factory=list)
  small: List[Tuple[str, Callable[[str], None]]] = dataclasses.field(default_factory=list)

  def __add__(self, other: "Plan") -> "Plan":
    return Plan(self.weights + other.weights, self.small + other.small)


def diffusers_model(class_name: str, cfg: dict):
  """A diffusers model on the meta device: its state dict's names and shapes, no memory."""
  import diffusers
  with torch.device("meta"):
    return getattr(diffusers, class_name)(**cfg)


def transformers_model(class_name: str, config_name: str, cfg: dict):
  """A transformers model on the meta device, of its config class built from `cfg`."""
  import transformers
  model_config = getattr(transformers, config_name)(**cfg)
  with torch.device("meta"):
    return getattr(transformers, class_name)(model_config)


def write_text(text: str):
  def write(path):
    with open(path, "w") as f:
      f.write(text)
  return write


def in_folder(save: Callable[[str], None]):
  """A writer of a file that a library saves by folder (save_config, save_pretrained)."""
  return lambda path: save(os.path.dirname(path))


def sharded(folder: str, tensors: Dict[str, Tensor], weights_name: str, shard_size: str,
            index_metadata: dict) -> Plan:
  """The files save_pretrained writes for `tensors` (in state-dict order): one, or shards and
  their index, split as huggingface_hub splits them for diffusers and transformers."""
  from huggingface_hub import split_state_dict_into_shards_factory
  split = split_state_dict_into_shards_factory(
      tensors, get_storage_size=lambda t: t.nbytes, max_shard_size=shard_size,
      filename_pattern=weights_name.replace(".safetensors", "{suffix}.safetensors"))
  plan = Plan([WeightFile(f"{folder}/{name}", tuple(tensors[k] for k in keys), {"format": "pt"})
               for name, keys in split.filename_to_tensors.items()])
  if split.is_sharded:
    index = {"metadata": {**index_metadata, **split.metadata}, "weight_map": split.tensor_to_filename}
    plan.small.append((f"{folder}/{weights_name}.index.json",
                       write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")))
  return plan


def diffusers_folder(folder: str, model, dtype, shard_size: str) -> Plan:
  """A diffusers model's folder as its save_pretrained writes it: config.json, safetensors."""
  tensors = model_tensors(model, model.state_dict().keys(), dtype)
  plan = sharded(folder, tensors, "diffusion_pytorch_model.safetensors", shard_size, {})
  plan.small.append((f"{folder}/config.json", in_folder(model.save_config)))
  return plan


def transformers_folder(folder: str, model, dtype, shard_size: str) -> Plan:
  """A transformers model's folder as its save_pretrained writes it: the tied duplicates left
  out (T5's encoder.embed_tokens), config.json with the dtype and architecture it records, the
  generation config of a generative model, the index's parameter count."""
  from transformers.modeling_utils import remove_tied_weights_from_state_dict
  keys = remove_tied_weights_from_state_dict(model.state_dict(), model).keys()
  plan = sharded(folder, model_tensors(model, keys, dtype), "model.safetensors", shard_size,
                 {"total_parameters": model.num_parameters()})
  model.config.dtype = str(dtype).split(".")[1]
  model.config.architectures = [type(model).__name__]
  plan.small.append((f"{folder}/config.json", in_folder(model.config.save_pretrained)))
  if model.can_generate():
    plan.small.append((f"{folder}/generation_config.json",
                       in_folder(model.generation_config.save_pretrained)))
  return plan


def tokenizer_files(folder: str, tokenizer) -> Plan:
  """A working tokenizer without the released vocabulary (none can be downloaded): the tiny
  ones, whose ids fit every released vocabulary."""
  return Plan([], [(f"{folder}/tokenizer_config.json", in_folder(tokenizer.save_pretrained))])


def pipeline_folder(pipeline: str, components: dict, dtype, shard_sizes: Dict[str, str]) -> Plan:
  """A diffusers pipeline folder: each component in its subfolder, and model_index.json as the
  pipeline's save_pretrained writes it (`shard_sizes`: component -> max shard size)."""
  import diffusers
  from diffusers import ModelMixin, SchedulerMixin
  from transformers import PreTrainedModel
  plan = Plan()
  for name, component in components.items():
    if isinstance(component, ModelMixin):
      plan += diffusers_folder(name, component, dtype, shard_sizes[name])
    elif isinstance(component, PreTrainedModel):
      plan += transformers_folder(name, component, dtype, shard_sizes[name])
    elif isinstance(component, SchedulerMixin):
      plan.small.append((f"{name}/scheduler_config.json", in_folder(component.save_config)))
    else:
      plan += tokenizer_files(name, component)
  index = getattr(diffusers, pipeline)(**components)
  plan.small.append(("model_index.json", in_folder(index.save_config)))
  return plan


def scheduler(settings: dict):
  """The released scheduler (the settings our sampler takes too): the class that `_class_name`
  names, FlowMatchEulerDiscreteScheduler where none."""
  import diffusers
  settings = dict(settings)
  return getattr(diffusers, settings.pop("_class_name", "FlowMatchEulerDiscreteScheduler"))(**settings)


def t5_xxl(shrink):
  return transformers_model("T5EncoderModel", "T5Config", config("t5_xxl", shrink))


def flux_diffusers(shrink: bool) -> Plan:
  """black-forest-labs/FLUX.1-dev as downloaded (every component bf16)."""
  components = dict(
      scheduler=scheduler(flux.DEV_SCHEDULER),
      vae=diffusers_model("AutoencoderKL", config("flux_vae", shrink)),
      text_encoder=transformers_model("CLIPTextModel", "CLIPTextConfig", config("clip_text", shrink)),
      tokenizer=tiny.clip_tokenizer(),
      text_encoder_2=t5_xxl(shrink),
      tokenizer_2=tiny.t5_tokenizer(),
      transformer=diffusers_model("FluxTransformer2DModel", config("flux_transformer", shrink)))
  shards = dict(transformer=max_shard_size("flux_transformer", shrink),
                text_encoder_2=max_shard_size("t5_xxl", shrink), vae=ONE_FILE, text_encoder=ONE_FILE)
  return pipeline_folder("FluxPipeline", components, torch.bfloat16, shards)


def flux_single_file(shrink: bool) -> Plan:
  """Black Forest Labs' flux1-dev.safetensors: the transformer under BFL's names (our reversible
  table's), bf16."""
  model = diffusers_model("FluxTransformer2DModel", config("flux_transformer", shrink))
  tensors = fused(model_tensors(model, model.state_dict().keys(), torch.bfloat16),
                  flux.SINGLE_FILE_TABLE)
  return Plan([WeightFile("flux1-dev.safetensors", tuple(tensors.values()))])


def ltx_models(shrink: bool):
  return (diffusers_model("LTXVideoTransformer3DModel", config("ltx_transformer", shrink)),
          diffusers_model("AutoencoderKLLTXVideo", config("ltx_vae", shrink)))


def ltx_diffusers(shrink: bool) -> Plan:
  """LTX-Video 2B 0.9.1 in the diffusers format (every component bf16)."""
  transformer, vae = ltx_models(shrink)
  released = ltx_video.SAMPLING.scheduler(ltx_video.LTXVideoConfig())
  components = dict(scheduler=scheduler(released), vae=vae, text_encoder=t5_xxl(shrink),
                    tokenizer=tiny.t5_tokenizer(), transformer=transformer)
  shards = dict(transformer=ONE_FILE, vae=ONE_FILE, text_encoder=max_shard_size("t5_xxl", shrink))
  return pipeline_folder("LTXPipeline", components, torch.bfloat16, shards)


def ltx_single_file(shrink: bool) -> Plan:
  """Lightricks' ltx-video-2b-v0.9.1.safetensors: the transformer (`model.diffusion_model.` +
  Lightricks' names) and the VAE (`vae.` + its names, with all its statistics) in bf16, and the
  config in the metadata, as our loader and diffusers' single-file loader read it."""
  transformer, vae = ltx_models(shrink)
  dtype = torch.bfloat16
  tensors = [dataclasses.replace(t, name=ltx_side.PREFIX + ltx_side.lightricks_transformer_key(t.name))
             for t in model_tensors(transformer, transformer.state_dict().keys(), dtype).values()]
  tensors += [dataclasses.replace(t, name=ltx_side.lightricks_vae_key(t.name))
              for t in model_tensors(vae, vae.state_dict().keys(), dtype).values()]
  channels = (vae.config.latent_channels,)
  tensors += [Tensor(key, channels, SAFETENSORS_DTYPE[dtype], (CONSTANT, 1.0))
              for key in ltx_side.VAE_EXTRA_STATISTICS]
  metadata = {"config": json.dumps(ltx_side.lightricks_config(transformer, vae))}
  return Plan([WeightFile("ltx-video-2b-v0.9.1.safetensors", tuple(tensors), metadata)])


def original_transformer(model, family, block_linear_dtype=torch.bfloat16) -> Dict[str, Tensor]:
  """A diffusers transformer under the family's own names (its `DIFFUSERS_TABLE`), bf16 but for
  the blocks' Linear weights (the float8 targets of our loader), which are `block_linear_dtype`."""
  tensors = fused(model_tensors(model, model.state_dict().keys(), torch.bfloat16), family.DIFFUSERS_TABLE)
  block_linear = lambda t: (len(t.shape) == 2 and t.name.endswith(".weight") and table.matches(
      t.name[:-len(".weight")], family.FAMILY.float8_targets))
  dtype = SAFETENSORS_DTYPE[block_linear_dtype]
  return {k: dataclasses.replace(t, dtype=dtype) if block_linear(t) else t for k, t in tensors.items()}


def tencent_transformer(shrink: bool, block_linear_dtype) -> Dict[str, Tensor]:
  """HunyuanVideo's transformer under Tencent's names (our table's)."""
  model = diffusers_model("HunyuanVideoTransformer3DModel", config("hunyuan_transformer", shrink))
  return original_transformer(model, hunyuan_video, block_linear_dtype)


def hunyuan_vae(shrink: bool):
  return diffusers_model("AutoencoderKLHunyuanVideo", config("hunyuan_vae", shrink))


def llama_folder(folder: str, shrink: bool) -> Plan:
  """The LLaVA's LLaMA-3-8B language model (LlamaForCausalLM) with its tokenizer: float16 (as
  Tencent's extraction script saves it), 4 shards."""
  model = transformers_model("LlamaForCausalLM", "LlamaConfig", config("llama_3_8b", shrink))
  return (transformers_folder(folder, model, torch.float16, max_shard_size("llama_3_8b", shrink))
          + tokenizer_files(folder, tiny.llama_tokenizer()))


def clip_folder(folder: str, shrink: bool) -> Plan:
  """openai/clip-vit-large-patch14 as downloaded: the whole CLIPModel, float32, one file."""
  model = transformers_model("CLIPModel", "CLIPConfig", config("clip_l", shrink))
  return (transformers_folder(folder, model, torch.float32, ONE_FILE)
          + tokenizer_files(folder, tiny.clip_tokenizer()))


def hunyuan_comfyui(shrink: bool) -> Plan:
  """The files diffusion-pipe's HunyuanVideo example names: Kijai's float8 transformer
  (transformer_path), the bf16 VAE (vae_path; the names Tencent's and diffusers' VAE share),
  the LLaMA folder (llm_path) and CLIP-L's (clip_path)."""
  transformer = tencent_transformer(shrink, torch.float8_e4m3fn)
  vae = hunyuan_vae(shrink)
  vae_tensors = model_tensors(vae, vae.state_dict().keys(), torch.bfloat16)
  return (Plan([WeightFile("hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors",
                           tuple(transformer.values())),
                WeightFile("hunyuan_video_vae_bf16.safetensors", tuple(vae_tensors.values()))])
          + llama_folder("llava-llama-3-8b-text-encoder-tokenizer", shrink)
          + clip_folder("clip-vit-large-patch14", shrink))


def hunyuan_official(shrink: bool) -> Plan:
  """Tencent's ckpts folder (diffusion-pipe's model.ckpt_path): the transformer's
  mp_rank_00_model_states.pt ({"module": state dict}, bf16), the VAE's pytorch_model.pt
  (float32) and config.json, the LLaMA in text_encoder/ and CLIP-L in text_encoder_2/."""
  transformer = tencent_transformer(shrink, torch.bfloat16)
  vae = hunyuan_vae(shrink)
  vae_tensors = model_tensors(vae, vae.state_dict().keys(), torch.float32)
  vae_config = json.dumps(hunyuan_side.tencent_vae_config(vae.config), indent=2)
  return (Plan([WeightFile(hunyuan_side.OFFICIAL_TRANSFORMER, tuple(transformer.values()),
                           under="module"),
                WeightFile(f"{hunyuan_side.OFFICIAL_VAE}/{hunyuan_side.OFFICIAL_VAE_WEIGHTS}",
                           tuple(vae_tensors.values()))],
               [(f"{hunyuan_side.OFFICIAL_VAE}/config.json", write_text(vae_config))])
          + llama_folder("text_encoder", shrink) + clip_folder("text_encoder_2", shrink))


def wan_transformer(shrink: bool, size: str):
  """Wan 2.1 T2V's transformer: the 14B's config, or the 1.3B's sizes (`size`, train_step.py's
  `WAN`)."""
  dim, heads, ffn, layers, _, _ = WAN[size]
  sized = dict(num_attention_heads=heads, attention_head_dim=dim // heads, ffn_dim=ffn, num_layers=layers)
  return diffusers_model("WanTransformer3DModel", {**config("wan_transformer", shrink),
                                                   **({} if shrink else sized)})


def wan_diffusers(shrink: bool, size: str = "14b") -> Plan:
  """Wan-AI/Wan2.1-T2V-14B-Diffusers (or -1.3B-) as WanPipeline's save_pretrained writes it, bf16
  (the Hub's 2.1 folders are float32: this halves the 14B's, so that it fits the GPU machine's
  disk) in 5 GB shards as theirs; the released UniPC scheduler."""
  components = dict(
      scheduler=scheduler(wan.RELEASED_SCHEDULER),
      vae=diffusers_model("AutoencoderKLWan", config("wan_vae", shrink)),
      text_encoder=transformers_model("UMT5EncoderModel", "UMT5Config", config("umt5_xxl", shrink)),
      tokenizer=tiny.t5_tokenizer(),
      transformer=wan_transformer(shrink, size))
  shards = dict(transformer=max_shard_size("wan_transformer", shrink), vae=ONE_FILE,
                text_encoder=max_shard_size("umt5_xxl", shrink))
  return pipeline_folder("WanPipeline", components, torch.bfloat16, shards)


def wan_comfyui_name(size: str = "14b", float8: bool = False) -> str:
  """Comfy-Org's repackaged file of Wan 2.1 T2V's transformer."""
  return f"wan2.1_t2v_{size.upper()}_{'fp8_e4m3fn' if float8 else 'bf16'}.safetensors"


def wan_comfyui(shrink: bool, size: str = "14b", float8: bool = False) -> Plan:
  """ComfyUI's transformer file (model.transformer_path) under Wan's original names, bf16, or
  with `float8` as its fp8_e4m3fn file (the blocks' Linear weights). A shrunk head size other
  than the released 128 is said in the metadata, as the tiny files say it."""
  model = wan_transformer(shrink, size)
  tensors = original_transformer(model, wan, torch.float8_e4m3fn if float8 else torch.bfloat16)
  return Plan([WeightFile(wan_comfyui_name(size, float8), tuple(tensors.values()),
                          wan_side.comfyui_metadata(model.config))])


FORMATS = {
    "flux": dict(diffusers=flux_diffusers, single_file=flux_single_file),
    "ltx-video": dict(diffusers=ltx_diffusers, single_file=ltx_single_file),
    "hunyuan-video": dict(comfyui=hunyuan_comfyui, official=hunyuan_official),
    "wan": dict(diffusers=wan_diffusers, comfyui=wan_comfyui),  # --wan, --fp8: their options
}


def write_plan(plan: Plan, out: str, workers: int = 4, pool_values: int = POOL_VALUES) -> int:
  """Writes the small files, then the weight files (`workers` at a time), printing each; returns
  the bytes of weights written."""
  for path, write in plan.small:
    full = os.path.join(out, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    write(full)
  pools = Pools([t for f in plan.weights for t in f.tensors], pool_values)
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(workers) as threads:
    jobs = {threads.submit(write_weight_file, out, f, pools): f for f in plan.weights}
    for job in concurrent.futures.as_completed(jobs):
      file, seconds = jobs[job], job.result()
      print(f"  {file.path}: {file.nbytes / 1e9:.3f} GB in {seconds:.1f} s", flush=True)
  seconds = time.perf_counter() - start
  total = sum(f.nbytes for f in plan.weights)
  print(f"{total / 1e9:.2f} GB of weights in {seconds:.1f} s ({total / 1e9 / seconds:.2f} GB/s), "
        f"{len(plan.small)} small files; random pools {pools.nbytes / 1e9:.2f} GB, "
        f"peak RSS {peak_rss_bytes() / 1e9:.2f} GB")
  return total


def print_plan(plan: Plan, pool_values: int = POOL_VALUES):
  for f in plan.weights:
    print(f"  {f.path}: {f.nbytes:,} bytes ({len(f.tensors)} tensors)")
  pools = Pools([t for f in plan.weights for t in f.tensors], pool_values)
  print(f"{sum(f.nbytes for f in plan.weights) / 1e9:.2f} GB of weights in {len(plan.weights)} "
        f"files; small files: {', '.join(path for path, _ in plan.small)}; random pools "
        f"{pools.nbytes / 1e9:.2f} GB")


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ------------------------------------------------------------------------------------------------
# The dataset: real image and video files with captions.
# ------------------------------------------------------------------------------------------------

# Mixed aspect ratios near 1024 x 1024 pixels (width, height), as people's training images are.
IMAGE_SIZES = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768),
               (768, 1344), (1088, 960))
# Clips (width, height, fps) at the video models' usual sizes and rates, and their durations (s).
CLIP_FORMATS = ((768, 512, 24), (960, 544, 25), (960, 544, 24), (768, 512, 25))
CLIP_SECONDS = (2, 3, 4, 5, 6, 2.5, 3.5, 4.5)
IMAGE_COUNT, CLIP_COUNT, EVAL_COUNT = 40, 24, 4
SHRINK_SIDE = 8  # --shrink divides every side by this (to even sides: yuv420p needs them)
SHRINK_COUNTS = (8, 3, 2)  # images (a png and a webp among them), clips, eval images

COLOURS = dict(red=(220, 40, 40), green=(40, 170, 70), blue=(40, 80, 220), yellow=(230, 210, 50),
               orange=(240, 140, 30), purple=(140, 60, 180), white=(240, 240, 240),
               teal=(30, 160, 160))
DETAILS = (
    "The background blends smoothly from one colour to the other with soft diagonal waves, and a "
    "fine grain of noise covers the whole frame like film grain under studio light.",
    "Every shape has crisp edges and a flat, even colour, with no shadow and no outline, and the "
    "composition leaves generous empty space around each of them.",
    "The lighting is even and neutral, the colours are saturated but not harsh, and nothing in "
    "the frame is blurred, so that the edges stay sharp from corner to corner.",
    "It looks like a minimalist poster or an abstract screensaver from an old computer, simple "
    "geometric forms arranged loosely over a calm gradient backdrop.")


@dataclasses.dataclass(frozen=True)
class Media:
  """One file of the dataset: an image (frames 1) or a clip, and what its caption says."""
  path: str  # under the output folder, with its extension
  width: int
  height: int
  seed: int
  frames: int = 1
  fps: int = 0

  @property
  def seconds(self) -> float:
    return self.frames / self.fps if self.fps else 0.0


def dataset_media(shrink: bool) -> List[Media]:
  """Every file of the dataset: images (jpg, a png and a webp in every eight) in images/, clips in
  videos/, a few images in eval/."""
  side = (lambda n: n // SHRINK_SIDE // 2 * 2) if shrink else (lambda n: n)
  images, clips, evals = SHRINK_COUNTS if shrink else (IMAGE_COUNT, CLIP_COUNT, EVAL_COUNT)
  extension = lambda i: "png" if i % 8 == 3 else "webp" if i % 8 == 6 else "jpg"
  out = []
  for i in range(images):
    w, h = IMAGE_SIZES[i % len(IMAGE_SIZES)]
    out.append(Media(f"images/{i:03d}.{extension(i)}", side(w), side(h), seed=i))
  for i in range(clips):
    w, h, fps = CLIP_FORMATS[i % len(CLIP_FORMATS)]
    seconds = CLIP_SECONDS[i % len(CLIP_SECONDS)] / (4 if shrink else 1)
    out.append(Media(f"videos/clip{i:03d}.mp4", side(w), side(h), seed=1000 + i,
                     frames=round(seconds * fps), fps=fps))
  for i in range(evals):
    w, h = IMAGE_SIZES[(i * 3) % len(IMAGE_SIZES)]
    out.append(Media(f"eval/{i:03d}.jpg", side(w), side(h), seed=2000 + i))
  return out


def scene(item: Media):
  """The scene of a file: two colours for the background and shapes (kind, colour name, centre
  and size as fractions of the frame, velocity in frames per second)."""
  rng = np.random.default_rng(item.seed)
  names = list(COLOURS)
  background = tuple(rng.choice(names, 2, replace=False))
  shapes = [(rng.choice(("circle", "square", "ring")), rng.choice(names), rng.uniform(0.15, 0.85, 2),
             rng.uniform(0.06, 0.2), rng.uniform(-0.08, 0.08, 2)) for _ in range(rng.integers(1, 4))]
  return background, shapes


def render(item: Media, frame: int) -> np.ndarray:
  """Frame `frame` of the file (uint8 [H, W, 3]): a smooth two-colour gradient with waves, its
  shapes (moving, in a clip) and grain."""
  (first, second), shapes = scene(item)
  h, w = item.height, item.width
  y, x = np.mgrid[0:h, 0:w].astype(np.float32) / max(w, h)
  t = frame / item.fps if item.fps else 0.0
  mix = np.clip(0.5 * (x + y) + 0.1 * np.sin(9 * x - 2 * t) * np.cos(7 * y + t), 0, 1)[..., None]
  pixels = (1 - mix) * np.array(COLOURS[first], np.float32) + mix * np.array(COLOURS[second], np.float32)
  for kind, colour, centre, size, velocity in shapes:
    cx, cy = (centre + velocity * t) * (w / max(w, h), h / max(w, h))
    dx, dy = x - cx, y - cy
    if kind == "square":
      inside = (np.abs(dx) < size) & (np.abs(dy) < size)
    else:
      r = np.hypot(dx, dy)
      inside = (r < size) & ((r > 0.6 * size) if kind == "ring" else True)
    pixels[inside] = COLOURS[colour]
  grain = np.random.default_rng((item.seed, frame)).integers(-4, 5, pixels.shape, np.int16)
  return np.clip(pixels + grain, 0, 255).astype(np.uint8)


def caption(item: Media) -> str:
  """What the file shows, short, medium or long (long ones pass CLIP's 77 tokens)."""
  (first, second), shapes = scene(item)
  things = [f"a {colour} {kind}" for kind, colour, *_ in shapes]
  listed = things[0] if len(things) == 1 else ", ".join(things[:-1]) + " and " + things[-1]
  motion = " drifting slowly across the frame" if item.fps else ""
  text = f"{listed}{motion} over a {first} to {second} gradient"
  length = item.seed % 3
  if length == 0:
    return text
  if length == 1:
    return f"An abstract picture of {text}, with fine grain."
  return f"An abstract picture of {text}. " + " ".join(DETAILS[:2 + item.seed // 3 % 3])


def write_media(out: str, item: Media) -> int:
  """Writes one file and its same-stem caption; returns its bytes."""
  from PIL import Image
  path = os.path.join(out, item.path)
  if item.fps:
    media.write_video(path, np.stack([render(item, k) for k in range(item.frames)]), item.fps)
  else:
    Image.fromarray(render(item, 0)).save(path, quality=92)
  with open(os.path.splitext(path)[0] + ".txt", "w") as f:
    f.write(caption(item))
  return os.path.getsize(path)


def write_dataset(out: str, shrink: bool = False, workers: Optional[int] = None) -> List[Media]:
  """Writes every file of `dataset_media` (clips first, in `workers` processes forked from this
  one, or here if 1: a process whose JAX runtime has started must not fork); returns them."""
  items = dataset_media(shrink)
  for folder in sorted({os.path.dirname(i.path) for i in items}):
    os.makedirs(os.path.join(out, folder), exist_ok=True)
  start = time.perf_counter()
  ordered = sorted(items, key=lambda i: -i.frames * i.width * i.height)
  outs = [out] * len(ordered)
  if workers == 1:
    sizes = list(map(write_media, outs, ordered))
  else:
    with concurrent.futures.ProcessPoolExecutor(workers or os.cpu_count()) as processes:
      sizes = list(processes.map(write_media, outs, ordered))
  clips = sum(1 for i in items if i.fps)
  print(f"{len(items) - clips} images and {clips} clips with captions, {sum(sizes) / 1e6:.1f} MB "
        f"in {time.perf_counter() - start:.1f} s")
  return items


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--family", choices=sorted(FORMATS))
  parser.add_argument("--format", help="diffusers or single_file (flux, ltx-video); "
                                       "comfyui or official (hunyuan-video); diffusers or comfyui (wan)")
  parser.add_argument("--wan", choices=("1.3b", "14b"), help="wan: the transformer's size (14b)")
  parser.add_argument("--fp8", action="store_true", help="wan comfyui: the fp8_e4m3fn file")
  parser.add_argument("--dataset", action="store_true", help="write the media dataset instead")
  parser.add_argument("--out", required=True, help="the folder to write into")
  parser.add_argument("--dry-run", action="store_true", help="list the weight files and their "
                                                             "bytes; write nothing")
  parser.add_argument("--shrink", action="store_true", help="small dimensions (CPU tests)")
  parser.add_argument("--workers", type=int, default=4, help="weight files written at once")
  args = parser.parse_args(argv)
  if args.dataset:
    if args.dry_run:
      for item in dataset_media(args.shrink):
        print(f"  {item.path}: {item.width}x{item.height}" +
              (f", {item.frames} frames at {item.fps} fps" if item.fps else ""))
    else:
      write_dataset(args.out, args.shrink)
    return
  formats = FORMATS.get(args.family, {})
  if args.format not in formats:
    parser.error(f"--family {args.family} takes --format {' or '.join(formats) or '(a family first)'}")
  if (args.wan and args.family != "wan") or (args.fp8 and (args.family, args.format) != ("wan", "comfyui")):
    parser.error("--wan is for --family wan, --fp8 for its --format comfyui")
  options = dict(size=args.wan or "14b") if args.family == "wan" else {}
  if args.fp8:
    options["float8"] = True
  plan = formats[args.format](args.shrink, **options)
  print(f"{args.family} {args.format}{' (shrunk)' if args.shrink else ''} -> {args.out}")
  if args.dry_run:
    print_plan(plan)
  else:
    write_plan(plan, args.out, args.workers)


if __name__ == "__main__":
  main()
