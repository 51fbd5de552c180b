"""LTX-Video's PyTorch side: its encoders for caching (video VAE latents, normalised per channel
and packed; T5 text embeddings and their mask) and the tiny random pipeline and checkpoints for
tests and the embedded default, built with the real diffusers classes and saved in the real
on-disk formats: a diffusers folder, and Lightricks' single file (the transformer, or transformer
and VAE as the released `ltx-video-2b-v0.9.1.safetensors` holds them)."""
import json
import os
import re

import numpy as np

from diffpipe_jax import tiny
from diffpipe_jax.convert.tensorfile import read_header, write_safetensors
from diffpipe_jax.encoders import Encoders, default_device
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import TorchSide


class LTXVideoEncoders(Encoders):
  """LTX-Video: AutoencoderKLLTXVideo latents (32x spatial, 8x temporal, 1 + 8k frames) from the
  diffusers folder or Lightricks' single file; T5 last hidden state and its padding mask."""
  components = {"vae": ("vae", "AutoencoderKLLTXVideo"),
                "tokenizer": ("tokenizer", "T5TokenizerFast"),
                "text_encoder": ("t5", "T5EncoderModel")}

  def __init__(self, path, device, dtype, options, frame_rate, vae_file):
    super().__init__(path, device, dtype, options)
    self.frame_rate, self.vae_file = frame_rate, vae_file

  @classmethod
  def load(cls, path, device=None, dtype=None, max_sequence_length=128, single_file_path="",
           frame_rate=25):
    """The encoders of a diffusers LTX-Video folder (loaded when first needed), the VAE from
    Lightricks' single file if one is given and holds it; float32 on CPU, bfloat16 on CUDA
    unless told."""
    import torch
    if not path:
      raise UserError("caching needs model.diffusers_path for the T5 text encoder, its tokenizer "
                      "and the VAE's config")
    missing = [sub for sub in cls.components if not os.path.isdir(os.path.join(path, sub))]
    if missing:
      raise UserError(f"{path} lacks the encoder folder(s) {missing}: model.diffusers_path must "
                      "be a diffusers LTX-Video pipeline folder (with vae/, text_encoder/, ...)")
    if single_file_path and not os.path.isfile(single_file_path):
      raise UserError(f"model.single_file_path {single_file_path} does not exist")
    vae_file = single_file_path if single_file_path and holds_vae(single_file_path) else ""
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return cls(path, device, dtype, dict(max_sequence_length=max_sequence_length), frame_rate,
               vae_file)

  def load_vae(self):
    from diffusers import AutoencoderKLLTXVideo
    if self.vae_file:  # the folder's vae/config.json says the architecture
      vae = AutoencoderKLLTXVideo.from_single_file(self.vae_file, config=self.path, subfolder="vae",
                                                   torch_dtype=self.dtype)
    else:
      vae = AutoencoderKLLTXVideo.from_pretrained(os.path.join(self.path, "vae"),
                                                  torch_dtype=self.dtype)
    # whole clips in one pass: tiled or frame-wise encoding blends tiles, which changes latents
    # (and diffusers gates frame-wise *encoding* on `use_framewise_decoding`)
    vae.use_tiling = vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return vae

  def load_text_encoders(self):
    from transformers import T5EncoderModel, T5TokenizerFast
    self.tokenizer = T5TokenizerFast.from_pretrained(os.path.join(self.path, "tokenizer"))
    self.t5 = T5EncoderModel.from_pretrained(os.path.join(self.path, "text_encoder"),
                                             dtype=self.dtype).to(self.device).eval()

  def component_source(self, sub):
    return self.vae_file if sub == "vae" and self.vae_file else super().component_source(sub)

  def component_files(self, sub):
    if sub == "vae" and self.vae_file:  # the folder's config.json says the architecture
      return [os.path.join(self.path, "vae", "config.json"), self.vae_file]
    return super().component_files(sub)

  @property
  def spatial_factor(self):
    """Pixels per latent side: the VAE's patch, then a 2x stage per spatio-temporal scaling."""
    cfg = self.config("vae")
    return (cfg.get("spatial_compression_ratio")
            or cfg["patch_size"] * 2 ** sum(cfg["spatio_temporal_scaling"]))

  @property
  def frames_per_latent(self):
    """Frames per latent frame after the first: a clip has 1 + 8k frames (LTXPipeline's rule)."""
    cfg = self.config("vae")
    return (cfg.get("temporal_compression_ratio")
            or cfg["patch_size_t"] * 2 ** sum(cfg["spatio_temporal_scaling"]))

  @property
  def pixel_multiple(self):
    """Bucket sides must be multiples of this: the VAE's factor (the transformer's patch is 1)."""
    return self.spatial_factor

  def latent_grid(self, frames, height, width):
    """Token grid (frames, rows, columns) of a bucket: LTX packs one token per latent pixel."""
    return ((frames - 1) // self.frames_per_latent + 1, height // self.spatial_factor,
            width // self.spatial_factor)

  def encode_media(self, pixels):
    """np [B, F, H, W, 3] in [-1, 1] (F = 1 + 8k, sides multiples of 32) -> np float32 latents
    [B, F'*H'*W', C] in (f, h, w) order: the posterior mean (`posterior_mean`), normalised per
    channel as LTXPipeline does."""
    vae, b = self.vae, len(pixels)
    z = self.posterior_mean(pixels, self.spatial_factor)
    stats = lambda t: t.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    z = (z - stats(vae.latents_mean)) * vae.config.scaling_factor / stats(vae.latents_std)
    return z.permute(0, 2, 3, 4, 1).reshape(b, -1, z.shape[1]).float().cpu().numpy()

  def decode_media(self, latents, grid):
    """Latents [B, F'*H'*W', C] of a latent grid -> np [B, F, H, W, 3] in [-1, 1], as LTXPipeline
    unpacks, denormalises and decodes them (a timestep-conditioned decoder at its default
    decode_timestep 0, so no noise is mixed into the latents). The decoder's blocks still add
    noise of their own (`decoder_inject_noise`, the released 0.9.1 VAE's) from torch's global
    generator: drawn here from a fixed seed, so that a sample is the same in every run and
    leaves the caller's generator as it was."""
    import torch
    vae = self.vae
    z = torch.from_numpy(np.array(latents, np.float32)).to(self.vae.device, self.vae.dtype)
    z = z.view(z.shape[0], *grid, -1).permute(0, 4, 1, 2, 3)
    stats = lambda t: t.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    z = z * stats(vae.latents_std) / vae.config.scaling_factor + stats(vae.latents_mean)
    temb = (torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
            if vae.config.timestep_conditioning else None)
    with torch.no_grad(), torch.random.fork_rng(devices=[z.device] if z.device.type == "cuda" else []):
      torch.manual_seed(0)
      pixels = vae.decode(z, temb).sample
    return pixels.clamp(-1, 1).float().cpu().numpy().transpose(0, 2, 3, 4, 1)

  def encode_text(self, captions, frames=1):
    """Captions -> dict(text=[B, T, D] T5 last hidden state, text_mask=[B, T] 1 = token), as
    LTXPipeline.encode_prompt makes them: padded to max_sequence_length, truncated, and T5 run
    without the mask (pads are attended inside T5; the transformer's cross-attention masks them)."""
    import torch
    captions, limit = list(captions), self.options["max_sequence_length"]
    self.count_truncated(f"are longer than T5's {limit} tokens (max_sequence_length) and were "
                         "truncated: their end is not trained on", self.tokenizer, captions, limit)
    tokens = self.tokenizer(captions, padding="max_length", max_length=limit, truncation=True,
                            add_special_tokens=True, return_tensors="pt")
    with torch.no_grad():
      text = self.t5(tokens.input_ids.to(self.device))[0]
    return dict(text=text.float().cpu().numpy(), text_mask=tokens.attention_mask.float().numpy())


def holds_vae(path):
  """Whether a Lightricks single file holds the VAE (`vae.*` tensors), as the released ones do."""
  header, _ = read_header(path)
  return any(key.startswith("vae.") for key in header)


# Smallest LTX transformer with every structural feature: several heads, RoPE over an inner dim
# (4 x 8 = 32) that leaves 32 % 6 = 2 padding channels as the released 2048 does, a caption
# width (the tiny T5's d_model) of its own, latent channels of the tiny VAE.
TINY_LTX = dict(in_channels=12, out_channels=12, num_attention_heads=4, attention_head_dim=8,
                cross_attention_dim=32, num_layers=5, caption_channels=20)

# The tiny VAE: 0.9.1's block structure (which diffusers' single-file renames assume) with few
# channels: patch 4 then three 2x2x2 stages, so 32x spatial and 8x temporal compression; a
# timestep-conditioned decoder with noise injection and residual depth-to-space upsamplers.
TINY_VAE = dict(
    latent_channels=12, block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, False),
    down_block_types=("LTXVideoDownBlock3D",) * 4, decoder_block_out_channels=(8, 16, 32),
    decoder_layers_per_block=(1, 1, 1, 1), decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(True, True, True, False), upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4, patch_size_t=1,
    scaling_factor=0.9)

