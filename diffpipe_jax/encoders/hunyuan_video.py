"""HunyuanVideo's PyTorch side: its encoders for caching (causal 3D VAE latents, unpacked; LLaMA
hidden states in Tencent's prompt templates with their mask; CLIP-L pooled output) and the tiny
random pipeline and checkpoints for tests and the embedded default, built with the real diffusers
and transformers classes and saved in the real on-disk formats: a diffusers folder, Tencent's
official `ckpts/` folder, and ComfyUI's single files."""
import contextlib
import json
import os
from unittest import mock

import numpy as np

from diffpipe_jax import tiny
from diffpipe_jax.convert.tensorfile import (TORCH_PICKLE_SUFFIXES, common_prefix, open_tensor_file,
                                             torch_state_dict, write_safetensors)
from diffpipe_jax.encoders import Encoders, default_device, find_source
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import TorchSide
from diffpipe_jax.models.hunyuan_video import FAMILY, OFFICIAL_FILE, OFFICIAL_MODEL

# Tencent's prompt templates (HunyuanVideo `hyvideo/constants.py`: `dit-llm-encode` for images,
# `dit-llm-encode-video` for videos; diffusers has only the video one, DEFAULT_PROMPT_TEMPLATE).
# The hidden states of the text before `{}` are cropped off: with the released LLaMA-3 tokenizer
# that is 36 and 95 tokens, `<|begin_of_text|>` included (Tencent's hard-coded crop_start).
IMAGE_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the image by detailing the color, "
    "shape, size, texture, quantity, text, spatial relationships of the objects and background:"
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>")
VIDEO_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following "
    "aspects: 1. The main content and theme of the video.2. The color, shape, size, texture, "
    "quantity, text, and spatial relationships of the objects.3. Actions, events, behaviors "
    "temporal relationships, physical movement changes of the objects.4. background environment, "
    "light, style and atmosphere.5. camera angles, movements, and transitions used in the video:"
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>")
SKIPPED_LAYERS = 2  # the text embeddings are the LLaMA's hidden states before its last two layers
CLIP_TOKENS = 77
# What Tencent's text encoder folders hold beside what is used (patterns of tensor names): the
# LLaVA language model's head (`text_encoder/` is a LlamaForCausalLM) and CLIP's vision tower and
# projections (`text_encoder_2/` is the whole CLIP-L). They are left out without a word; any
# other unexpected or missing tensor is still reported.
UNUSED_TENSORS = {"LlamaModel": (r"^lm_head\.",),
                  "CLIPTextModel": (r"^vision_model\.", r"^visual_projection\.",
                                    r"^text_projection\.", r"^logit_scale$")}

# Tencent's official folder (diffusion-pipe's model.ckpt_path), relative to it.
OFFICIAL_TRANSFORMER = f"{OFFICIAL_MODEL}/{OFFICIAL_FILE}"
OFFICIAL_VAE = f"{OFFICIAL_MODEL}/vae"
OFFICIAL_VAE_WEIGHTS = "pytorch_model.pt"
PREFIX = FAMILY.single_file.prefixes[0]  # of the transformer in ComfyUI's repackaged files

# Where each component is found, by the config key that says it, in precedence order: ComfyUI's
# own files, then Tencent's folder, then a diffusers folder.
SOURCES = {
    "vae": (("vae_path", ""), ("ckpt_path", OFFICIAL_VAE), ("diffusers_path", "vae")),
    "tokenizer": (("llm_path", ""), ("ckpt_path", "text_encoder"), ("diffusers_path", "tokenizer")),
    "text_encoder": (("llm_path", ""), ("ckpt_path", "text_encoder"),
                     ("diffusers_path", "text_encoder")),
    "tokenizer_2": (("clip_path", ""), ("ckpt_path", "text_encoder_2"),
                    ("diffusers_path", "tokenizer_2")),
    "text_encoder_2": (("clip_path", ""), ("ckpt_path", "text_encoder_2"),
                       ("diffusers_path", "text_encoder_2")),
}
WHAT = {"vae_path": (f"a HunyuanVideo VAE file: ComfyUI's .safetensors, or Tencent's "
                     f"{OFFICIAL_VAE}/{OFFICIAL_VAE_WEIGHTS}"),
        "llm_path": "the LLaMA text encoder folder with its tokenizer",
        "clip_path": "the CLIP-L text encoder folder with its tokenizer",
        "ckpt_path": f"Tencent's folder with {OFFICIAL_MODEL}/vae, text_encoder and text_encoder_2",
        "diffusers_path": "a diffusers HunyuanVideo pipeline folder"}


