"""Wan 2.1 / 2.2's PyTorch side: its encoders for caching (Wan VAE latents, unpacked and normalised
per channel; UMT5 text embeddings zeroed after each prompt's length; an I2V model's CLIP image
states), read from a diffusers folder, Wan-AI's original folder (the T5, VAE and CLIP .pth under
Wan's own names, google/umt5-xxl/) or ComfyUI's UMT5 file; and the tiny random pipeline and
checkpoints for tests and the embedded default, built with the real diffusers and transformers
classes and saved in the real on-disk formats: a diffusers folder, Wan-AI's original folder
(config.json and sharded safetensors under Wan's own names, and its encoders' files), and
ComfyUI's single files."""
import json
import math
import os
import re

import numpy as np

from diffpipe_jax import tiny
from diffpipe_jax.convert import table
from diffpipe_jax.convert.table import Row
from diffpipe_jax.convert.tensorfile import (TORCH_PICKLE_SUFFIXES, open_tensor_file,
                                             torch_state_dict, write_safetensors)
from diffpipe_jax.encoders import Encoders, default_device, find_source
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import TorchSide
from diffpipe_jax.models import wan as wan_model


class WanEncoders(Encoders):
  """Wan: AutoencoderKLWan latents (8x spatial and 4x temporal for 2.1 and the 2.2 A14B, 16x
  spatial for the 2.2 TI2V 5B's VAE; 1 + 4k frames), unpacked; UMT5 last hidden state, zeroed
  after each prompt's tokens. Both run in `dtype`, as the other families' encoders. For an I2V
  transformer also the first frame's condition latents and, where it has an image embedder
  (2.1 I2V), the first frame's CLIP states (`encode_fields`). Each component loads from the
  first of ComfyUI's UMT5 file, Wan-AI's folder and a diffusers folder that has it (`sources`:
  diffusers subfolder name -> the folder or file it loads from)."""
  components = {"vae": ("vae", "AutoencoderKLWan"),
                "tokenizer": ("tokenizer", "AutoTokenizer"),
                "text_encoder": ("umt5", "UMT5EncoderModel")}
  # an I2V transformer's with an image embedder (2.1 I2V), loaded with the VAE
  IMAGE_COMPONENTS = {"image_encoder": ("clip", "CLIPVisionModel"),
                      "image_processor": ("clip_processor", "CLIPImageProcessor")}

  def __init__(self, path, device, dtype, options, frame_rate, vae_config, transformer, sources,
               clip_config=None):
    super().__init__(path, device, dtype, options)
    self.frame_rate, self.vae_config, self.sources = frame_rate, vae_config, sources
    self.clip_config = clip_config  # of Wan-AI's CLIP file (`read_clip_config`); None: a folder's
    self.patch_size = tuple(transformer.patch_size)
    self.first_frame = wan_model.first_frame_input(transformer)
    if transformer.image_dim is not None:
      self.components = {**self.components, **self.IMAGE_COMPONENTS}
      self.media_components = ("vae", *(attr for attr, _ in self.IMAGE_COMPONENTS.values()))

  @property
  def takes_first_frame(self):
    return self.first_frame in ("channels", "clean")

  @property
  def needs_first_frame(self):
    """An I2V transformer's input channels take a first frame; the TI2V 5B draws from text alone
    too."""
    return self.first_frame == "channels"

  @classmethod
  def load(cls, diffusers_path="", ckpt_path="", llm_path="", device=None, dtype=None,
           max_sequence_length=wan_model.TEXT_TOKENS, frame_rate=0, trained_config=None):
    """The encoders (loaded when first needed) from the keys diffusion-pipe uses, each component
    from the first that has it (`source_rows`): llm_path (the UMT5 only), then ckpt_path (Wan-AI's
    folder), then diffusers_path; the text encoder in float32 on CPU, bfloat16 on CUDA unless
    told. `frame_rate`: videos' (0: the model's, 16 for Wan 2.1, 24 for the 2.2 TI2V 5B);
    `trained_config()`: the config of the transformer trained (default: the folder's), which
    says what the cache holds besides latents and text and which of Wan-AI's VAEs it takes,
    read once the folders are known to exist."""
    import torch
    from diffusers.utils import is_ftfy_available
    keys = dict(diffusers_path=diffusers_path, ckpt_path=ckpt_path, llm_path=llm_path)
    if not diffusers_path and not ckpt_path:
      raise UserError("caching needs model.diffusers_path (a diffusers Wan folder) or "
                      "model.ckpt_path (Wan-AI's folder) for the UMT5 text encoder, its tokenizer "
                      "and the VAE")
    for key, value in keys.items():
      if value and not os.path.exists(value):
        raise UserError(f"model.{key} {value} does not exist: set it to {WHAT[key]}")
    if llm_path and not os.path.isfile(llm_path):
      raise UserError(f"model.llm_path {llm_path} is a folder: set it to {WHAT['llm_path']}")
    transformer = trained_config() if trained_config is not None else folder_config(keys)
    rows = source_rows(transformer)
    found = {sub: find_source(keys, rows[sub]) for sub in cls.components}
    missing = [sub for sub, source in found.items() if source is None]
    if missing:
      raise missing_error(keys, missing, rows)
    if transformer.image_dim:
      found.update({sub: find_source(keys, rows[sub]) for sub in cls.IMAGE_COMPONENTS})
      missing = [sub for sub in cls.IMAGE_COMPONENTS if found[sub] is None]
      if missing:
        raise missing_error(keys, missing, rows, WHAT_I2V)
    sources = {sub: path for sub, (_, path) in found.items()}
    vae_config = read_vae_config(sources["vae"])
    clip = sources.get("image_encoder")
    clip_config = read_clip_config(clip) if clip and os.path.isfile(clip) else None
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    # whether ftfy repairs the captions (WanPipeline's prompt_clean uses it where installed)
    # changes the embeddings of some, so it is part of the cache's fingerprint
    clean = "ftfy+html+whitespace" if is_ftfy_available() else "html+whitespace"
    options = dict(max_sequence_length=max_sequence_length, prompt_clean=clean)
    first_frame = wan_model.first_frame_input(transformer)
    if first_frame == "channels":  # the cache holds the condition (and CLIP states): its fingerprint
      options["first_frame"] = "latents+clip" if transformer.image_dim else "latents"
    used = ", ".join(dict.fromkeys(keys[key] for key, _ in found.values()))
    return cls(used, device, dtype, options, frame_rate or wan_model.frame_rate(transformer),
               vae_config, transformer, sources, clip_config)

  def load_media_encoders(self):
    """The VAE, and an I2V model's CLIP vision encoder (float32, as WanImageToVideoPipeline's
    users load it) with its image processor: a diffusers folder's, or Wan-AI's CLIP file
    (`load_clip_file`) with the released processor (`clip_processor`)."""
    super().load_media_encoders()
    if "image_encoder" in self.components:
      import torch
      from transformers import CLIPImageProcessor, CLIPVisionModel
      source = self.sources["image_encoder"]
      if self.clip_config is None:
        self.clip_processor = CLIPImageProcessor.from_pretrained(self.sources["image_processor"])
        clip = CLIPVisionModel.from_pretrained(source, dtype=torch.float32)
      else:
        self.clip_processor = clip_processor(self.clip_config.image_size)
        clip = load_clip_file(source, self.clip_config)
      self.clip = clip.to(self.device).eval()

  def load_vae(self):
    from diffusers import AutoencoderKLWan
    source = self.sources["vae"]
    vae = (AutoencoderKLWan.from_pretrained(source, torch_dtype=self.dtype) if os.path.isdir(source)
           else load_original_vae(source, self.vae_config, self.dtype))
    # whole clips in one pass (diffusers' default): tiles are blended at their seams, which
    # changes the latents
    vae.use_tiling = vae.use_slicing = False
    return vae

  def load_text_encoders(self):
    from transformers import AutoTokenizer, UMT5EncoderModel
    self.tokenizer = AutoTokenizer.from_pretrained(self.sources["tokenizer"])
    source = self.sources["text_encoder"]
    umt5 = (UMT5EncoderModel.from_pretrained(source, dtype=self.dtype) if os.path.isdir(source)
            else load_umt5_file(source, self.dtype))
    self.umt5 = umt5.to(self.device).eval()

  def component_source(self, sub):
    return self.sources[sub]

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
    if self.needs_first_frame:
      fields.update(self.first_frame_fields(pixels[:, 0], pixels.shape[1]))
    return fields

  def first_frame_fields(self, images, frames) -> dict:
    """What the transformer is given of first frames `images` (np [N, H, W, 3] in [-1, 1]) for
    clips of `frames` frames, as WanImageToVideoPipeline makes it. An I2V transformer:
    `condition`, the latents of the frame followed by black frames (its `video_condition`; an
    image's are its latents), and, where it has an image embedder, `image`, the frame's CLIP
    states. The TI2V 5B: `first_frame`, the frame's latents, which replace the first latent
    frame (`expand_timesteps`)."""
    if self.first_frame == "clean":
      return dict(first_frame=self.encode_media(images[:, None]))
    video = np.zeros((len(images), frames, *images.shape[1:]), np.float32)
    video[:, 0] = images
    fields = dict(condition=self.encode_media(video))
    if "image_encoder" in self.components:
      fields["image"] = self.encode_image(images)
    return fields

  def encode_image(self, frames):
    """np [B, H, W, 3] in [-1, 1] -> CLIP's penultimate hidden states [B, I, image_dim], as
    WanImageToVideoPipeline's `encode_image` makes them from the frames as 8-bit images. The
    first hidden state is the pre-norm's output (the blocks' input), so the penultimate is that
    of every block but the last after the pre-norm: Wan's `use_31_block` of its 32."""
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


