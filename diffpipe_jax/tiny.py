"""Tiny random models built with the real diffusers classes and saved in the real on-disk layouts,
for tests and for the embedded default run (no weights can be downloaded).

Every weight is random, norms and the final modulation included, so that a conversion which
drops, transposes or swaps anything shows up as a mismatch.
"""
import os

import numpy as np

from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import write_atomic

# Smallest Flux that still has every structural feature: several blocks of each kind, a head
# size (32) whose RoPE axes derive as in FLUX.1 (4, 14, 14), text and pooled widths of their own.
TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3,
                 attention_head_dim=32, num_attention_heads=2, joint_attention_dim=24,
                 pooled_projection_dim=20, guidance_embeds=True, axes_dims_rope=(4, 14, 14))


def build_flux(seed=0, **overrides):
  """A random diffusers `FluxTransformer2DModel` (float32, eval mode)."""
  import torch
  from diffusers import FluxTransformer2DModel
  torch.manual_seed(seed)
  model = FluxTransformer2DModel(**{**TINY_FLUX, **overrides}).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():  # torch's init leaves norms at 1: randomise them too
      if p.ndim == 2:
        p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
      else:
        p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
  return model


def state_dict_numpy(model):
  return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def save_flux_diffusers(model, root, max_shard_size=None):
  """Writes `root/transformer/` (config.json + safetensors, sharded with an index if asked)."""
  kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(os.path.join(root, "transformer"), safe_serialization=True, **kw)
  return root


def save_flux_single_file(model, path, prefix=""):
  """Writes the BFL single-file layout through our reversible conversion table."""
  from diffpipe_jax.models import flux
  tensors = table.to_single_file(state_dict_numpy(model), flux.SINGLE_FILE_TABLE)
  write_atomic({prefix + k: v for k, v in tensors.items()}, path)
  return path