class HunyuanVideoEncoders(Encoders):
  """HunyuanVideo: AutoencoderKLHunyuanVideo latents (8x spatial, 4x temporal, 1 + 4k frames);
  LLaMA hidden states in Tencent's image or video prompt template and their mask; CLIP-L pooled
  output. Each component comes from ComfyUI's files, Tencent's folder or a diffusers folder
  (`sources`: diffusers subfolder name -> the folder or file it loads from)."""
  components = {"vae": ("vae", "AutoencoderKLHunyuanVideo"),
                "tokenizer": ("tokenizer", "PreTrainedTokenizerFast"),
                "text_encoder": ("llm", "LlamaModel"),
                "tokenizer_2": ("clip_tokenizer", "CLIPTokenizer"),
                "text_encoder_2": ("clip", "CLIPTextModel")}
  frame_rate = 24

  def __init__(self, path, device, dtype, options, sources, vae_config):
    super().__init__(path, device, dtype, options)
    self.sources, self.vae_config = sources, vae_config

  @classmethod
  def load(cls, diffusers_path="", ckpt_path="", vae_path="", llm_path="", clip_path="",
           device=None, dtype=None, max_sequence_length=256):
    """The encoders (loaded when first needed) from the keys diffusion-pipe uses; each component
    from the first key that has it: vae_path / llm_path / clip_path, then ckpt_path, then
    diffusers_path. float32 on CPU, bfloat16 on CUDA unless told."""
    import torch
    keys = dict(diffusers_path=diffusers_path, ckpt_path=ckpt_path, vae_path=vae_path,
                llm_path=llm_path, clip_path=clip_path)
    for key, value in keys.items():
      if value and not os.path.exists(value):
        raise UserError(f"model.{key} {value} does not exist: set it to {WHAT[key]}, or leave it "
                        "empty")
    if vae_path and not os.path.isfile(vae_path):
      raise UserError(f"model.vae_path {vae_path} is a folder: set it to {WHAT['vae_path']}")
    found = {sub: find_source(keys, rows) for sub, rows in SOURCES.items()}
    missing = [sub for sub, source in found.items() if source is None]
    if missing:
      raise missing_error(keys, missing)
    sources = {sub: path for sub, (_, path) in found.items()}
    used = ", ".join(dict.fromkeys(keys[key] for key, _ in found.values()))
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return cls(used, device, dtype, dict(max_sequence_length=max_sequence_length), sources,
               read_vae_config(sources["vae"]))

  def load_vae(self):
    vae = load_vae(self.sources["vae"], self.vae_config, self.dtype)
    # diffusers' default, set so that it cannot change under us (see `encode_media`)
    vae.use_framewise_encoding, vae.use_tiling = True, False
    return vae

  def load_text_encoders(self):
    from transformers import CLIPTextModel, CLIPTokenizer, LlamaModel, PreTrainedTokenizerFast
    def model(cls, sub):
      with quiet_about_unused(cls):
        return cls.from_pretrained(self.sources[sub], dtype=self.dtype).to(self.device).eval()
    # the tokenizer.json as written: transformers 5's LlamaTokenizerFast rebuilds a
    # sentencepiece-style pipeline that mangles LLaMA-3's byte-level tokens
    self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.sources["tokenizer"],
                                                             padding_side="right")
    self.llm = model(LlamaModel, "text_encoder")
    self.clip_tokenizer = CLIPTokenizer.from_pretrained(self.sources["tokenizer_2"])
    self.clip = model(CLIPTextModel, "text_encoder_2")

  def component_source(self, sub):
    return self.sources[sub]

  @property
  def spatial_factor(self):
    return self.vae_config.get("spatial_compression_ratio", 8)

  @property
  def frames_per_latent(self):
    """Frames per latent frame after the first: a clip has 1 + 4k frames."""
    return self.vae_config.get("temporal_compression_ratio", 4)

  @property
  def pixel_multiple(self):
    """Bucket sides must be multiples of this: the VAE's factor, then the transformer's 2x2
    patches (HunyuanVideoPipeline requires multiples of 16)."""
    return 2 * self.spatial_factor

  def latent_grid(self, frames, height, width):
    """The latents' own grid (frames, rows, columns); the transformer patchifies 2x2 itself."""
    return ((frames - 1) // self.frames_per_latent + 1, height // self.spatial_factor,
            width // self.spatial_factor)

  def encode_media(self, pixels):
    """np [B, F, H, W, 3] in [-1, 1] (F = 1 + 4k, sides multiples of 16) -> np float32 latents
    [B, C, F', H', W'] (unpacked, as the transformer takes them): the posterior mean
    (`posterior_mean`) times the VAE's scaling factor.

    Frame-wise encoding is on, as in HunyuanVideoPipeline's VAE: a clip of more than 16 frames is
    encoded in windows of 17 frames every 12, which bounds the memory (activations of 17 frames
    at a time) for about 1.4x the frames' work. Each window is encoded on its own: its causal
    convolutions start afresh at its first frame and its group norms see only its frames; where
    two windows overlap, the earlier one's latents are kept. Up to 17 frames the latents equal
    a whole-clip encode; beyond, every latent frame differs from one (the group norms'
    statistics are the window's, not the clip's)."""
    z = self.posterior_mean(pixels, self.pixel_multiple)
    return (z * self.vae.config.scaling_factor).float().cpu().numpy()

  def decode_media(self, latents, grid):
    """Latents [B, C, F', H', W'] -> np [B, F, H, W, 3] in [-1, 1], as HunyuanVideoPipeline
    decodes them (frame-wise decoding on, its default)."""
    import torch
    z = torch.from_numpy(np.array(latents, np.float32)).to(self.vae.device, self.vae.dtype)
    with torch.no_grad():
      pixels = self.vae.decode(z / self.vae.config.scaling_factor).sample
    return pixels.clamp(-1, 1).float().cpu().numpy().transpose(0, 2, 3, 4, 1)

  def encode_text(self, captions, frames=1):
    """Captions -> dict(text=[B, T, D] LLaMA hidden states, text_mask=[B, T] 1 = token,
    pooled=[B, D'] CLIP pooled output), as HunyuanVideoPipeline.encode_prompt makes them with
    Tencent's template for `frames` (the image one for 1, the video one for more): T =
    max_sequence_length tokens after the template's prefix, right-padded (the transformer takes
    the valid tokens to come first), truncated."""
    import torch
    captions, limit = list(captions), self.options["max_sequence_length"]
    template = VIDEO_TEMPLATE if frames > 1 else IMAGE_TEMPLATE
    crop = crop_start(self.tokenizer, template)
    self.count_truncated_captions(captions, template, crop)
    tokens = self.tokenizer([template.format(c) for c in captions], padding="max_length",
                            max_length=limit + crop, truncation=True, return_tensors="pt")
    clip_ids = self.clip_tokenizer(captions, padding="max_length", max_length=CLIP_TOKENS,
                                   truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
      text = self.llm(input_ids=tokens.input_ids.to(self.device),
                      attention_mask=tokens.attention_mask.to(self.device),
                      output_hidden_states=True).hidden_states[-(SKIPPED_LAYERS + 1)]
      pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
    return dict(text=text[:, crop:].float().cpu().numpy(),
                text_mask=tokens.attention_mask[:, crop:].float().numpy(),
                pooled=pooled.float().cpu().numpy())

  def count_truncated_captions(self, captions, template, crop):
    """The LLaMA reads max_sequence_length tokens of a caption (its template's closing
    `<|eot_id|>` included): the rest is never trained on. CLIP reads 77, which long captions pass
    routinely (HunyuanVideoPipeline truncates them too; the LLaMA reads the rest)."""
    limit = self.options["max_sequence_length"]
    in_template = lambda texts, **kw: self.tokenizer([template.format(t) for t in texts], **kw)
    self.count_truncated(f"are longer than the LLaMA's {limit} tokens (max_sequence_length) and "
                         "were truncated: their end is not trained on", in_template, captions,
                         limit + crop)
    self.count_truncated(f"are longer than CLIP's {CLIP_TOKENS} tokens and were truncated for "
                         f"CLIP, as HunyuanVideoPipeline truncates them; the LLaMA reads up to "
                         f"{limit}", self.clip_tokenizer, captions, CLIP_TOKENS)


@contextlib.contextmanager
def quiet_about_unused(cls):
  """While it lasts, `cls` (a transformers model class) loads without reporting its
  `UNUSED_TENSORS`: transformers' load report leaves out the names a class lists as ignorable.
  (A subclass saying so would be custom code to transformers, which then skips the renames that
  load a whole CLIP's text tower.)"""
  ignored = [*(cls._keys_to_ignore_on_load_unexpected or ()), *UNUSED_TENSORS[cls.__name__]]
  with mock.patch.object(cls, "_keys_to_ignore_on_load_unexpected", ignored):
    yield


def crop_start(tokenizer, template):
  """The number of tokens before the caption in `template` (`<|begin_of_text|>` included): the
  hidden states HunyuanVideo crops off. Measured rather than hard-coded, so that any LLaMA-3
  tokenizer (the released one gives Tencent's 36 and 95) and the tiny one work."""
  return len(tokenizer(template.split("{}")[0]).input_ids)


def missing_error(keys, missing):
  """One line: the folders that lack components (diffusers subfolder names) and the keys that
  would give them."""
  roots = [keys[key] for key in ("ckpt_path", "diffusers_path") if keys[key]]
  where = (f"{' and '.join(roots)} lack{'s' * (len(roots) < 2)} the encoder folder(s)" if roots
           else "caching needs the encoders")
  files = dict.fromkeys(SOURCES[sub][0][0] for sub in missing)  # ComfyUI's, one a component
  say = lambda key: f"model.{key} ({WHAT[key]})"
  return UserError(f"{where} {missing}: set {' and '.join(map(say, files))}; or "
                   f"{say('ckpt_path')}; or {say('diffusers_path')}")


# Tencent's AutoencoderKLCausal3D config keys -> AutoencoderKLHunyuanVideo's (the rest are tiling
# settings, and block types that have one kind each).
TENCENT_VAE_KEYS = dict(
    in_channels="in_channels", out_channels="out_channels", latent_channels="latent_channels",
    block_out_channels="block_out_channels", layers_per_block="layers_per_block",
    act_fn="act_fn", norm_num_groups="norm_num_groups", scaling_factor="scaling_factor",
    spatial_compression_ratio="spatial_compression_ratio",
    time_compression_ratio="temporal_compression_ratio",
    mid_block_add_attention="mid_block_add_attention")


def with_block_types(config):
  """`config` with one down and one up block type per block (the released four by default)."""
  blocks = len(config.get("block_out_channels", (0,) * 4))
  return dict(config, down_block_types=("HunyuanVideoDownBlock3D",) * blocks,
              up_block_types=("HunyuanVideoUpBlock3D",) * blocks)


def vae_config_from_tencent(tencent):
  """Tencent's vae/config.json as AutoencoderKLHunyuanVideo keyword arguments."""
  return with_block_types({ours: tencent[theirs] for theirs, ours in TENCENT_VAE_KEYS.items()
                           if theirs in tencent})


def tencent_vae_config(config):
  """A diffusers VAE config as Tencent's vae/config.json (`AutoencoderKLCausal3D`)."""
  blocks = len(config.block_out_channels)
  return dict({theirs: config[ours] for theirs, ours in TENCENT_VAE_KEYS.items()},
              _class_name="AutoencoderKLCausal3D", sample_size=256, sample_tsize=64,
              down_block_types=["DownEncoderBlockCausal3D"] * blocks,
              up_block_types=["UpDecoderBlockCausal3D"] * blocks)


def vae_config_from_shapes(shapes, path):
  """AutoencoderKLHunyuanVideo keyword arguments from a VAE file's tensor shapes. What shapes
  cannot tell (norm groups, compression ratios, activation, scaling factor) is the released
  model's: the class's defaults."""
  down = "encoder.down_blocks."
  blocks = sorted({int(k[len(down):].split(".")[0]) for k in shapes if k.startswith(down)})
  layers = {k.split(".")[4] for k in shapes if k.startswith(f"{down}0.resnets.")}
  try:
    return with_block_types(dict(
        in_channels=shapes["encoder.conv_in.conv.weight"][1],
        out_channels=shapes["decoder.conv_out.conv.weight"][0],
        latent_channels=shapes["decoder.conv_in.conv.weight"][1],
        block_out_channels=tuple(shapes[f"{down}{i}.resnets.0.conv2.conv.weight"][0]
                                 for i in blocks),
        layers_per_block=len(layers),
        mid_block_add_attention="encoder.mid_block.attentions.0.to_q.weight" in shapes))
  except KeyError as e:
    raise UserError(f"model.vae_path {path} is not a HunyuanVideo VAE (it has no {e}): set it to "
                    f"{WHAT['vae_path']}") from None


def read_vae_config(source):
  """The VAE's config without loading it: a diffusers folder's config.json, Tencent's mapped, or
  a file's shapes (ComfyUI's, or Tencent's pytorch_model.pt given alone)."""
  if os.path.isfile(source):
    shapes = open_tensor_file(source).shapes()
    prefix = common_prefix(shapes, ("vae.",))
    return vae_config_from_shapes({k[len(prefix):]: shape for k, shape in shapes.items()}, source)
  with open(os.path.join(source, "config.json")) as f:
    config = json.load(f)
  return (vae_config_from_tencent(config)
          if os.path.isfile(os.path.join(source, OFFICIAL_VAE_WEIGHTS)) else config)


def vae_tensors(source):
  """The VAE tensors of a file (ComfyUI's safetensors, Tencent's pytorch_model.pt) or of
  Tencent's folder; as Tencent's loader does, a `state_dict` wrapper and a `vae.` prefix are
  taken off."""
  from safetensors.torch import load_file
  path = source if os.path.isfile(source) else os.path.join(source, OFFICIAL_VAE_WEIGHTS)
  tensors = torch_state_dict(path) if path.endswith(TORCH_PICKLE_SUFFIXES) else load_file(path)
  prefix = common_prefix(tensors, ("vae.",))
  return {k[len(prefix):]: v for k, v in tensors.items()}


def load_vae(source, config, dtype):
  """The VAE from a diffusers folder, Tencent's folder or a ComfyUI file (built on the meta
  device and given the file's tensors: no random init to overwrite)."""
  import torch
  from diffusers import AutoencoderKLHunyuanVideo
  if os.path.isdir(source) and not os.path.isfile(os.path.join(source, OFFICIAL_VAE_WEIGHTS)):
    return AutoencoderKLHunyuanVideo.from_pretrained(source, torch_dtype=dtype)
  with torch.device("meta"):
    vae = AutoencoderKLHunyuanVideo(**config)
  tensors = {k: v.to(dtype) for k, v in vae_tensors(source).items()}
  missing, unexpected = vae.load_state_dict(tensors, strict=False, assign=True)
  if missing or unexpected:
    raise UserError(f"{source} is not a HunyuanVideo VAE of the architecture its "
                    f"{'shapes' if os.path.isfile(source) else 'config.json'} say: missing "
                    f"{missing[:3]}, unexpected {unexpected[:3]}; point model.vae_path or "
                    "model.ckpt_path at the released VAE")
  return vae


# Smallest HunyuanVideo with every structural feature, in non-released dims: an odd head count,
# a head size (32) whose RoPE axes derive as the released ones do (4, 14, 14: Tencent's file
# stores none), double, single and refiner blocks, a non-4 MLP ratio (the refiner's stays 4),
# latent, text and pooled widths of their own (the tiny VAE's, LLaMA's and CLIP's).
TINY_HUNYUAN = dict(in_channels=6, out_channels=6, num_attention_heads=3, attention_head_dim=32,
                    num_layers=2, num_single_layers=3, num_refiner_layers=2, mlp_ratio=3.0,
                    patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=24,
                    pooled_projection_dim=20, rope_theta=256.0, rope_axes_dim=(4, 14, 14))

# The tiny VAE: the released 8x spatial, 4x temporal structure (four blocks), one resnet a block.
# Its norm groups (32) and scaling factor are the released ones: neither is in a ComfyUI file,
# which must load with the class defaults; channels of two sizes, so that the config read from
# shapes can get them wrong.
TINY_VAE = dict(latent_channels=6, block_out_channels=(32, 32, 64, 64), layers_per_block=1)
TINY_LLAMA = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=12, max_position_embeddings=1024,
                  rope_theta=500000.0)
TINY_CLIP = dict(hidden_size=20, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=CLIP_TOKENS, projection_dim=20)
TINY_CLIP_VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=2, image_size=28, patch_size=14, projection_dim=20)