# diffusers' single-file renames (`loaders/single_file_utils.py`,
# `convert_ltx_{transformer,vae}_checkpoint_to_diffusers`) as (Lightricks, diffusers) pairs,
# inverted here to write Lightricks' names. Block renames apply at the top of the encoder or
# decoder (the 0.9.0/0.9.1 encoder and the 0.9.1 decoder); the rest to whole name segments.
TRANSFORMER_RENAMES = (("patchify_proj", "proj_in"), ("adaln_single", "time_embed"),
                       ("q_norm", "norm_q"), ("k_norm", "norm_k"))
VAE_BLOCKS = dict(
    encoder=(("down_blocks.0", "down_blocks.0"), ("down_blocks.1", "down_blocks.0.downsamplers.0"),
             ("down_blocks.2", "down_blocks.0.conv_out"), ("down_blocks.3", "down_blocks.1"),
             ("down_blocks.4", "down_blocks.1.downsamplers.0"),
             ("down_blocks.5", "down_blocks.1.conv_out"), ("down_blocks.6", "down_blocks.2"),
             ("down_blocks.7", "down_blocks.2.downsamplers.0"), ("down_blocks.8", "down_blocks.3"),
             ("down_blocks.9", "mid_block")),
    decoder=(("up_blocks.0", "mid_block"), ("up_blocks.1", "up_blocks.0.upsamplers.0"),
             ("up_blocks.2", "up_blocks.0"), ("up_blocks.3", "up_blocks.1.upsamplers.0"),
             ("up_blocks.4", "up_blocks.1"), ("up_blocks.5", "up_blocks.2.upsamplers.0"),
             ("up_blocks.6", "up_blocks.2"), ("up_blocks.7", "up_blocks.3.upsamplers.0"),
             ("up_blocks.8", "up_blocks.3"), ("last_time_embedder", "time_embedder"),
             ("last_scale_shift_table", "scale_shift_table")))
