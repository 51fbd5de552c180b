"""Wan 2.1 / 2.2's PyTorch side: its encoders for caching (Wan VAE latents, unpacked and normalised
per channel; UMT5 text embeddings zeroed after each prompt's length) and the tiny random pipeline
and checkpoints for tests and the embedded default, built with the real diffusers and transformers
classes and saved in the real on-disk formats: a diffusers folder, Wan-AI's original folder
(config.json and sharded safetensors under Wan's own names), and ComfyUI's single files."""
import json
import math
import os

import numpy as np

from diffpipe_jax import tiny
from diffpipe_jax.convert.tensorfile import write_safetensors
from diffpipe_jax.encoders import Encoders, default_device
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import TorchSide
from diffpipe_jax.models import wan as wan_model


class WanEncoders(Encoders):
  """Wan: AutoencoderKLWan latents (8x spatial and 4x temporal for 2.1 and the 2.2 A14B, 16x
  spatial for the 2.2 TI2V 5B's VAE; 1 + 4k frames), unpacked; UMT5 last hidden state, zeroed
  after each prompt's tokens. Both run in `dtype`, as the other families' encoders. For an I2V
  transformer also the first frame's condition latents and, where it has an image embedder
  (2.1 I2V), the first frame's CLIP states (`encode_fields`)."""
  components = {"vae": ("vae", "AutoencoderKLWan"),
                "tokenizer": ("tokenizer", "AutoTokenizer"),
                "text_encoder": ("umt5", "UMT5EncoderModel")}
  # an I2V transformer's with an image embedder (2.1 I2V), loaded with the VAE
  IMAGE_COMPONENTS = {"image_encoder": ("clip", "CLIPVisionModel"),
                      "image_processor": ("clip_processor", "CLIPImageProcessor")}

  def __init__(self, path, device, dtype, options, frame_rate, vae_config, transformer):
    super().__init__(path, device, dtype, options)
    self.frame_rate, self.vae_config = frame_rate, vae_config
    self.patch_size = tuple(transformer.patch_size)
    self.first_frame = wan_model.first_frame_input(transformer)
    if transformer.image_dim is not None:
      self.components = {**self.components, **self.IMAGE_COMPONENTS}
      self.media_components = ("vae", *(attr for attr, _ in self.IMAGE_COMPONENTS.values()))

  @property
  def takes_first_frame(self):
    return self.first_frame == "channels"

  @classmethod
  def load(cls, path, device=None, dtype=None, max_sequence_length=wan_model.TEXT_TOKENS, frame_rate=0,
           trained_config=None):
    """The encoders of a diffusers Wan folder (loaded when first needed); the text encoder in
    float32 on CPU, bfloat16 on CUDA unless told. `frame_rate`: videos' (0: the model's, 16 for
    Wan 2.1, 24 for the 2.2 TI2V 5B); `trained_config()`: the config of the transformer trained
    (default: the folder's), which says what the cache holds besides latents and text, read
    once the folder is known to exist."""
    import torch
    from diffusers.utils import is_ftfy_available
    if not path:
      raise UserError("caching needs model.diffusers_path for the UMT5 text encoder, its "
                      "tokenizer and the VAE")
    if not os.path.isdir(path):
      raise UserError(f"model.diffusers_path {path} does not exist: set it to a diffusers Wan "
                      "pipeline folder (with vae/, text_encoder/, tokenizer/)")
    missing = lambda components: [sub for sub in components
                                   if not os.path.isdir(os.path.join(path, sub))]
    if missing(cls.components):
      raise UserError(f"{path} lacks the encoder folder(s) {missing(cls.components)}: "
                      "model.diffusers_path must be a diffusers Wan pipeline folder (with vae/, "
                      "text_encoder/, tokenizer/)")
    if trained_config is not None:
      transformer = trained_config()
    else:
      config = os.path.join(path, "transformer", "config.json")
      transformer = wan_model.WanConfig()  # the released patch, as WanPipeline assumes
      if os.path.isfile(config):
        with open(config) as f:
          transformer = wan_model.config_from_diffusers(json.load(f))
    if transformer.image_dim and missing(cls.IMAGE_COMPONENTS):
      raise UserError(f"{path} lacks the encoder folder(s) {missing(cls.IMAGE_COMPONENTS)}: "
                      "model.diffusers_path must be a diffusers Wan I2V pipeline folder (with "
                      "image_encoder/, image_processor/: the transformer attends to CLIP image states)")
    vae_config = read_vae_config(os.path.join(path, "vae"))
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    # whether ftfy repairs the captions (WanPipeline's prompt_clean uses it where installed)
    # changes the embeddings of some, so it is part of the cache's fingerprint
    clean = "ftfy+html+whitespace" if is_ftfy_available() else "html+whitespace"
    options = dict(max_sequence_length=max_sequence_length, prompt_clean=clean)
    first_frame = wan_model.first_frame_input(transformer)
    if first_frame == "channels":  # the cache holds the condition (and CLIP states): its fingerprint
      options["first_frame"] = "latents+clip" if transformer.image_dim else "latents"
    return cls(path, device, dtype, options, frame_rate or wan_model.frame_rate(transformer),
               vae_config, transformer)

  def load_media_encoders(self):
    """The VAE, and an I2V model's CLIP vision encoder (float32, as WanImageToVideoPipeline's
    users load it) with its image processor."""
    super().load_media_encoders()
    if "image_encoder" in self.components:
      import torch
      from transformers import CLIPImageProcessor, CLIPVisionModel
      self.clip_processor = CLIPImageProcessor.from_pretrained(os.path.join(self.path, "image_processor"))
      self.clip = CLIPVisionModel.from_pretrained(os.path.join(self.path, "image_encoder"),
                                                  dtype=torch.float32).to(self.device).eval()

  def load_vae(self):
    from diffusers import AutoencoderKLWan
    vae = AutoencoderKLWan.from_pretrained(os.path.join(self.path, "vae"), torch_dtype=self.dtype)
    # whole clips in one pass (diffusers' default): tiles are blended at their seams, which
    # changes the latents
    vae.use_tiling = vae.use_slicing = False
    return vae

  def load_text_encoders(self):
    from transformers import AutoTokenizer, UMT5EncoderModel
    self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(self.path, "tokenizer"))
    self.umt5 = UMT5EncoderModel.from_pretrained(os.path.join(self.path, "text_encoder"),
                                                 dtype=self.dtype).to(self.device).eval()

  @property
  def frames_per_latent(self):
    """Frames per latent frame after the first: a clip has 1 + 4k frames."""
    return self.vae_config["scale_factor_temporal"]

  @property
  def spatial_factor(self):
    """Pixels per latent side: the VAE's (its config's `scale_factor_spatial`, as WanPipeline
    reads it)."""
    return self.vae_config["scale_factor_spatial"]

  @property
  def pixel_multiple(self):
    """Bucket sides must be multiples of this: the VAE's factor times the transformer's spatial
    patch (WanPipeline rounds its sizes down to it)."""
    return self.spatial_factor * math.lcm(*self.patch_size[1:])

  def latent_grid(self, frames, height, width):
    """The latents' own grid (frames, rows, columns); the transformer patchifies itself."""
    return ((frames - 1) // self.frames_per_latent + 1, height // self.spatial_factor,
            width // self.spatial_factor)

  def latent_stats(self, like):
    """The VAE config's per-channel mean and reciprocal std, shaped and typed as WanPipeline
    makes them (the reciprocal taken in the latents' dtype)."""
    import torch
    shape = (1, self.vae_config["z_dim"], 1, 1, 1)
    mean = torch.tensor(self.vae_config["latents_mean"]).view(shape).to(like.device, like.dtype)
    std = torch.tensor(self.vae_config["latents_std"]).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / std
    return mean, inv_std

  def encode_media(self, pixels):
    """np [B, F, H, W, 3] in [-1, 1] (F = 1 + 4k, sides multiples of `pixel_multiple`) -> np
    float32 latents [B, C, F', H', W'] (unpacked): the posterior mean (`posterior_mean`, the
    pipelines' `sample_mode="argmax"`), normalised per channel as WanPipeline normalises a
    condition frame's: (z - latents_mean) * (1 / latents_std)."""
    z = self.posterior_mean(pixels, self.pixel_multiple)
    mean, inv_std = self.latent_stats(z)
    return ((z - mean) * inv_std).float().cpu().numpy()

  def encode_fields(self, pixels) -> dict:
    """The latents, and for an I2V transformer what WanImageToVideoPipeline makes of the clip's
    first frame (`first_frame_fields`)."""
    fields = super().encode_fields(pixels)
    if self.takes_first_frame:
      fields.update(self.first_frame_fields(pixels[:, 0], pixels.shape[1]))
    return fields

  def first_frame_fields(self, images, frames) -> dict:
    """What an I2V transformer is given of first frames `images` (np [N, H, W, 3] in [-1, 1]) for
    clips of `frames` frames, as WanImageToVideoPipeline makes it: `condition`, the latents of
    the frame followed by black frames (its `video_condition`; an image's are its latents), and,
    where the transformer has an image embedder, `image`, the frame's CLIP states."""
    video = np.zeros((len(images), frames, *images.shape[1:]), np.float32)
    video[:, 0] = images
    fields = dict(condition=self.encode_media(video))
    if "image_encoder" in self.components:
      fields["image"] = self.encode_image(images)
    return fields

  def encode_image(self, frames):
    """np [B, H, W, 3] in [-1, 1] -> CLIP's penultimate hidden states [B, I, image_dim], as
    WanImageToVideoPipeline's `encode_image` makes them from the frames as 8-bit images."""
    import torch
    from PIL import Image
    images = [Image.fromarray(np.round((f + 1) * 127.5).clip(0, 255).astype(np.uint8)) for f in frames]
    pixel_values = self.clip_processor(images=images, return_tensors="pt").pixel_values
    with torch.no_grad():
      states = self.clip(pixel_values=pixel_values.to(self.device, self.clip.dtype),
                         output_hidden_states=True).hidden_states[-2]
    return states.float().cpu().numpy()

  def decode_media(self, latents, grid):
    """Latents [B, C, F', H', W'] -> np [B, F, H, W, 3] in [-1, 1], as WanPipeline
    un-normalises (z / (1 / latents_std) + latents_mean) and decodes them."""
    import torch
    vae = self.vae
    z = torch.from_numpy(np.array(latents, np.float32)).to(vae.device, vae.dtype)
    mean, inv_std = self.latent_stats(z)
    with torch.no_grad():
      pixels = vae.decode(z / inv_std + mean).sample
    return pixels.clamp(-1, 1).float().cpu().numpy().transpose(0, 2, 3, 4, 1)

  def encode_text(self, captions, frames=1):
    """Captions -> dict(text=[B, T, D] UMT5 last hidden state), as WanPipeline's
    `_get_t5_prompt_embeds` makes them: the captions cleaned by its `prompt_clean` (ftfy where
    installed, HTML entities unescaped, whitespace runs made one space, ends stripped), T =
    max_sequence_length tokens, truncated, UMT5 run with the padding mask, and each caption's
    embeddings after its own tokens (`</s>` included) set to zero. The transformer takes no mask:
    the zeros are what it attends to."""
    import torch
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    captions, limit = [prompt_clean(c) for c in captions], self.options["max_sequence_length"]
    self.count_truncated(f"are longer than UMT5's {limit} tokens (max_sequence_length) and were "
                         "truncated: their end is not trained on", self.tokenizer, captions, limit)
    tokens = self.tokenizer(captions, padding="max_length", max_length=limit, truncation=True,
                            add_special_tokens=True, return_attention_mask=True,
                            return_tensors="pt")
    with torch.no_grad():
      text = self.umt5(tokens.input_ids.to(self.device),
                       tokens.attention_mask.to(self.device)).last_hidden_state
    lengths = tokens.attention_mask.gt(0).sum(1).to(text.device)
    kept = torch.arange(limit, device=text.device)[None, :] < lengths[:, None]
    return dict(text=text.masked_fill(~kept[..., None], 0).float().cpu().numpy())


def read_vae_config(folder):
  """A diffusers folder's VAE config, its missing keys filled with AutoencoderKLWan's defaults
  as diffusers fills them (the 2.1 folders' configs predate `scale_factor_spatial`)."""
  import inspect
  from diffusers import AutoencoderKLWan
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"{folder} has no config.json: model.diffusers_path must be a diffusers Wan "
                    "pipeline folder, its vae/ as saved by diffusers")
  with open(path) as f:
    config = json.load(f)
  parameters = inspect.signature(AutoencoderKLWan.__init__).parameters.values()
  defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
  return {**defaults, **config}