def build_tiny(seed=0, **overrides):
  """A random diffusers `HunyuanVideoTransformer3DModel` (float32, eval mode)."""
  from diffusers import HunyuanVideoTransformer3DModel
  return tiny.build(HunyuanVideoTransformer3DModel, seed, **{**TINY_HUNYUAN, **overrides})


def build_tiny_vae(seed=0):
  """A random `AutoencoderKLHunyuanVideo` (float32, eval mode)."""
  from diffusers import AutoencoderKLHunyuanVideo
  return tiny.build(AutoencoderKLHunyuanVideo, seed, **TINY_VAE)


def build_tiny_llama(tokenizer, hidden_size, seed=0):
  """A random `LlamaModel` (grouped-query attention, as LLaMA-3) over `tokenizer`'s ids."""
  from transformers import LlamaConfig, LlamaModel
  config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       **dict(TINY_LLAMA, hidden_size=hidden_size))
  return tiny.build(LlamaModel, seed, config)


def build_tiny_clip(tokenizer, hidden_size, seed=0):
  """A random `CLIPTextModel` over `tokenizer`'s ids (`tiny.clip_tokenizer`)."""
  from transformers import CLIPTextConfig, CLIPTextModel
  bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
  config = CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos,
                          pad_token_id=eos, **dict(TINY_CLIP, hidden_size=hidden_size))
  return tiny.build(CLIPTextModel, seed, config)