VAE_RENAMES = (("res_blocks", "resnets"), ("conv_shortcut", "conv_shortcut.conv"),
               ("norm3.norm", "norm3"), ("per_channel_statistics.mean-of-means", "latents_mean"),
               ("per_channel_statistics.std-of-means", "latents_std"))
# Statistics Lightricks' VAE also stores and diffusers drops, each a vector over the latent channels.
VAE_EXTRA_STATISTICS = tuple(f"vae.per_channel_statistics.{name}" for name in (
    "channel", "mean-of-stds", "mean-of-stds_over_std-of-means"))
PREFIX = "model.diffusion_model."  # of the transformer, in a file that also holds the VAE


def build_tiny(seed=0, **overrides):
  """A random diffusers `LTXVideoTransformer3DModel` (float32, eval mode)."""
  from diffusers import LTXVideoTransformer3DModel
  return tiny.build(LTXVideoTransformer3DModel, seed, **{**TINY_LTX, **overrides})


def build_tiny_vae(seed=0):
  """A random `AutoencoderKLLTXVideo` (float32, eval mode), latent statistics included."""
  import torch
  from diffusers import AutoencoderKLLTXVideo
  vae = tiny.build(AutoencoderKLLTXVideo, seed, **TINY_VAE)
  channels = vae.config.latent_channels
  vae.latents_mean.copy_(torch.randn(channels) * 0.5)
  vae.latents_std.copy_(torch.rand(channels) + 0.5)
  return vae