# Smallest Wan transformer with every structural feature, in non-released dims: an odd head
# count, a head size (14) whose RoPE axes split unevenly (t 6, h 4, w 4: diffusers gives h and w
# 2 * (14 // 6) each, t the rest), latent channels of the tiny VAE (9, odd), a text width of
# the tiny UMT5's, a small timestep frequency width (RoPE's table length stays the released
# 1024, which single files do not store either). Its single files say their head count in
# their metadata (`save_comfyui`), since their weights do not show it.
TINY_Z = 9
TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=14,
                in_channels=TINY_Z, out_channels=TINY_Z, text_dim=20, freq_dim=16, ffn_dim=64,
                num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
# Wan 2.1 I2V on top: CLIP image features (a width of their own) through the image embedder
# and the cross-attentions' added key/value projections (of the inner width, as released), and
# the noisy latents joined by the first-frame mask (4 channels: the VAE's temporal factor) and
# the condition latents.
TINY_I2V = dict(image_dim=24, added_kv_proj_dim=3 * 14, in_channels=2 * TINY_Z + 4)
# Wan 2.2 TI2V 5B: the 2.2 VAE's latents in and out (its first frame is given clean).
TINY_TI2V = dict(in_channels=48, out_channels=48)

# The tiny VAE: Wan 2.1's structure (4x temporal, 8x spatial: three 2x stages, the later two
# also temporal), the released two resnets a stage (diffusers' VAE single-file conversion
# assumes them), narrow stages with a multiplier of 3, and random latent statistics.
TINY_VAE = dict(base_dim=8, z_dim=TINY_Z, dim_mult=[1, 2, 3, 3], num_res_blocks=2,
                temperal_downsample=[False, True, True])