def tencent_transformer(model):
  """The transformer's tensors under Tencent's names (numpy float32)."""
  from diffpipe_jax.models.hunyuan_video import tencent_tensors
  return tencent_tensors(tiny.state_dict_numpy(model))


def save_official_transformer(model, ckpts):
  """Writes Tencent's `mp_rank_00_model_states.pt` ({"module": state dict}) under `ckpts`."""
  import torch
  path = os.path.join(ckpts, OFFICIAL_TRANSFORMER)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  torch.save({"module": {k: torch.from_numpy(v) for k, v in tencent_transformer(model).items()}},
             path)
  return path


def save_comfyui(model, path, prefix=""):
  """Writes ComfyUI's single file: Tencent's names, optionally prefixed."""
  write_safetensors({prefix + k: v for k, v in tencent_transformer(model).items()}, path)
  return path


def save_official_encoders(ckpts, vae, tokenizer, llm, clip_tokenizer, clip, seed=0):
  """Writes Tencent's VAE (`pytorch_model.pt` and its `AutoencoderKLCausal3D` config.json) and
  text encoders under `ckpts` as their instructions leave them: `text_encoder/` the LLaVA's
  language model (a LlamaForCausalLM) with its tokenizer, `text_encoder_2/` the whole CLIP-L
  (text and vision towers) with its tokenizer."""
  import torch
  from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, LlamaForCausalLM
  folder = os.path.join(ckpts, OFFICIAL_VAE)
  os.makedirs(folder, exist_ok=True)
  torch.save(vae.state_dict(), os.path.join(folder, OFFICIAL_VAE_WEIGHTS))
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(tencent_vae_config(vae.config), f, indent=2)
  torch.manual_seed(seed)
  causal_lm = tiny.randomize_(LlamaForCausalLM(llm.config))
  causal_lm.model.load_state_dict(llm.state_dict())
  causal_lm.save_pretrained(os.path.join(ckpts, "text_encoder"))
  tokenizer.save_pretrained(os.path.join(ckpts, "text_encoder"))
  whole = CLIPModel(CLIPConfig(text_config=clip.config.to_dict(),
                               vision_config=CLIPVisionConfig(**TINY_CLIP_VISION).to_dict(),
                               projection_dim=TINY_CLIP_VISION["projection_dim"]))
  tiny.randomize_(whole).text_model.load_state_dict(clip.state_dict())
  whole.save_pretrained(os.path.join(ckpts, "text_encoder_2"))
  clip_tokenizer.save_pretrained(os.path.join(ckpts, "text_encoder_2"))
  return ckpts


