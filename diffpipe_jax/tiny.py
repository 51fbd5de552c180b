"""Tiny random models built with the real diffusers classes and saved in the real on-disk layouts,
for tests and for the embedded default run (no weights can be downloaded).

Every weight is random, norms and the final modulation included, so that a conversion which
drops, transposes or swaps anything shows up as a mismatch.
"""
import os

import numpy as np

from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import write_safetensors

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
  write_safetensors({prefix + k: v for k, v in tensors.items()}, path)
  return path


# Tiny text and VAE sides of the Flux pipeline: CLIP's pooled width is its hidden size, so it
# equals the transformer's pooled_projection_dim; T5's d_model equals joint_attention_dim.
TINY_CLIP = dict(hidden_size=20, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=77, projection_dim=20)
TINY_T5 = dict(d_model=24, d_kv=8, d_ff=32, num_layers=2, num_heads=2, feed_forward_proj="gated-gelu")
TINY_VAE = dict(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)


def clip_tokenizer():
  """A byte-level CLIP tokenizer without merges: every byte is a token, as the hub one falls back to."""
  from tokenizers import pre_tokenizers
  from transformers import CLIPTokenizer
  chars = sorted(pre_tokenizers.ByteLevel.alphabet())
  tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
  return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=77)


def t5_tokenizer():
  """A character-level T5 tokenizer (Unigram + Metaspace, `</s>` appended) with T5's special ids."""
  import string
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import T5TokenizerFast
  pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
  pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
  model = Tokenizer(models.Unigram(pieces, unk_id=2))
  model.pre_tokenizer = pre_tokenizers.Metaspace()
  model.decoder = decoders.Metaspace()
  model.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A $B </s>",
                                                       special_tokens=[("</s>", 1)])
  return T5TokenizerFast(tokenizer_object=model, eos_token="</s>", unk_token="<unk>",
                         pad_token="<pad>", extra_ids=0, model_max_length=512)


def randomize_(model, scale=0.2):
  """Adds noise to every parameter (norms included) so that no weight is at its trivial init."""
  import torch
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * scale)
  return model


def save_flux_pipeline(root, seed=0):
  """Writes a complete tiny FLUX.1-dev pipeline folder (transformer, VAE, CLIP, T5, tokenizers,
  scheduler) with the real classes, for caching and end-to-end tests. Returns root."""
  import torch
  from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
  from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
  transformer = build_flux(seed)
  torch.manual_seed(seed + 1)
  vae = randomize_(AutoencoderKL(
      in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
      up_block_types=("UpDecoderBlock2D",) * 2, **TINY_VAE).eval())
  assert transformer.config.in_channels == 4 * vae.config.latent_channels
  tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
  bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
  text_encoder = randomize_(CLIPTextModel(CLIPTextConfig(
      vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
      **TINY_CLIP)).eval())
  text_encoder_2 = randomize_(T5EncoderModel(T5Config(
      vocab_size=len(tokenizer_2), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
      **TINY_T5)).eval())
  scheduler = FlowMatchEulerDiscreteScheduler(
      shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
      base_image_seq_len=256, max_image_seq_len=4096)
  FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
               transformer=transformer).save_pretrained(root)
  return root


def write_image_dataset(folder, num_images=12, sizes=((40, 40), (56, 32), (32, 56))):
  """Captioned synthetic images (smooth colour fields of a few aspect ratios) with same-stem
  .txt captions: the embedded default's dataset. Returns folder."""
  from PIL import Image
  os.makedirs(folder, exist_ok=True)
  colours = ["red", "green", "blue", "yellow"]
  for i in range(num_images):
    w, h = sizes[i % len(sizes)]
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    c = i % len(colours)
    rgb = np.stack([np.sin(6 * x + i), np.cos(5 * y - i), np.sin(4 * (x + y))], -1) * 0.3 + 0.5
    rgb[..., c % 3] += 0.2
    Image.fromarray((np.clip(rgb, 0, 1) * 255).astype(np.uint8)).save(os.path.join(folder, f"{i:03d}.png"))
    with open(os.path.join(folder, f"{i:03d}.txt"), "w") as f:
      f.write(f"a {colours[c]} pattern, number {i}")
  return folder