def _rename(key, anchored, anywhere):
  """A diffusers name -> Lightricks': the longest anchored prefix, then whole-segment names."""
  for old, new in sorted(anchored, key=lambda row: -len(row[1])):
    if key == new or key.startswith(new + "."):
      key = old + key[len(new):]
      break
  for old, new in anywhere:
    key = re.sub(rf"(?<![^.]){re.escape(new)}(?![^.])", old, key)
  return key


def lightricks_transformer_key(key):
  """A diffusers transformer name -> Lightricks'."""
  return _rename(key, (), TRANSFORMER_RENAMES)


def lightricks_vae_key(key):
  """A diffusers VAE name -> Lightricks', `vae.` prefix included."""
  side, _, rest = key.partition(".")
  if side in VAE_BLOCKS:
    key = f"{side}.{_rename(rest, VAE_BLOCKS[side], ())}"
  return "vae." + _rename(key, (), VAE_RENAMES)


def lightricks_transformer(model):
  """The transformer's tensors under Lightricks' names (numpy float32)."""
  return {lightricks_transformer_key(k): v for k, v in tiny.state_dict_numpy(model).items()}


def lightricks_vae(vae):
  """The VAE's tensors under Lightricks' names, `vae.` prefix and all its statistics included."""
  tensors = {lightricks_vae_key(k): v for k, v in tiny.state_dict_numpy(vae).items()}
  channels = vae.config.latent_channels
  for key in VAE_EXTRA_STATISTICS:
    tensors[key] = np.arange(channels, dtype=np.float32)
  return tensors


def lightricks_config(model, vae=None):
  """The released files' metadata `config` in Lightricks' terms: {transformer, scheduler}, and
  `vae` with one."""
  t = model.config
  transformer = dict(
      _class_name="Transformer3DModel", num_layers=t.num_layers, in_channels=t.in_channels,
      out_channels=t.out_channels, num_attention_heads=t.num_attention_heads,
      attention_head_dim=t.attention_head_dim, cross_attention_dim=t.cross_attention_dim,
      caption_channels=t.caption_channels, activation_fn=t.activation_fn, attention_bias=True,
      norm_elementwise_affine=False, norm_eps=t.norm_eps, qk_norm="rms_norm",
      positional_embedding_type="rope", positional_embedding_theta=10000.0,
      positional_embedding_max_pos=[20, 2048, 2048], timestep_scale_multiplier=1000)
  scheduler = dict(_class_name="RectifiedFlowScheduler", num_train_timesteps=1000,
                   shifting="SD3", base_resolution=None, target_shift_terminal=0.1)
  config = dict(transformer=transformer, scheduler=scheduler)
  return config if vae is None else dict(config, vae=lightricks_vae_config(vae.config))