def save_tiny(model, root) -> dict:
  """`model` in every format `models.load` takes: a diffusers folder (one file, and sharded with
  an index), Tencent's `mp_rank_00_model_states.pt`, and ComfyUI's single file, unprefixed and
  prefixed."""
  return dict(diffusers=tiny.save_diffusers(model, os.path.join(root, "pipeline")),
              diffusers_sharded=tiny.save_diffusers(model, os.path.join(root, "sharded"),
                                                    max_shard_size="100KB"),
              official=save_official_transformer(model, os.path.join(root, "ckpts")),
              single_file=save_comfyui(model, os.path.join(root, "hunyuan_video_t2v_720p.safetensors")),
              single_file_prefixed=save_comfyui(
                  model, os.path.join(root, "hunyuan_video_t2v_720p_comfy.safetensors"), PREFIX))


def write_tiny_pipeline(root, seed=0):
  """Writes a complete tiny HunyuanVideo pipeline folder (transformer, VAE, LLaMA, CLIP,
  tokenizers, scheduler) with the real classes, and the same models in Tencent's format in
  `root/ckpts`, for caching and end-to-end tests: `root` serves as model.diffusers_path and
  `root/ckpts` as model.ckpt_path. Returns root."""
  from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
  transformer, vae = build_tiny(seed), build_tiny_vae(seed + 1)
  assert transformer.config.in_channels == vae.config.latent_channels
  tokenizer, tokenizer_2 = tiny.llama_tokenizer(), tiny.clip_tokenizer()
  text_encoder = build_tiny_llama(tokenizer, transformer.config.text_embed_dim, seed + 2)
  text_encoder_2 = build_tiny_clip(tokenizer_2, transformer.config.pooled_projection_dim, seed + 3)
  HunyuanVideoPipeline(
      scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), vae=vae, text_encoder=text_encoder,
      tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
      transformer=transformer).save_pretrained(root)
  ckpts = os.path.join(root, "ckpts")
  save_official_transformer(transformer, ckpts)
  save_official_encoders(ckpts, vae, tokenizer, text_encoder, tokenizer_2, text_encoder_2, seed + 4)
  return root


TORCH_SIDE = TorchSide(
    load_encoders=lambda model_config, **kw: HunyuanVideoEncoders.load(
        diffusers_path=model_config.diffusers_path, ckpt_path=model_config.ckpt_path,
        vae_path=model_config.vae_path, llm_path=model_config.llm_path,
        clip_path=model_config.clip_path, **kw),
    write_tiny_pipeline=write_tiny_pipeline,
    tiny_kinds=("",),
    build_tiny=build_tiny,
    save_tiny=save_tiny,
    pipeline="HunyuanVideoPipeline",
)