# Wan-AI's released folder (model.ckpt_path): its encoders' files, relative to it (Wan2.1
# `wan/configs/wan_i2v_14B.py`'s `clip_checkpoint` for the CLIP)
ORIGINAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
ORIGINAL_TOKENIZER = "google/umt5-xxl"
ORIGINAL_VAES = {False: "Wan2.1_VAE.pth", True: "Wan2.2_VAE.pth"}  # by: is it the 2.2 TI2V 5B?
ORIGINAL_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
WHAT = {"diffusers_path": "a diffusers Wan pipeline folder (with vae/, text_encoder/, tokenizer/)",
        "ckpt_path": f"Wan-AI's folder (with {ORIGINAL_T5}, {ORIGINAL_TOKENIZER}/ and its VAE .pth)",
        "llm_path": "ComfyUI's UMT5 file (umt5_xxl_fp16.safetensors or umt5_xxl_fp8_e4m3fn_scaled"
                    ".safetensors), or leave it empty"}
# what an I2V transformer with an image embedder (2.1 I2V) needs besides
WHAT_I2V = {"diffusers_path": "a diffusers Wan I2V pipeline folder (with image_encoder/, "
                              "image_processor/: the transformer attends to CLIP image states)",
            "ckpt_path": f"Wan-AI's I2V folder (with {ORIGINAL_CLIP} too)"}