def lightricks_vae_config(v):
  """A diffusers VAE config as Lightricks' `CausalVideoAutoencoder` block lists."""
  encoder_blocks = []
  for layers, scale, (c_in, c_out) in zip(
      v.layers_per_block, v.spatio_temporal_scaling,
      zip(v.block_out_channels, v.block_out_channels[1:] + v.block_out_channels[-1:])):
    encoder_blocks += [["res_x", {"num_layers": layers}]] + [["compress_all", {}]] * scale
    encoder_blocks += [["res_x_y", {"multiplier": c_out // c_in}]] * (c_out != c_in)
  encoder_blocks.append(["res_x", {"num_layers": v.layers_per_block[-1]}])
  layers, noise = v.decoder_layers_per_block[::-1], v.decoder_inject_noise[::-1]
  up_blocks = [["res_x", {"num_layers": layers[0], "inject_noise": noise[0]}]]
  for i, (residual, factor) in enumerate(zip(v.upsample_residual[::-1], v.upsample_factor[::-1])):
    up_blocks += [["compress_all", {"residual": residual, "multiplier": factor}],
                  ["res_x", {"num_layers": layers[i + 1], "inject_noise": noise[i + 1]}]]
  return dict(
      _class_name="CausalVideoAutoencoder", dims=3, in_channels=v.in_channels,
      out_channels=v.out_channels, latent_channels=v.latent_channels,
      encoder_blocks=encoder_blocks, decoder_blocks=up_blocks[::-1],
      scaling_factor=v.scaling_factor, norm_layer="pixel_norm", patch_size=v.patch_size,
      latent_log_var="uniform", use_quant_conv=False, causal_decoder=v.decoder_causal,
      timestep_conditioning=v.timestep_conditioning)


def save_single_file(model, path, vae=None):
  """Writes Lightricks' single file with its config as metadata: the transformer alone
  (unprefixed), or, with `vae`, as the released files are: `model.diffusion_model.` +
  transformer, `vae.` + VAE (Lightricks' loader strips only that prefix, so a file with a VAE
  must have it)."""
  tensors = lightricks_transformer(model)
  if vae is not None:
    tensors = {PREFIX + k: v for k, v in tensors.items()} | lightricks_vae(vae)
  write_safetensors(tensors, path, metadata={"config": json.dumps(lightricks_config(model, vae))})
  return path


def save_tiny(model, root) -> dict:
  """`model` in every format `models.load` takes: a diffusers folder (one file, and sharded
  with an index), Lightricks' single file, and the same prefixed with a tiny VAE beside it."""
  return dict(diffusers=tiny.save_diffusers(model, os.path.join(root, "pipeline")),
              diffusers_sharded=tiny.save_diffusers(model, os.path.join(root, "sharded"),
                                                    max_shard_size="40KB"),
              single_file=save_single_file(model, os.path.join(root, "ltx-video.safetensors")),
              single_file_prefixed=save_single_file(
                  model, os.path.join(root, "ltx-video-2b-v0.9.1.safetensors"), build_tiny_vae()))


def write_tiny_pipeline(root, seed=0):
  """Writes a complete tiny LTX-Video pipeline folder (transformer, VAE, T5, tokenizer,
  scheduler) with the real classes, for caching and end-to-end tests. Returns root."""
  from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline
  transformer, vae = build_tiny(seed), build_tiny_vae(seed + 1)
  assert transformer.config.in_channels == vae.config.latent_channels
  tokenizer = tiny.t5_tokenizer()
  text_encoder = tiny.t5_encoder(tokenizer, d_model=transformer.config.caption_channels)
  scheduler = FlowMatchEulerDiscreteScheduler(
      use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
      max_image_seq_len=4096, shift_terminal=0.1)
  LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
              transformer=transformer).save_pretrained(root)
  return root


TORCH_SIDE = TorchSide(
    load_encoders=lambda model_config, **kw: LTXVideoEncoders.load(
        model_config.diffusers_path, single_file_path=model_config.single_file_path,
        frame_rate=model_config.frame_rate, **kw),
    write_tiny_pipeline=write_tiny_pipeline,
    tiny_kinds=("",),
    build_tiny=build_tiny,
    save_tiny=save_tiny,
    pipeline="LTXPipeline",
)