# Wan 2.2's VAE (the TI2V 5B's): 2x2 patchified pixels (12 channels), residual down and up blocks,
# 16x spatial, a decoder wider than the encoder, as released, at a tiny width; its 48 latent
# channels kept, since they tell a TI2V transformer (`TINY_TI2V`) from a T2V one.
TINY_VAE_22 = dict(base_dim=8, decoder_base_dim=12, z_dim=48, dim_mult=[1, 2, 2, 2],
                   num_res_blocks=2, temperal_downsample=[False, True, True], is_residual=True,
                   patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16)


def build_tiny(seed=0, **overrides):
  """A random diffusers `WanTransformer3DModel` (float32, eval mode); `**TINY_I2V` for I2V."""
  from diffusers import WanTransformer3DModel
  return tiny.build(WanTransformer3DModel, seed, **{**TINY_WAN, **overrides})


def build_tiny_vae(seed=0, wan22=False):
  """A random `AutoencoderKLWan` (float32, eval mode) of Wan 2.1's form, or 2.2's; its latent
  statistics random too (they are config lists, not weights)."""
  from diffusers import AutoencoderKLWan
  config = TINY_VAE_22 if wan22 else TINY_VAE
  rng = np.random.default_rng(seed)
  z = config["z_dim"]
  stats = dict(latents_mean=[round(float(x), 4) for x in rng.normal(0, 0.5, z)],
               latents_std=[round(float(x), 4) for x in rng.uniform(0.5, 3.0, z)])
  return tiny.build(AutoencoderKLWan, seed, **config, **stats)