def source_rows(transformer) -> dict:
  """Where each component is found, by the config key that says it, in precedence order
  (`encoders.find_source`): ComfyUI's UMT5 file, then Wan-AI's folder (the VAE its transformer
  takes: the 2.2 VAE for the TI2V 5B's 48 latent channels), then a diffusers folder. CLIP's
  encoder and image processor come from the same place: Wan-AI's CLIP file gives both."""
  vae = ORIGINAL_VAES[transformer.out_channels == wan_model.WAN22_Z]
  return {"vae": (("ckpt_path", vae), ("diffusers_path", "vae")),
          "tokenizer": (("ckpt_path", ORIGINAL_TOKENIZER), ("diffusers_path", "tokenizer")),
          "text_encoder": (("llm_path", ""), ("ckpt_path", ORIGINAL_T5),
                           ("diffusers_path", "text_encoder")),
          **{sub: (("ckpt_path", ORIGINAL_CLIP), ("diffusers_path", sub))
             for sub in WanEncoders.IMAGE_COMPONENTS}}


def folder_config(keys) -> wan_model.WanConfig:
  """The transformer config of Wan-AI's folder (its config.json), else of the diffusers folder
  (the released patch where it has no transformer/, as WanPipeline assumes)."""
  from diffpipe_jax import models
  if keys["ckpt_path"]:
    return models.checkpoint_config("wan", keys["ckpt_path"])
  config = os.path.join(keys["diffusers_path"], "transformer", "config.json")
  if not os.path.isfile(config):
    return wan_model.WanConfig()
  with open(config) as f:
    return wan_model.config_from_diffusers(json.load(f))


def missing_error(keys, missing, rows, what=WHAT) -> UserError:
  """One line: the folders that lack components (diffusers subfolder names: the files Wan-AI's
  folder would have) and the keys that would give them (`what` they must be)."""
  ckpt, diffusers = keys["ckpt_path"], keys["diffusers_path"]
  if not ckpt:
    return UserError(f"{diffusers} lacks the encoder folder(s) {missing}: model.diffusers_path "
                     f"must be {what['diffusers_path']}, or set model.ckpt_path to {what['ckpt_path']}")
  files = list(dict.fromkeys(dict(rows[sub]).get("ckpt_path", sub) for sub in missing))
  return UserError(f"{ckpt} lacks {files}{f' and {diffusers} lacks {missing}' if diffusers else ''}: "
                   f"model.ckpt_path must be {what['ckpt_path']}, or set model.diffusers_path to "
                   f"{what['diffusers_path']}")


def read_vae_config(source):
  """The VAE's config without loading it, its missing keys filled with AutoencoderKLWan's
  defaults as diffusers fills them (the 2.1 folders' configs predate `scale_factor_spatial`):
  a diffusers folder's config.json, or Wan-AI's file's (`original_vae_config`)."""
  import inspect
  from diffusers import AutoencoderKLWan
  parameters = inspect.signature(AutoencoderKLWan.__init__).parameters.values()
  defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
  if os.path.isfile(source):
    return {**defaults, **original_vae_config(open_tensor_file(source).shapes(), source, defaults)}
  path = os.path.join(source, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"{source} has no config.json: model.diffusers_path must be a diffusers Wan "
                    "pipeline folder, its vae/ as saved by diffusers")
  with open(path) as f:
    return {**defaults, **json.load(f)}


# The latent statistics of Wan-AI's VAEs by latent channels, which their files do not hold (Wan's
# code does): the 2.2 VAE's (Wan2.2 `wan/modules/vae2_2.py`, `Wan2_2_VAE`); 2.1's are
# AutoencoderKLWan's defaults (`latent_statistics`).
LATENT_STATISTICS = {wan_model.WAN22_Z: dict(
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382,
                  0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207,
                  -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109,
                  0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
                  -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573,
                  -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344,
                 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804,
                 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999,
                 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744])}


