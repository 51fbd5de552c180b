"""FLUX.1's PyTorch side: its encoders for caching (AutoencoderKL latents, 2x2-packed; T5 and
CLIP text embeddings) and the tiny random pipeline and checkpoints for tests and the embedded
default, built with the real diffusers classes and saved in the real on-disk formats."""
import os

import numpy as np

from diffpipe_jax import tiny
from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import write_safetensors
from diffpipe_jax.encoders import Encoders, default_device
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import TorchSide
from diffpipe_jax.models import flux


class FluxEncoders(Encoders):
  """FLUX.1: AutoencoderKL latents 2x2-packed; T5 last hidden state and CLIP pooled output."""
  components = {"vae": ("vae", "AutoencoderKL"), "tokenizer": ("clip_tokenizer", "CLIPTokenizer"),
                "text_encoder": ("clip", "CLIPTextModel"),
                "tokenizer_2": ("t5_tokenizer", "T5TokenizerFast"),
                "text_encoder_2": ("t5", "T5EncoderModel")}

  @classmethod
  def load(cls, path, device=None, dtype=None, max_sequence_length=512):
    """The encoders of a diffusers FLUX folder (loaded when first needed); float32 on CPU,
    bfloat16 on CUDA unless told."""
    import torch
    if not path:
      raise UserError("caching needs model.diffusers_path for the VAE and text encoders")
    missing = [sub for sub in cls.components if not os.path.isdir(os.path.join(path, sub))]
    if missing:
      raise UserError(f"{path} lacks the encoder folder(s) {missing}: model.diffusers_path "
                      "must be a diffusers FLUX.1 pipeline folder (with vae/, text_encoder/, ...)")
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return cls(path, device, dtype, dict(max_sequence_length=max_sequence_length))

  def load_vae(self):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_pretrained(os.path.join(self.path, "vae"), torch_dtype=self.dtype)

  def load_text_encoders(self):
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    sub = lambda name: os.path.join(self.path, name)
    model = lambda cls, name: cls.from_pretrained(sub(name), dtype=self.dtype).to(self.device).eval()
    self.clip_tokenizer = CLIPTokenizer.from_pretrained(sub("tokenizer"))
    self.clip = model(CLIPTextModel, "text_encoder")
    self.t5_tokenizer = T5TokenizerFast.from_pretrained(sub("tokenizer_2"))
    self.t5 = model(T5EncoderModel, "text_encoder_2")

  @property
  def spatial_factor(self):
    return 2 ** (len(self.config("vae")["block_out_channels"]) - 1)

  @property
  def pixel_multiple(self):
    """Bucket sides must be multiples of this: the VAE factor, then 2x2 packing."""
    return 2 * self.spatial_factor

  def latent_grid(self, frames, height, width):
    """Packed token grid (rows, columns) of a bucket: VAE factor, then 2x2 patches."""
    return (height // self.pixel_multiple, width // self.pixel_multiple)

  def encode_images(self, pixels):
    """[B, 3, H, W] in [-1, 1] -> packed latents [B, (h/2)*(w/2), 4*C], as FluxPipeline packs.

    The posterior mean, not a sample: the cache is then reproducible, and a sample drawn once
    would freeze one fixed perturbation per item anyway (Flux's posterior std is tiny)."""
    import torch
    cfg = self.vae.config
    with torch.no_grad():
      z = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mean
    z = (z - cfg.shift_factor) * cfg.scaling_factor
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)

  def encode_media(self, pixels):
    """np [B, F, H, W, 3] (F = 1) -> np float32 packed latents."""
    import torch
    if pixels.shape[1] != 1:
      raise ValueError(f"Flux encodes images only, got {pixels.shape[1]} frames")
    x = torch.from_numpy(np.ascontiguousarray(pixels[:, 0].transpose(0, 3, 1, 2)))
    return self.encode_images(x).float().cpu().numpy()

  def decode_media(self, latents, grid):
    """Packed latents [B, rows * columns, 4C] of a latent grid -> np [B, 1, H, W, 3] in [-1, 1],
    as FluxPipeline unpacks and decodes them."""
    import torch
    cfg, (rows, columns) = self.vae.config, grid
    z = torch.from_numpy(np.array(latents, np.float32)).to(self.vae.device, self.vae.dtype)
    b, _, c4 = z.shape
    z = z.view(b, rows, columns, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    z = z.reshape(b, c4 // 4, 2 * rows, 2 * columns) / cfg.scaling_factor + cfg.shift_factor
    with torch.no_grad():
      pixels = self.vae.decode(z).sample
    return pixels.clamp(-1, 1).float().cpu().numpy().transpose(0, 2, 3, 1)[:, None]

  def encode_text(self, captions, frames=1):
    """Captions -> dict(text=[B, T, D] T5 last hidden state, pooled=[B, D'] CLIP pooled output),
    tokenised as FluxPipeline.encode_prompt does (padded to max length, truncated, no mask)."""
    import torch
    captions = list(captions)
    self.count_truncated_captions(captions)
    tokens = lambda tok, n: tok(captions, padding="max_length", max_length=n, truncation=True,
                                return_tensors="pt").input_ids.to(self.device)
    with torch.no_grad():
      pooled = self.clip(tokens(self.clip_tokenizer, self.clip_tokenizer.model_max_length),
                         output_hidden_states=False).pooler_output
      text = self.t5(tokens(self.t5_tokenizer, self.options["max_sequence_length"]),
                     output_hidden_states=False)[0]
    return dict(text=text.float().cpu().numpy(), pooled=pooled.float().cpu().numpy())

  def count_truncated_captions(self, captions):
    """T5 reads max_sequence_length tokens: the rest of a caption is never trained on. CLIP reads
    77, which long captions pass routinely (FluxPipeline truncates them too; T5 reads the rest)."""
    limit, clip_limit = self.options["max_sequence_length"], self.clip_tokenizer.model_max_length
    self.count_truncated(f"are longer than T5's {limit} tokens (max_sequence_length) and were "
                         "truncated: their end is not trained on", self.t5_tokenizer, captions, limit)
    self.count_truncated(f"are longer than CLIP's {clip_limit} tokens and were truncated for CLIP, "
                         f"as FluxPipeline truncates them; T5 reads up to {limit}",
                         self.clip_tokenizer, captions, clip_limit)


# Smallest Flux that still has every structural feature: several blocks of each kind, a head
# size (32) whose RoPE axes derive as in FLUX.1 (4, 14, 14), text and pooled widths of their own.
TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3,
                 attention_head_dim=32, num_attention_heads=2, joint_attention_dim=24,
                 pooled_projection_dim=20, guidance_embeds=True, axes_dims_rope=(4, 14, 14))


def build_tiny(seed=0, **overrides):
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


def save_single_file(model, path, prefix=""):
  """Writes the BFL single-file format through our reversible conversion table."""
  tensors = table.to_single_file(tiny.state_dict_numpy(model), flux.SINGLE_FILE_TABLE)
  write_safetensors({prefix + k: v for k, v in tensors.items()}, path)
  return path


# Tiny text and VAE sides of the Flux pipeline: CLIP's pooled width is its hidden size, so it
# equals the transformer's pooled_projection_dim; T5's d_model is its joint_attention_dim.
TINY_CLIP = dict(hidden_size=20, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=77, projection_dim=20)
TINY_VAE = dict(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)


def write_tiny_pipeline(root, seed=0):
  """Writes a complete tiny FLUX.1-dev pipeline folder (transformer, VAE, CLIP, T5, tokenizers,
  scheduler) with the real classes, for caching and end-to-end tests. Returns root."""
  import torch
  from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
  from transformers import CLIPTextConfig, CLIPTextModel
  transformer = build_tiny(seed)
  torch.manual_seed(seed + 1)
  vae = tiny.randomize_(AutoencoderKL(
      in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
      up_block_types=("UpDecoderBlock2D",) * 2, **TINY_VAE).eval())
  assert transformer.config.in_channels == 4 * vae.config.latent_channels
  tokenizer, tokenizer_2 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
  bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
  text_encoder = tiny.randomize_(CLIPTextModel(CLIPTextConfig(
      vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
      **TINY_CLIP)).eval())
  text_encoder_2 = tiny.t5_encoder(tokenizer_2, d_model=transformer.config.joint_attention_dim)
  scheduler = FlowMatchEulerDiscreteScheduler(
      shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
      base_image_seq_len=256, max_image_seq_len=4096)
  FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
               transformer=transformer).save_pretrained(root)
  return root


def save_tiny(model, root) -> dict:
  """`model` in every format `models.load` takes: a diffusers folder (one file, and sharded
  with an index), the BFL single file, and the same with ComfyUI's key prefix."""
  return dict(diffusers=tiny.save_diffusers(model, os.path.join(root, "pipeline")),
              diffusers_sharded=tiny.save_diffusers(model, os.path.join(root, "sharded"),
                                                    max_shard_size="40KB"),
              single_file=save_single_file(model, os.path.join(root, "flux1.safetensors")),
              single_file_prefixed=save_single_file(model, os.path.join(root, "flux1_comfy.safetensors"),
                                                    prefix="model.diffusion_model."))


TORCH_SIDE = TorchSide(
    load_encoders=lambda model_config, **kw: FluxEncoders.load(model_config.diffusers_path, **kw),
    write_tiny_pipeline=write_tiny_pipeline,
    tiny_kinds=("",),
    build_tiny=build_tiny,
    save_tiny=save_tiny,
    pipeline="FluxPipeline",
)