PREFIX = "model.diffusion_model."  # of the transformer in some of ComfyUI's files
ORIGINAL_STEM = "diffusion_pytorch_model"  # Wan-AI's file names (as a diffusers folder's)
# Wan-AI's config.json `model_type` by how the model is given a first frame
ORIGINAL_MODEL_TYPES = {"channels": "i2v", "clean": "ti2v", "": "t2v"}


def original_tensors(model):
  """The transformer's tensors under Wan's original names (numpy float32), through the
  family's table (tests/test_wan_encoders.py runs diffusers' own converter on them)."""
  return wan_model.original_tensors(tiny.state_dict_numpy(model))


def original_model_type(config):
  """Wan-AI's config.json `model_type` of a diffusers transformer config: i2v, ti2v or t2v
  (`models.wan.first_frame_input`)."""
  return ORIGINAL_MODEL_TYPES[wan_model.first_frame_input(wan_model.config_from_diffusers(dict(config)))]


def original_config(model, model_type=None):
  """The transformer's config.json as Wan-AI ships it beside the original weights."""
  c = model.config
  return {"_class_name": "WanModel", "_diffusers_version": "0.30.0",
          "dim": c.num_attention_heads * c.attention_head_dim, "eps": c.eps, "ffn_dim": c.ffn_dim,
          "freq_dim": c.freq_dim, "in_dim": c.in_channels,
          "model_type": model_type or original_model_type(c), "num_heads": c.num_attention_heads,
          "num_layers": c.num_layers, "out_dim": c.out_channels, "text_len": wan_model.TEXT_TOKENS}