def latent_statistics(z_dim, path, defaults):
  """The released statistics of a Wan-AI VAE of `z_dim` latent channels: 2.1's (16, diffusers'
  defaults) or 2.2's (48); another VAE's are unknown."""
  released = {len(defaults["latents_mean"]): {k: defaults[k] for k in ("latents_mean", "latents_std")},
              **LATENT_STATISTICS}
  if z_dim not in released:
    raise UserError(f"{path} is a VAE of {z_dim} latent channels, whose latent statistics no "
                    "released Wan VAE has: give Wan2.1_VAE.pth or Wan2.2_VAE.pth, or a diffusers "
                    "folder's vae/ (model.diffusers_path)")
  return released[z_dim]


def original_vae_config(shapes, path, defaults) -> dict:
  """AutoencoderKLWan keyword arguments from the tensor shapes of Wan's VAE file (Wan's names:
  2.1's stages one flat `downsamples` list, each ending at its resample; 2.2's nested, each
  `downsamples.i.downsamples.j`), with the released latent statistics."""
  residual = any(k.startswith("encoder.downsamples.0.downsamples.") for k in shapes)
  units = lambda prefix: sorted({int(k[len(prefix):].split(".")[0]) for k in shapes if k.startswith(prefix)})
  if residual:
    stages = [[f"encoder.downsamples.{i}.downsamples.{j}"
               for j in units(f"encoder.downsamples.{i}.downsamples.")]
              for i in units("encoder.downsamples.")]
  else:
    stages = [[]]
    for n in units("encoder.downsamples."):
      stages[-1].append(f"encoder.downsamples.{n}")
      if f"encoder.downsamples.{n}.resample.1.weight" in shapes:
        stages.append([])
  try:
    base, in_channels = shapes["encoder.conv1.weight"][:2]
    resnets = [[u for u in stage if f"{u}.residual.2.weight" in shapes] for stage in stages]
    resamples = [u for stage in stages for u in stage if f"{u}.resample.1.weight" in shapes]
    dim_mult = [shapes[f"{stage[0]}.residual.2.weight"][0] // base for stage in resnets]
    temporal = [f"{u}.time_conv.weight" in shapes for u in resamples]
    z_dim, decoder_dim = shapes["conv2.weight"][0], shapes["decoder.conv1.weight"][0]
    out_channels = shapes["decoder.head.2.weight"][0]
  except (KeyError, IndexError) as e:
    raise UserError(f"{path} is no Wan VAE (it lacks {e}): model.ckpt_path must be "
                    f"{WHAT['ckpt_path']}") from None
  patch = math.isqrt(in_channels // 3)  # 2.2's pixels come in 2x2 patches (12 channels)
  decoder_base = decoder_dim // dim_mult[-1]
  return dict(base_dim=base, decoder_base_dim=None if decoder_base == base else decoder_base,
              z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=len(resnets[0]),
              temperal_downsample=temporal, is_residual=residual, in_channels=in_channels,
              out_channels=out_channels, patch_size=patch if patch > 1 else None,
              scale_factor_temporal=2 ** sum(temporal),
              scale_factor_spatial=2 ** len(resamples) * patch,
              **latent_statistics(z_dim, path, defaults))


# diffusers' AutoencoderKLWan names -> Wan's (`wan/modules/vae.py` of Wan2.1, `vae2_2.py` of
# Wan2.2): a resnet's layers (Wan's `residual` Sequential: RMS norm, SiLU, conv, RMS norm, SiLU,
# dropout, conv), then the modules around the stages.
VAE_RESNET_LAYERS = ((".norm1.gamma", ".residual.0.gamma"), (".conv1.", ".residual.2."),
                     (".norm2.gamma", ".residual.3.gamma"), (".conv2.", ".residual.6."),
                     (".conv_shortcut.", ".shortcut."))
VAE_MODULES = {"quant_conv": "conv1", "post_quant_conv": "conv2",
               **{f"{side}.{ours}": f"{side}.{theirs}" for side in ("encoder", "decoder")
                  for ours, theirs in (("conv_in", "conv1"), ("norm_out", "head.0"),
                                       ("conv_out", "head.2"), ("mid_block.resnets.0", "middle.0"),
                                       ("mid_block.attentions.0", "middle.1"),
                                       ("mid_block.resnets.1", "middle.2"))}}


def original_vae_key(key, config) -> str:
  """A diffusers AutoencoderKLWan name -> Wan's. A stage of 2.1's flat lists is its resnets then
  its resample: the encoder's are diffusers' own list, the decoder's `num_res_blocks` + 1 resnets
  and an upsampler a stage; 2.2 nests them (`downsamples.i.downsamples.j`, the resample last)."""
  for ours, theirs in VAE_RESNET_LAYERS:
    key = key.replace(ours, theirs)
  n = config["num_res_blocks"]

  def down(m):
    return f"encoder.downsamples.{m[1]}.downsamples.{n if m[3] else m[2]}."

  def up(m):
    stage, index = int(m[1]), n + 1 if m[3] else int(m[2])
    return (f"decoder.upsamples.{stage}.upsamples.{index}." if config["is_residual"]
            else f"decoder.upsamples.{stage * (n + 2) + index}.")
  key = re.sub(r"^encoder\.down_blocks\.(\d+)\.(?:resnets\.(\d+)|(downsampler))\.", down, key)
  key = re.sub(r"^encoder\.down_blocks\.", "encoder.downsamples.", key)
  key = re.sub(r"^decoder\.up_blocks\.(\d+)\.(?:resnets\.(\d+)|(upsampler|upsamplers\.0))\.", up, key)
  module = next((m for m in VAE_MODULES if key.startswith(m + ".")), None)
  return key if module is None else VAE_MODULES[module] + key[len(module):]


def load_original_vae(path, config, dtype):
  """Wan-AI's VAE file as AutoencoderKLWan (built on the meta device and given the file's
  tensors, renamed by `original_vae_key`: no random init to overwrite)."""
  import torch
  from diffusers import AutoencoderKLWan
  with torch.device("meta"):
    vae = AutoencoderKLWan(**config)
  names = {original_vae_key(k, config): k for k in vae.state_dict()}
  tensors = torch_state_dict(path)
  state = {names.get(k, k): v.to(dtype) for k, v in tensors.items()}
  return load_checked(vae, state, path, "a Wan VAE of the architecture its shapes say")


def load_checked(model, state, path, what):
  """`model` (on the meta device) given `state`, every tensor of both accounted for, or a
  one-line error naming the file."""
  missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
  check_loaded(missing, unexpected, path, what)
  return model


def check_loaded(missing, unexpected, path, what):
  """A one-line error naming the file where a tensor of the model or of the file was not matched."""
  if missing or unexpected:
    raise UserError(f"{path} is not {what}: missing {missing[:3]}, unexpected {unexpected[:3]}; "
                    "give the released file")


# Wan's T5 encoder (`wan/modules/t5.py` of Wan2.1: `T5Encoder` with `shared_pos=False`, as
# `umt5_xxl` builds it) -> transformers' UMT5EncoderModel, module by module. Wan's feed-forward
# is `fc1(x) * gate(x)`, `gate` a Linear then GELU: transformers' `wi_1` and `wi_0`. The table
# reads both ways: Wan-AI's file loads through it, and the tiny one is written through it.
_T5 = "encoder.block.{i}.layer."
UMT5_ROWS = (
    Row("token_embedding", ("shared",)),
    Row("blocks.{i}.norm1", (_T5 + "0.layer_norm",)),
    *(Row(f"blocks.{{i}}.attn.{x}", (f"{_T5}0.SelfAttention.{x}",)) for x in "qkvo"),
    Row("blocks.{i}.pos_embedding.embedding", (_T5 + "0.SelfAttention.relative_attention_bias",)),
    Row("blocks.{i}.norm2", (_T5 + "1.layer_norm",)),
    Row("blocks.{i}.ffn.gate.0", (_T5 + "1.DenseReluDense.wi_0",)),
    Row("blocks.{i}.ffn.fc1", (_T5 + "1.DenseReluDense.wi_1",)),
    Row("blocks.{i}.ffn.fc2", (_T5 + "1.DenseReluDense.wo",)),
    Row("norm", ("encoder.final_layer_norm",)),
)
TIED_EMBEDDING = "encoder.embed_tokens.weight"  # transformers' second name of `shared.weight`
# ComfyUI's "scaled" float8 files: a marker tensor, and per Linear a float32 `scale_weight` (the
# weight is float8 times it) and a `scale_input` for float8 matmuls (unused here)
SCALED_FP8_MARKER, WEIGHT_SCALE, INPUT_SCALE = "scaled_fp8", "scale_weight", "scale_input"


def dequantized(tensors) -> dict:
  """A ComfyUI file's tensors with each weight that has a `scale_weight` multiplied by it (in
  float32), the scales and the marker dropped; other tensors as they are."""
  scales = {k[:-len(WEIGHT_SCALE)] + "weight": v for k, v in tensors.items() if k.endswith("." + WEIGHT_SCALE)}
  return {k: v.float() * scales[k].float() if k in scales else v for k, v in tensors.items()
          if k != SCALED_FP8_MARKER and not k.endswith(("." + WEIGHT_SCALE, "." + INPUT_SCALE))}


def umt5_tensors(path) -> dict:
  """UMT5 encoder tensors under transformers' names from Wan-AI's .pth (Wan's names,
  `UMT5_ROWS`) or ComfyUI's safetensors (transformers' names, their `encoder.` prefix possibly
  left out; float8 ones dequantised), the tied embedding under both its names."""
  from safetensors.torch import load_file
  if path.endswith(TORCH_PICKLE_SUFFIXES):
    wan = torch_state_dict(path)
    names = {k: parts[0] for k, parts in table.part_names(wan, UMT5_ROWS).items()}
    tensors = {names.get(k, k): v for k, v in wan.items()}
  else:
    tensors = {k if k.startswith(("encoder.", "shared.")) else "encoder." + k: v
               for k, v in dequantized(load_file(path)).items()}
  embedding = tensors.get("shared.weight", tensors.get(TIED_EMBEDDING))
  if embedding is None:
    raise UserError(f"{path} holds no UMT5 token embedding (shared.weight): model.llm_path must "
                    f"be {WHAT['llm_path']}")
  return {**tensors, "shared.weight": embedding, TIED_EMBEDDING: embedding}


def umt5_config(shapes):
  """A UMT5 encoder's config from its tensor shapes (transformers' names): the released
  UMT5-XXL's form (gated GELU, a relative attention bias in every layer, transformers' defaults
  for what shapes do not show: 128 positions' reach, 1e-6 norm epsilon, as Wan's T5)."""
  from transformers import UMT5Config
  layer = _T5.format(i=0)
  vocab, width = shapes["shared.weight"]
  buckets, heads = shapes[layer + "0.SelfAttention.relative_attention_bias.weight"]
  return UMT5Config(vocab_size=vocab, d_model=width, num_heads=heads,
                    d_kv=shapes[layer + "0.SelfAttention.q.weight"][0] // heads,
                    d_ff=shapes[layer + "1.DenseReluDense.wi_0.weight"][0],
                    num_layers=len({k.split(".")[2] for k in shapes if k.startswith("encoder.block.")}),
                    relative_attention_num_buckets=buckets, feed_forward_proj="gated-gelu")


def load_umt5_file(path, dtype):
  """UMT5EncoderModel from Wan-AI's T5 .pth or ComfyUI's UMT5 safetensors (`umt5_tensors`)."""
  import torch
  from transformers import UMT5EncoderModel
  tensors = umt5_tensors(path)
  try:
    config = umt5_config({k: tuple(v.shape) for k, v in tensors.items()})
  except KeyError as e:
    raise UserError(f"{path} is no UMT5 encoder (it lacks {e}): give {ORIGINAL_T5} or "
                    f"{WHAT['llm_path']}") from None
  with torch.device("meta"):
    umt5 = UMT5EncoderModel(config)
  return load_checked(umt5, {k: v.to(dtype) for k, v in tensors.items()}, path, "a UMT5 encoder")


# Wan's CLIP (`wan/modules/clip.py` of Wan2.1: `XLMRobertaCLIP` as `clip_xlm_roberta_vit_h_14`
# builds it; its file is that module's state dict) keeps the vision tower, a `VisionTransformer`,
# under `visual.`: patch embedding (no bias, as pre-norm), class and position embeddings, the
# pre-norm, pre-norm blocks (`norm1`, fused `attn.to_qkv` viewed as [3, heads, head size] rows,
# `attn.proj`, `norm2`, `mlp` Linear-GELU-Linear-Dropout) and `post_norm`. -> transformers'
# CLIPVisionModel, module by module. The table reads both ways: Wan-AI's file loads through it,
# and the tiny one is written through it.
_CLIP = "encoder.layers.{i}."
CLIP_ROWS = (
    Row("visual.patch_embedding", ("embeddings.patch_embedding",)),
    Row("visual", ("embeddings",), params=(("class_embedding", "cls_embedding"),)),
    Row("visual", ("embeddings.position_embedding",), params=(("weight", "pos_embedding"),)),
    Row("visual.pre_norm", ("pre_layrnorm",)),
    Row("visual.transformer.{i}.norm1", (_CLIP + "layer_norm1",)),
    Row("visual.transformer.{i}.attn.to_qkv", tuple(_CLIP + f"self_attn.{x}_proj" for x in "qkv")),
    Row("visual.transformer.{i}.attn.proj", (_CLIP + "self_attn.out_proj",)),
    Row("visual.transformer.{i}.norm2", (_CLIP + "layer_norm2",)),
    Row("visual.transformer.{i}.mlp.0", (_CLIP + "mlp.fc1",)),
    Row("visual.transformer.{i}.mlp.2", (_CLIP + "mlp.fc2",)),
    Row("visual.post_norm", ("post_layernorm",)),
)
# Wan's embeddings carry leading unit axes: the class embedding [1, 1, D], the positions' [1, N, D]
CLIP_UNIT_AXES = {"visual.cls_embedding": 2, "visual.pos_embedding": 1}
# the tower's projection to the joint image-text space, which CLIPVisionModel lacks (the
# pipelines take hidden states); the rest of the file (`textual.`, `log_scale`) is XLM-R's side
CLIP_PROJECTION = "visual.head"
# What the file's shapes do not show, as `clip_xlm_roberta_vit_h_14` sets it and the released
# diffusers image_encoder/config.json (laion's CLIP-ViT-H-14) says: 16 heads of 80 (1280 wide),
# exact GELU (`activation='gelu'`, not QuickGELU), the norms' 1e-5 epsilon.
CLIP_HEAD_DIM, CLIP_ACTIVATION, CLIP_NORM_EPS = 80, "gelu", 1e-5


def clip_vision_config(shapes, path):
  """transformers' CLIPVisionConfig of Wan's CLIP file from its tensor shapes (Wan's names): the
  width, channels and patch from the patch embedding, the image side from the position count
  (the class token's and a square of patches), the blocks and MLP width; heads of
  `CLIP_HEAD_DIM`."""
  from transformers import CLIPVisionConfig
  try:
    width, channels, patch = shapes["visual.patch_embedding.weight"][:3]
    positions = shapes["visual.pos_embedding"][1]
    intermediate = shapes["visual.transformer.0.mlp.0.weight"][0]
  except KeyError as e:
    raise UserError(f"{path} holds no CLIP vision tower (it lacks {e}): model.ckpt_path must be "
                    f"{WHAT_I2V['ckpt_path']}, or set model.diffusers_path to "
                    f"{WHAT_I2V['diffusers_path']}") from None
  if width % CLIP_HEAD_DIM:
    raise UserError(f"{path} is a CLIP vision tower {width} wide, not heads of {CLIP_HEAD_DIM} as "
                    f"Wan's: give {ORIGINAL_CLIP}, or set model.diffusers_path to "
                    f"{WHAT_I2V['diffusers_path']}")
  layers = len({k.split(".")[2] for k in shapes if k.startswith("visual.transformer.")})
  return CLIPVisionConfig(hidden_size=width, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=width // CLIP_HEAD_DIM,
                          num_channels=channels, patch_size=patch,
                          image_size=math.isqrt(positions - 1) * patch,
                          hidden_act=CLIP_ACTIVATION, layer_norm_eps=CLIP_NORM_EPS)


def read_clip_config(path):
  """The config of Wan-AI's CLIP file (`clip_vision_config`), without reading its tensors."""
  return clip_vision_config(open_tensor_file(path).shapes(), path)


def clip_vision_tensors(path) -> dict:
  """CLIPVisionModel's tensors (float32) from Wan's CLIP file: the vision tower through
  `CLIP_ROWS`, `to_qkv` split into its q, k, v rows, the embeddings' unit axes dropped. The
  text tower and `CLIP_PROJECTION` are left out; any other tower key is kept under its own
  name, so that loading names it."""
  wan = torch_state_dict(path)
  tower = {k: v for k, v in wan.items() if k.startswith("visual.") and k != CLIP_PROJECTION}
  fused = table.part_names(tower, CLIP_ROWS)
  state = {}
  for key, value in tower.items():
    parts = fused.get(key, (key,))
    value = value.float().reshape(value.shape[CLIP_UNIT_AXES.get(key, 0):])
    state.update(zip(parts, value.chunk(len(parts))))
  return state


def load_clip_file(path, config):
  """CLIPVisionModel (float32) from Wan-AI's CLIP file (`clip_vision_tensors`), every tensor of
  both accounted for. Through `from_pretrained`: it makes the buffer the file lacks (the
  position ids) and initialises nothing it is given."""
  import torch
  from transformers import CLIPVisionModel
  clip, info = CLIPVisionModel.from_pretrained(
      None, config=config, state_dict=clip_vision_tensors(path), dtype=torch.float32,
      output_loading_info=True)
  check_loaded(sorted(info["missing_keys"]), sorted(info["unexpected_keys"]), path,
               "a CLIP vision tower of the form its shapes say")
  return clip


def clip_processor(image_size):
  """The image processor of diffusers' Wan 2.1 I2V folders at `image_size` (224 released):
  theirs, image_processor/, is laion/CLIP-ViT-H-14-laion2B-s32B-b79K's (diffusers'
  scripts/convert_wan_to_diffusers.py), whose preprocessor_config.json resizes the shorter side
  to 224 (bicubic), crops the centre 224 square and normalises with OpenAI CLIP's mean and std.
  Wan's own `CLIPModel.visual` instead resizes the whole frame to the square (bicubic, from
  floats, no crop); we follow WanImageToVideoPipeline, as a diffusers folder does."""
  from transformers import CLIPImageProcessor
  from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
  return CLIPImageProcessor(size={"shortest_edge": image_size},
                            crop_size={"height": image_size, "width": image_size},
                            resample=PILImageResampling.BICUBIC, do_center_crop=True,
                            image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)


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
  """A random `AutoencoderKLWan` (float32, eval mode) of Wan 2.1's form, or 2.2's. Its latent
  statistics (config lists, not weights) are random for 2.1's 9 channels, and the released
  ones for 2.2's 48, which its Wan-AI file then reads back (`latent_statistics`)."""
  from diffusers import AutoencoderKLWan
  if wan22:
    return tiny.build(AutoencoderKLWan, seed, **TINY_VAE_22, **LATENT_STATISTICS[wan_model.WAN22_Z])
  rng = np.random.default_rng(seed)
  z = TINY_VAE["z_dim"]
  stats = dict(latents_mean=[round(float(x), 4) for x in rng.normal(0, 0.5, z)],
               latents_std=[round(float(x), 4) for x in rng.uniform(0.5, 3.0, z)])
  return tiny.build(AutoencoderKLWan, seed, **TINY_VAE, **stats)


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
# head count (heads of 8, not the released 80: its Wan-AI file loads with `CLIP_HEAD_DIM` set
# to theirs, as the tiny VAE with its statistics), 32-pixel images of 8-pixel patches (17
# tokens), Wan's GELU
TINY_CLIP = dict(hidden_size=TINY_I2V["image_dim"], intermediate_size=40, num_hidden_layers=3,
                 num_attention_heads=3, image_size=32, patch_size=8, projection_dim=16,
                 hidden_act=CLIP_ACTIVATION)


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
    from transformers import CLIPVisionConfig, CLIPVisionModel
    pipeline = WanImageToVideoPipeline(
        **parts, image_encoder=tiny.build(CLIPVisionModel, seed + 3, CLIPVisionConfig(**TINY_CLIP)),
        image_processor=clip_processor(TINY_CLIP["image_size"]))
  else:
    pipeline = WanPipeline(**parts, expand_timesteps=kind == "ti2v")
  pipeline.save_pretrained(root)
  return root


def original_umt5(umt5) -> dict:
  """A UMT5 encoder's tensors under Wan's names (numpy float32), as Wan-AI's T5 .pth holds them."""
  tensors = tiny.state_dict_numpy(umt5)
  del tensors[TIED_EMBEDDING]
  return {single: tensors[parts[0]] for single, (parts, _) in table.single_file_parts(tensors, UMT5_ROWS).items()}


def original_clip(clip) -> dict:
  """A CLIPVisionModel's tensors under Wan's names (numpy float32), as Wan-AI's CLIP .pth holds
  its vision tower (`CLIP_ROWS`); the text tower and the projection are not written."""
  tensors = table.to_single_file(tiny.state_dict_numpy(clip), CLIP_ROWS)
  return {k: v.reshape((1,) * CLIP_UNIT_AXES.get(k, 0) + v.shape) for k, v in tensors.items()}


def original_vae(vae) -> dict:
  """A VAE's tensors under Wan's names (numpy float32), as Wan-AI's VAE .pth holds them."""
  return {original_vae_key(k, vae.config): v for k, v in tiny.state_dict_numpy(vae).items()}


def save_torch(tensors, path):
  """Writes numpy tensors as a torch pickle of a state dict (Wan-AI's .pth files)."""
  import torch
  torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, path)
  return path


def write_tiny_original(pipeline, folder):
  """Writes Wan-AI's folder of a tiny diffusers pipeline folder's models (`write_tiny_pipeline`),
  the same weights in float32: the transformer (`save_original`), the T5 .pth, the tokenizer in
  google/umt5-xxl/, the VAE .pth of its kind (2.2's for the TI2V 5B) and an I2V pipeline's CLIP
  vision tower (`original_clip`). Returns folder."""
  from diffusers import AutoencoderKLWan, WanTransformer3DModel
  from transformers import AutoTokenizer, CLIPVisionModel, UMT5EncoderModel
  part = lambda cls, sub: cls.from_pretrained(os.path.join(pipeline, sub)).eval()
  transformer = part(WanTransformer3DModel, "transformer")
  save_original(transformer, folder)
  save_torch(original_umt5(part(UMT5EncoderModel, "text_encoder")), os.path.join(folder, ORIGINAL_T5))
  AutoTokenizer.from_pretrained(os.path.join(pipeline, "tokenizer")).save_pretrained(
      os.path.join(folder, ORIGINAL_TOKENIZER))
  vae = part(AutoencoderKLWan, "vae")
  save_torch(original_vae(vae), os.path.join(folder, ORIGINAL_VAES[vae.config.is_residual]))
  if os.path.isdir(os.path.join(pipeline, "image_encoder")):
    clip = part(CLIPVisionModel, "image_encoder")
    save_torch(original_clip(clip), os.path.join(folder, ORIGINAL_CLIP))
  return folder


def save_comfyui_umt5(umt5, path, float8=False, prefix="encoder."):
  """Writes ComfyUI's UMT5 file: transformers' names (their `encoder.` prefix replaced by
  `prefix`), the tied embedding once, in float16; or as its fp8_e4m3fn_scaled file: the blocks'
  Linear weights in float8 e4m3fn, each scaled to its largest value (`scale_weight`, float32),
  the marker tensor beside them."""
  import ml_dtypes
  tensors = tiny.state_dict_numpy(umt5)
  del tensors[TIED_EMBEDDING]
  out = {}
  for key, value in tensors.items():
    name = prefix + key[len("encoder."):] if key.startswith("encoder.") else key
    if float8 and key.startswith("encoder.block.") and value.ndim == 2 and "relative_attention" not in key:
      scale = np.abs(value).max() / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
      out[name] = (value / scale).astype(ml_dtypes.float8_e4m3fn)
      out[name[:-len("weight")] + WEIGHT_SCALE] = np.array([scale], np.float32)
    else:
      out[name] = value.astype(np.float16)
  if float8:
    out[SCALED_FP8_MARKER] = np.zeros(0, ml_dtypes.float8_e4m3fn)
  write_safetensors(out, path)
  return path


def trained_config(model_config):
  """The config of the transformer a run trains (read from its files' config or headers)."""
  from diffpipe_jax import models
  return models.checkpoint_config("wan", wan_model.FAMILY.checkpoint_path(model_config))


TORCH_SIDE = TorchSide(
    load_encoders=lambda model_config, **kw: WanEncoders.load(
        model_config.diffusers_path, model_config.ckpt_path, model_config.llm_path,
        frame_rate=model_config.frame_rate,
        trained_config=lambda: trained_config(model_config), **kw),
    write_tiny_pipeline=write_tiny_pipeline,
    tiny_kinds=TINY_KINDS,
    build_tiny=build_tiny,
    save_tiny=save_tiny,
    pipeline="WanPipeline",
)