def write_sharded(tensors, folder, shards, stem=ORIGINAL_STEM):
  """Writes `tensors` in order as `shards` safetensors files `<stem>-0000i-of-0000n.safetensors`
  of about equal size, with the index `<stem>.safetensors.index.json` that maps each tensor to
  its file (Hugging Face's sharded form, which Wan-AI's 14B folders use)."""
  os.makedirs(folder, exist_ok=True)
  total = sum(v.nbytes for v in tensors.values())
  groups, size = [[] for _ in range(shards)], 0
  for key, value in tensors.items():
    groups[min(shards - 1, size * shards // max(total, 1))].append(key)
    size += value.nbytes
  weight_map = {}
  for i, keys in enumerate(groups):
    name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
    write_safetensors({k: tensors[k] for k in keys}, os.path.join(folder, name))
    weight_map.update(dict.fromkeys(keys, name))
  with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return folder


def save_original(model, folder, model_type=None, shards=3):
  """Writes Wan-AI's original transformer folder: its config.json and the weights under Wan's
  names, sharded with an index."""
  write_sharded(original_tensors(model), folder, shards)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(original_config(model, model_type), f, indent=2)
  return folder


def is_block_linear(key, value):
  """A block's Linear weight: what ComfyUI's fp8_e4m3fn files store in float8."""
  return key.startswith("blocks.") and key.endswith(".weight") and value.ndim == 2


def comfyui_metadata(config):
  """A ComfyUI file's metadata: a head size other than the released 128 as `num_heads`, which
  the loader reads (the weights do not show it); released files need none."""
  return (None if config.attention_head_dim == wan_model.RELEASED_HEAD_DIM
          else {"num_heads": str(config.num_attention_heads)})


def save_comfyui(model, path, prefix="", float8=False):
  """Writes ComfyUI's single file: Wan's original names, optionally prefixed; float32, or as
  its fp8_e4m3fn files: the blocks' Linear weights in float8 e4m3fn (scale 1), the rest bf16;
  `comfyui_metadata`."""
  import ml_dtypes
  tensors = original_tensors(model)
  if float8:
    tensors = {k: v.astype(ml_dtypes.float8_e4m3fn if is_block_linear(k, v) else ml_dtypes.bfloat16)
               for k, v in tensors.items()}
  write_safetensors({prefix + k: v for k, v in tensors.items()}, path,
                    metadata=comfyui_metadata(model.config))
  return path


def save_tiny(model, root, model_type=None) -> dict:
  """`model` in every format `models.load` takes: a diffusers folder (one file, and sharded
  with an index), Wan-AI's original folder, and ComfyUI's single file (unprefixed, prefixed).
  `model_type`: the original config's (derived from the channels if not given)."""
  kind = model_type or original_model_type(model.config)
  comfyui = lambda name: os.path.join(root, f"wan2.1_{kind}_tiny_{name}.safetensors")
  return dict(diffusers=tiny.save_diffusers(model, os.path.join(root, "pipeline")),
              diffusers_sharded=tiny.save_diffusers(model, os.path.join(root, "sharded"),
                                                    max_shard_size="100KB"),
              original=save_original(model, os.path.join(root, f"Wan2.1-{kind}-tiny"), kind),
              single_file=save_comfyui(model, comfyui("fp32")),
              single_file_prefixed=save_comfyui(model, comfyui("comfy_fp32"), PREFIX))


TINY_KINDS = ("", "i2v", "ti2v")  # Wan 2.1 T2V, 2.1 I2V, 2.2 TI2V 5B
# A CLIP vision encoder for the I2V pipeline: the tiny I2V transformer's image width, an odd
# head count, 32-pixel images of 8-pixel patches (17 tokens)
TINY_CLIP = dict(hidden_size=TINY_I2V["image_dim"], intermediate_size=40, num_hidden_layers=3,
                 num_attention_heads=3, image_size=32, patch_size=8, projection_dim=16)


def write_tiny_pipeline(root, seed=0, kind=""):
  """Writes a complete tiny Wan pipeline folder with the real classes (transformer, VAE, UMT5,
  tokenizer, the released UniPC scheduler), for caching and
  end-to-end tests: `kind` "" a 2.1 T2V `WanPipeline`; "i2v" a 2.1 I2V
  `WanImageToVideoPipeline` (with a CLIP vision encoder and its image processor); "ti2v" a
  2.2 TI2V 5B `WanPipeline` (the 2.2 VAE, per-token timesteps). Returns root."""
  from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
  overrides = dict(zip(TINY_KINDS, ({}, TINY_I2V, TINY_TI2V)))[kind]
  transformer, vae = build_tiny(seed, **overrides), build_tiny_vae(seed + 1, wan22=kind == "ti2v")
  assert transformer.config.out_channels == vae.config.z_dim
  tokenizer = tiny.t5_tokenizer()
  parts = dict(tokenizer=tokenizer, vae=vae, transformer=transformer,
               text_encoder=tiny.umt5_encoder(tokenizer, transformer.config.text_dim, seed + 2),
               scheduler=UniPCMultistepScheduler(**{
                   k: v for k, v in wan_model.RELEASED_SCHEDULER.items() if k != "_class_name"}))
  if kind == "i2v":
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel
    side = TINY_CLIP["image_size"]
    pipeline = WanImageToVideoPipeline(
        **parts, image_encoder=tiny.build(CLIPVisionModel, seed + 3, CLIPVisionConfig(**TINY_CLIP)),
        image_processor=CLIPImageProcessor(size={"shortest_edge": side},
                                           crop_size={"height": side, "width": side}))
  else:
    pipeline = WanPipeline(**parts, expand_timesteps=kind == "ti2v")
  pipeline.save_pretrained(root)
  return root


def trained_config(model_config):
  """The config of the transformer a run trains (read from its files' config or headers)."""
  from diffpipe_jax import models
  return models.checkpoint_config("wan", wan_model.FAMILY.checkpoint_path(model_config))


TORCH_SIDE = TorchSide(
    load_encoders=lambda model_config, **kw: WanEncoders.load(
        model_config.diffusers_path, frame_rate=model_config.frame_rate,
        trained_config=lambda: trained_config(model_config), **kw),
    write_tiny_pipeline=write_tiny_pipeline,
    tiny_kinds=TINY_KINDS,
    build_tiny=build_tiny,
    save_tiny=save_tiny,
    pipeline="WanPipeline",
)
