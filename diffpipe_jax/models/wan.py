"""Wan 2.1 / 2.2 transformer in Flax.

Reimplements diffusers `WanTransformer3DModel` (one class for every Wan: T2V 1.3B and 14B, I2V
14B, the 2.2 A14B experts and TI2V 5B) under Wan's original parameter names, the names its LoRAs
are shared in (ComfyUI's form, which diffusion-pipe writes): `blocks.0.self_attn.q`,
`blocks.0.cross_attn.k_img`, `blocks.0.ffn.0`, `head.head`. The blocks are one stack
(`stacks`), so their parameters are one array per weight.

What sets it apart: no text mask (the pipeline zero-pads the UMT5 states to 512 tokens), RoPE
on each head over (frames, rows, columns) with the head split 2x(D//6) for rows and columns and
the rest for frames, q/k RMSNorm across heads, a LayerNorm with affine before the ungated
cross-attention (Wan's `norm3`), and one timestep modulation per sample or, for the 2.2 TI2V
5B, per token (its clean first frame at t = 0). I2V models also attend to CLIP image tokens in
the cross-attention (`k_img`, `v_img`) and take the first frame's latents and a mask as 20 more
input channels.

`DIFFUSERS_TABLE` maps a diffusers folder's names onto ours; Wan-AI's folders and ComfyUI's
single files use ours. `FAMILY`, at the end, is what the trainer knows of it.
"""
import dataclasses
import functools
import json
import os
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax import flow, programs, stacks
from diffpipe_jax.convert import table
from diffpipe_jax.convert.table import Row
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import Family, Sampling, SingleFile, config_dataclass
from diffpipe_jax.models import layers
from diffpipe_jax.models.layers import Linear
from diffpipe_jax.rules import PROBABILITY, TEXT, Key, choice, number

TIMESTEP_SCALE = 1000.0  # the model takes sigma * 1000, as WanPipeline passes it
ROPE_THETA = 10000.0
IMAGE_NORM_EPS = 1e-5  # the image embedder's LayerNorms: diffusers' FP32LayerNorm default
RELEASED_HEAD_DIM = 128  # every released Wan's; a single file's weights do not show it
TEXT_TOKENS = 512  # WanPipeline pads the UMT5 states to this; diffusers' I2V attention assumes it
WAN22_Z = 48  # the 2.2 VAE's latent channels: a transformer of 48 in and out is the TI2V 5B


@dataclasses.dataclass(frozen=True)
class WanConfig:
  """The hyperparameters of diffusers' `WanTransformer3DModel` config.json, same names (those
  it allows one value of are checked by `config_from_diffusers`)."""
  patch_size: Tuple[int, int, int] = (1, 2, 2)
  num_attention_heads: int = 40
  attention_head_dim: int = 128
  in_channels: int = 16
  out_channels: int = 16
  text_dim: int = 4096
  freq_dim: int = 256
  ffn_dim: int = 13824
  num_layers: int = 40
  cross_attn_norm: bool = True
  eps: float = 1e-6
  image_dim: Optional[int] = None  # I2V: CLIP's hidden size
  added_kv_proj_dim: Optional[int] = None  # I2V: the image tokens' key/value input width
  rope_max_seq_len: int = 1024  # positions per axis diffusers tabulates

  @property
  def inner_dim(self):
    return self.num_attention_heads * self.attention_head_dim

  @property
  def rope_axes(self):
    """Channels per head rotated by (frames, rows, columns), as diffusers' WanRotaryPosEmbed."""
    hw = 2 * (self.attention_head_dim // 6)
    return (self.attention_head_dim - 2 * hw, hw, hw)


# config.json keys whose other values diffusers does not implement, or we do not
FIXED = dict(qk_norm="rms_norm_across_heads", pos_embed_seq_len=None)
STACKED = ("blocks",)
# diffusion-pipe's LoRA targets: every Linear inside the blocks.
LORA_TARGETS = (r"blocks\..*",)


def config_from_diffusers(cfg: dict) -> WanConfig:
  return config_dataclass(WanConfig, cfg, FIXED, " (Wan's first-last-frame model)")


def first_frame_input(cfg: WanConfig) -> str:
  """How the model is given a clip's first frame, from its config: "channels" (I2V: a mask and
  the first frame's latents join the noisy latents' channels; CLIP image states too where it has
  an image embedder), "clean" (the 2.2 TI2V 5B: its first latent frame clean, at t = 0), or ""
  (T2V)."""
  if cfg.in_channels != cfg.out_channels:
    return "channels"
  return "clean" if cfg.in_channels == WAN22_Z else ""


def config_from_single_file(shapes: dict, metadata: dict, axes_dims_rope=None) -> WanConfig:
  """Every size from the tensor shapes of Wan's original names; the head count from the
  `num_heads` of a Wan-AI folder's config.json (passed as `metadata`) or of a file's metadata,
  else the released head size's (128, as diffusers' and ComfyUI's single-file loaders assume:
  a file's weights do not show it). `axes_dims_rope` does not apply: Wan's RoPE axes follow
  from the head size."""
  if axes_dims_rope is not None:
    raise UserError("axes_dims_rope does not apply to Wan, whose RoPE axes follow from the head size")
  if "img_emb.emb_pos" in shapes:
    raise UserError("this is Wan's first-last-frame model (img_emb.emb_pos), which is not supported")
  inner, in_channels, *patch = shapes["patch_embedding.weight"]
  heads = int(metadata.get("num_heads", 0)) or inner // RELEASED_HEAD_DIM
  if not heads or inner % heads:
    raise UserError(f"Wan's width {inner} is no multiple of {RELEASED_HEAD_DIM}, the head size "
                    "a single file without `num_heads` in its metadata is assumed to have: give "
                    "Wan-AI's folder (its config.json says the head count) or a diffusers folder")
  image = "img_emb.proj.0.weight" in shapes
  return WanConfig(
      patch_size=tuple(patch),
      num_attention_heads=heads,
      attention_head_dim=inner // heads,
      in_channels=in_channels,
      out_channels=shapes["head.head.weight"][0] // int(np.prod(patch)),
      text_dim=shapes["text_embedding.0.weight"][1],
      freq_dim=shapes["time_embedding.0.weight"][1],
      ffn_dim=shapes["blocks.0.ffn.0.weight"][0],
      num_layers=len({k.split(".")[1] for k in shapes if k.startswith("blocks.")}),
      cross_attn_norm="blocks.0.norm3.weight" in shapes,
      eps=metadata.get("eps", WanConfig.eps),
      image_dim=shapes["img_emb.proj.0.weight"][0] if image else None,
      added_kv_proj_dim=shapes["blocks.0.cross_attn.k_img.weight"][1] if image else None)


# Ours (Wan's original names) -> the diffusers module(s) (diffusers' own single-file converter,
# `convert_wan_transformer_to_diffusers`, read backwards; note the swapped norm2/norm3).
_B = "blocks.{i}."
_MODULATION = dict(params=(("scale_shift_table", "modulation"),))
_ATTENTION = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"),
              ("norm_q", "norm_q"), ("norm_k", "norm_k"))
DIFFUSERS_TABLE = (
    Row("patch_embedding", ("patch_embedding",)),
    *(Row(f"{ours}.{a}", (f"condition_embedder.{theirs}.linear_{b}",))
      for ours, theirs in (("text_embedding", "text_embedder"), ("time_embedding", "time_embedder"))
      for a, b in ((0, 1), (2, 2))),
    Row("time_projection.1", ("condition_embedder.time_proj",)),
    *(Row(f"{_B}self_attn.{ours}", (f"{_B}attn1.{theirs}",)) for ours, theirs in _ATTENTION),
    *(Row(f"{_B}cross_attn.{ours}", (f"{_B}attn2.{theirs}",)) for ours, theirs in (
        *_ATTENTION, ("k_img", "add_k_proj"), ("v_img", "add_v_proj"), ("norm_k_img", "norm_added_k"))),
    Row(_B + "norm3", (_B + "norm2",)),
    Row(_B + "ffn.0", (_B + "ffn.net.0.proj",)),
    Row(_B + "ffn.2", (_B + "ffn.net.2",)),
    Row("blocks.{i}", ("blocks.{i}",), **_MODULATION),
    Row("head.head", ("proj_out",)),
    Row("head", ("",), **_MODULATION),  # the model's own scale_shift_table
    *(Row(f"img_emb.proj.{a}", (f"condition_embedder.image_embedder.{theirs}",)) for a, theirs in (
        (0, "norm1"), (1, "ff.net.0.proj"), (3, "ff.net.2"), (4, "norm2"))),
)


def original_tensors(diffusers_tensors: dict) -> dict:
  """diffusers-named torch-order tensors -> Wan's original names (Wan-AI's and ComfyUI's files)."""
  return table.to_single_file(diffusers_tensors, DIFFUSERS_TABLE)


def rope_tables(grid, cfg: WanConfig):
  """diffusers `WanRotaryPosEmbed` for a token grid (frames, rows, columns): (cos, sin), each
  [F*H*W, head_dim], one angle per channel pair, the axes' channels one after the other.
  Computed in float64 and rounded, as diffusers tabulates them (the grid is static)."""
  if max(grid) > cfg.rope_max_seq_len:
    raise ValueError(f"a token grid of {grid} exceeds the {cfg.rope_max_seq_len} positions per "
                     "axis the model's RoPE covers (rope_max_seq_len)")
  positions = layers.grid_positions(grid).astype(np.float64)
  angles = []
  for axis, dim in enumerate(cfg.rope_axes):
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, dim, 2, dtype=np.float64)[:dim // 2] / dim)
    angles.append(positions[:, axis:axis + 1] * inv_freq[None])
  angles = np.repeat(np.concatenate(angles, -1), 2, axis=-1)
  return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def modulation(table, temb):
  """A block's `table` [1, n, D] plus the timestep modulation [B, L, n*D] (L = 1 per sample, or
  per token), in float32 as diffusers adds them -> n of [B, L, D]."""
  n = table.shape[1]
  mod = table[0].astype(jnp.float32) + temb.astype(jnp.float32).reshape(*temb.shape[:2], n, -1)
  return [mod[:, :, i] for i in range(n)]


def modulate(x, eps, shift, scale):
  """LayerNorm without affine, then x * (1 + scale) + shift, in float32 as diffusers."""
  return (layers.layer_norm(x.astype(jnp.float32), eps) * (1 + scale) + shift).astype(x.dtype)


ATTENTION_NAMES = ("q", "k", "v", "norm_q", "norm_k", "o")


class CrossAttention(layers.Module):
  """Wan's `cross_attn`: queries from x, keys and values from the text (no mask: the padding is
  zeros, attended as diffusers does); an I2V model adds the CLIP image tokens' attention
  (`k_img`, `v_img`, `norm_k_img`), summed before the output projection."""
  heads: int
  head_dim: int
  eps: float
  implementation: Optional[str] = None

  @nn.compact
  def __call__(self, x, context, image=None):
    kw, width = self.kw, self.heads * self.head_dim
    q, k, v = layers.project_qkv(x, self.heads, self.head_dim, ATTENTION_NAMES, "across_heads",
                                 context, eps=self.eps, **kw)
    out = layers.attention(q, k, v, implementation=self.implementation)
    if image is not None:
      k_img, v_img = layers.linears_of_one_input(image, ("k_img", "v_img"), (width,) * 2, **kw)
      k_img = layers.RMSNorm(eps=self.eps, name="norm_k_img", **kw)(k_img)
      heads = lambda t: t.reshape(*t.shape[:-1], self.heads, self.head_dim)
      out = out + layers.attention(q, heads(k_img), heads(v_img), implementation=self.implementation)
    return Linear(x.shape[-1], name="o", **kw)(layers.merge_heads(out))


class Block(layers.Module):
  """diffusers `WanTransformerBlock`: modulated self-attention with RoPE, cross-attention to the
  text (and image) on the `norm3`-normalised stream, ungated, then the modulated feed-forward."""
  cfg: WanConfig
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, rope, context, temb, image=None):
    c, kw = self.cfg, self.kw
    table = self.param("modulation", nn.initializers.normal(c.inner_dim ** -0.5),
                       (1, 6, c.inner_dim), self.param_dtype)
    shift, scale, gate, c_shift, c_scale, c_gate = modulation(table, temb)
    attn = layers.SelfAttention(c.num_attention_heads, c.attention_head_dim, "across_heads",
                                c.eps, self.attention_impl, ATTENTION_NAMES, name="self_attn", **kw)
    x = (x.astype(jnp.float32) + attn(modulate(x, c.eps, shift, scale), rope) * gate).astype(x.dtype)
    h = layers.LayerNorm(eps=c.eps, name="norm3", **kw)(x) if c.cross_attn_norm else x
    x = x + CrossAttention(c.num_attention_heads, c.attention_head_dim, c.eps, self.attention_impl,
                           name="cross_attn", **kw)(h, context, image)
    h = Linear(c.ffn_dim, name="ffn.0", **kw)(modulate(x, c.eps, c_shift, c_scale))
    h = Linear(c.inner_dim, name="ffn.2", **kw)(nn.gelu(h, approximate=True))
    return (x.astype(jnp.float32) + h.astype(jnp.float32) * c_gate).astype(x.dtype)


class ImageEmbedding(layers.Module):
  """diffusers `WanImageEmbedding` (Wan's `img_emb.proj`): LayerNorm, Linear, GELU, Linear,
  LayerNorm, from CLIP's hidden size to the model's width."""
  dim: int

  @nn.compact
  def __call__(self, x):
    kw = self.kw
    x = layers.LayerNorm(eps=IMAGE_NORM_EPS, name="proj.0", **kw)(x.astype(self.dtype))
    x = Linear(x.shape[-1], name="proj.1", **kw)(x)
    x = Linear(self.dim, name="proj.3", **kw)(nn.gelu(x, approximate=False))
    return layers.LayerNorm(eps=IMAGE_NORM_EPS, name="proj.4", **kw)(x)


block_stacks = stacks.equal_cost(STACKED, ("num_layers",))  # one stack


class Wan(layers.Transformer):
  """The transformer. Inputs have diffusers' names and meanings; see `__call__`."""
  cfg: WanConfig

  @nn.compact
  def __call__(self, hidden_states, timestep, encoder_hidden_states,
               encoder_hidden_states_image=None, run_stacks=stacks.run_stacks):
    """hidden_states [B, C, F, H, W] latents (F, H, W multiples of the patch; an I2V model's C
    holds the noisy latents, the mask and the first frame's latents); timestep [B], or per
    token [B, F'*H'*W'] (TI2V), in 0..1000; encoder_hidden_states [B, T, text_dim] UMT5 states;
    encoder_hidden_states_image [B, I, image_dim] CLIP image states (I2V). Returns the
    prediction [B, out_channels, F, H, W]."""
    c, kw = self.cfg, self.kw
    batch = hidden_states.shape[0]
    grid = tuple(n // p for n, p in zip(hidden_states.shape[2:], c.patch_size))
    x = Linear(c.inner_dim, name="patch_embedding", **kw)(
        layers.patchify(hidden_states, c.patch_size).astype(self.dtype))
    sinusoids = layers.timestep_sinusoids(timestep.reshape(-1), c.freq_dim).astype(self.dtype)
    emb = layers.MLPEmbedder(c.inner_dim, names=("0", "2"), name="time_embedding", **kw)(sinusoids)
    temb = programs.ahead(Linear(6 * c.inner_dim, name="time_projection.1", **kw)(nn.silu(emb)))
    temb, emb = temb.reshape(batch, -1, temb.shape[-1]), emb.reshape(batch, -1, emb.shape[-1])
    context = layers.MLPEmbedder(c.inner_dim, functools.partial(nn.gelu, approximate=True),
                                 names=("0", "2"), name="text_embedding", **kw)(encoder_hidden_states)
    per_sample = (context, temb)
    if c.image_dim is not None:
      per_sample += (ImageEmbedding(c.inner_dim, name="img_emb", **kw)(encoder_hidden_states_image),)

    block = Block(c, self.attention_impl, parent=None, **kw)
    x = self.run_blocks(run_stacks, block_stacks(c), [block], x, per_sample, (rope_tables(grid, c),))

    table = self.param("head.modulation", nn.initializers.normal(c.inner_dim ** -0.5),
                       (1, 2, c.inner_dim), self.param_dtype)
    # the one embedding offset by both rows (the blocks' modulation is six rows' worth)
    mod = table[0].astype(jnp.float32) + emb.astype(jnp.float32)[:, :, None]
    shift, scale = mod[:, :, 0], mod[:, :, 1]
    out = Linear(int(np.prod(c.patch_size)) * c.out_channels, name="head.head", **kw)(
        modulate(x, c.eps, shift, scale))
    return layers.unpatchify(out, grid, c.patch_size, channels_last=True)


# ---- inputs --------------------------------------------------------------------------------------


REQUIRED = ("hidden_states", "timestep", "encoder_hidden_states")


def check_inputs(cfg: WanConfig, inputs: dict) -> dict:
  """Validates `WanTransformer3DModel.forward`'s named inputs, with errors that say what to
  pass; timestep becomes [B] or [B, tokens]."""
  image_key = "encoder_hidden_states_image"
  missing = [k for k in REQUIRED + (image_key,) * (cfg.image_dim is not None) if inputs.get(k) is None]
  unknown = sorted(set(inputs) - set(REQUIRED) - {image_key})
  if missing or unknown:
    raise TypeError(f"Wan inputs: missing {missing}, unexpected {unknown}; expected {REQUIRED}"
                    f"{', and ' + image_key + ' (an I2V model)' if cfg.image_dim else ''}")
  x, text = inputs["hidden_states"], inputs["encoder_hidden_states"]
  if x.ndim != 5 or x.shape[1] != cfg.in_channels or any(
      n % p for n, p in zip(x.shape[2:], cfg.patch_size)):
    raise ValueError(f"hidden_states {x.shape}: pass latents [B, {cfg.in_channels}, F, H, W] with "
                     f"F, H, W multiples of the patch {cfg.patch_size}")
  batch = x.shape[0]
  tokens = int(np.prod([n // p for n, p in zip(x.shape[2:], cfg.patch_size)]))
  if text.shape[::2] != (batch, cfg.text_dim):
    raise ValueError(f"encoder_hidden_states {text.shape}: pass UMT5 states [{batch}, T, {cfg.text_dim}]")
  image = inputs.get(image_key)
  if cfg.image_dim is None and image is not None:
    raise ValueError(f"this Wan model takes no {image_key} (it is no I2V model): pass None")
  if image is not None and image.shape[::2] != (batch, cfg.image_dim):
    raise ValueError(f"{image_key} {image.shape}: pass CLIP states [{batch}, I, {cfg.image_dim}]")
  t = jnp.asarray(inputs["timestep"], jnp.float32)
  if t.ndim <= 1 and t.size in (1, batch):
    t = jnp.broadcast_to(t.reshape(-1), (batch,))
  elif t.shape != (batch, tokens):
    raise ValueError(f"timestep {t.shape}: pass one per sample [{batch}] or one per token "
                     f"[{batch}, {tokens}], in 0..1000 (sigma * 1000)")
  return dict(inputs, timestep=t)


def random_inputs(cfg: WanConfig, batch=1, frames=2, height=2, width=3, txt_len=6, seed=0) -> dict:
  """Random forward inputs for a token grid of frames x height x width patches (numpy float32):
  UMT5 states zero after a random length, as WanPipeline pads them, and CLIP states for an I2V
  model."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  kept = rng.integers(1, txt_len + 1, batch)
  text = normal(batch, txt_len, cfg.text_dim) * (np.arange(txt_len)[None, :, None] < kept[:, None, None])
  sizes = [n * p for n, p in zip((frames, height, width), cfg.patch_size)]
  return dict(
      hidden_states=normal(batch, cfg.in_channels, *sizes),
      timestep=rng.uniform(50.0, 1000.0, batch).astype(np.float32),
      encoder_hidden_states=text.astype(np.float32),
      encoder_hidden_states_image=None if cfg.image_dim is None else normal(batch, 5, cfg.image_dim))


def random_batch(cfg: WanConfig, batch=1, frames=2, height=2, width=3, txt_len=6, seed=0) -> dict:
  """`random_inputs` as a batch of cached samples (what `training_inputs` takes): an I2V model's
  with the first frame's latents (`condition`) and CLIP states (`image`)."""
  inputs = random_inputs(cfg, batch, frames, height, width, txt_len, seed)
  x = inputs["hidden_states"]  # an I2V model's: the latents, then the condition's channels
  out = dict(latents=x[:, :cfg.out_channels], text=inputs["encoder_hidden_states"])
  if first_frame_input(cfg) == "channels":
    out["condition"] = x[:, -cfg.out_channels:]
  if cfg.image_dim is not None:
    out["image"] = inputs["encoder_hidden_states_image"]
  return out


# ---- training ------------------------------------------------------------------------------------


EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}  # an A14B folder's


def checkpoint_path(model_config) -> str:
  """`model.transformer_path` (ComfyUI's file), else `model.ckpt_path` (Wan-AI's folder), else
  `model.diffusers_path`: a Wan 2.2 A14B folder's expert (`model.expert`)."""
  path = model_config.transformer_path or model_config.ckpt_path or model_config.diffusers_path
  if not path:
    raise UserError("set --config.model.diffusers_path, --config.model.ckpt_path (Wan-AI's "
                    "folder) or --config.model.transformer_path (or run the embedded default: "
                    "--config configs/wan.py:tiny)")
  if path != model_config.diffusers_path:
    if model_config.expert:
      raise UserError(f"model.expert={model_config.expert!r} picks an expert of a diffusers Wan "
                      "2.2 A14B folder (model.diffusers_path); for a file or Wan-AI's folder give "
                      "that expert's own and its side of the boundary as min_t/max_t")
    return path
  boundary = expert_boundary(path)
  if boundary is not None and not model_config.expert:
    raise UserError(f"{path} holds Wan 2.2 A14B's two experts (boundary_ratio {boundary}): set "
                    f"model.expert to one of {list(EXPERTS)} (one expert a run)")
  if boundary is None and model_config.expert:
    raise UserError(f"model.expert={model_config.expert!r}, but {path} is no Wan 2.2 A14B folder "
                    "(its model_index.json has no boundary_ratio): leave model.expert empty")
  if not model_config.expert:
    return path
  expert_range(model_config)  # min_t/max_t against the expert's side: said before anything loads
  return os.path.join(path, EXPERTS[model_config.expert])


@functools.lru_cache(maxsize=None)
def expert_boundary(folder: str) -> Optional[float]:
  """The `boundary_ratio` of a diffusers Wan folder's model_index.json (an A14B's: the high-noise
  expert takes t >= it, the low-noise one the rest), or None."""
  index = os.path.join(folder, "model_index.json")
  if not os.path.isfile(index):
    return None
  with open(index) as f:
    return json.load(f).get("boundary_ratio")


def expert_range(model_config) -> Optional[Tuple[float, float]]:
  """The timesteps (after the shift) that `model.expert` trains: its side of the boundary; None
  without an expert. min_t and max_t set too (not 0 and 1) must lie on that side, shifted:
  then they are the range, as diffusion-pipe takes them."""
  if not model_config.expert:
    return None
  b = expert_boundary(model_config.diffusers_path)
  side = (b, 1.0) if model_config.expert == "high_noise" else (0.0, b)
  given = (model_config.min_t, model_config.max_t)
  if given == (0.0, 1.0):
    return side
  shifted = tuple(float(flow.shift_by_config(model_config, t)) for t in given)
  if not side[0] - 1e-6 <= shifted[0] <= shifted[1] <= side[1] + 1e-6:
    raise UserError(f"model.expert={model_config.expert!r} trains the timesteps {list(side)} of "
                    f"the boundary {b}, but min_t/max_t = {list(given)} (shifted: "
                    f"{[round(t, 4) for t in shifted]}) reach beyond it: leave min_t and max_t at 0 "
                    "and 1, or keep them on the expert's side")
  return None  # the user's own range, already applied


def shift_timesteps(model_config, t, latents):
  """The shift, then, for a Wan 2.2 A14B expert, its side of the boundary (`expert_range`)."""
  t = flow.shift_by_config(model_config, t)
  side = expert_range(model_config)
  return t if side is None else side[0] + (side[1] - side[0]) * t


def sampling_experts(model_config) -> tuple:
  """A Wan 2.2 A14B folder with no model.expert: both experts, switched as WanPipeline does (the
  high-noise one for t >= boundary_ratio); () for any other checkpoint."""
  mc = model_config
  if mc.expert or mc.transformer_path or mc.ckpt_path or not mc.diffusers_path:
    return ()
  boundary = expert_boundary(mc.diffusers_path)
  if boundary is None:
    return ()

  def picked(expert):
    config = mc.copy_and_resolve_references()
    config.expert = expert
    return config
  return ((picked("high_noise"), boundary), (picked("low_noise"), 0.0))


def frame_rate(cfg: WanConfig) -> int:
  """The frame rate the model was trained at: 24 fps for the 2.2 TI2V 5B, 16 for the others."""
  return 24 if first_frame_input(cfg) == "clean" else 16


def first_frame_mask(cfg: WanConfig, latents):
  """WanImageToVideoPipeline's mask channels for latents [B, C, F, H, W]: the VAE's temporal
  factor of them (the input channels beyond the noisy and the condition latents), 1 on the
  first latent frame (the given one), 0 after it."""
  channels = cfg.in_channels - 2 * cfg.out_channels
  b, _, f, h, w = latents.shape
  first = (jnp.arange(f) == 0).astype(latents.dtype)[None, None, :, None, None]
  return jnp.broadcast_to(first, (b, channels, f, h, w))


def first_frame_tokens(cfg: WanConfig, latents_shape):
  """[L]: True for the tokens of the first latent frames (the first temporal patch) of latents
  of `latents_shape` [B, C, F, H, W], in the transformer's token order."""
  grid = [n // s for n, s in zip(latents_shape[2:], cfg.patch_size)]
  return jnp.broadcast_to((jnp.arange(grid[0]) == 0)[:, None, None], grid).reshape(-1)


def with_first_frame(cfg: WanConfig, conditioning: dict, latents):
  """Latents [B, C, F, H, W] with the TI2V 5B's given first frame (`first_frame`, its latents
  [B, C, F0, H, W], where the conditioning has one) in place of the first F0 latent frames."""
  if "first_frame" not in conditioning:
    return latents
  first = jnp.asarray(conditioning["first_frame"], latents.dtype)
  return jnp.concatenate([first, latents[:, :, first.shape[2]:]], axis=2)


def training_inputs(model_config, cfg: WanConfig, batch: dict, noisy, t) -> dict:
  """Model inputs for a batch of cached samples: latents [B, C, F, H, W] (here already noised),
  UMT5 states `text` [B, 512, D] (zero after each prompt); t [B] or per token [B, L], in [0, 1].
  An I2V model's input channels join the mask and the first frame's latents (`condition`), and
  it attends to the first frame's CLIP states (`image`) where it has an image embedder. The
  TI2V 5B drawing from a first frame (`first_frame`, the samples' conditioning) takes it in place
  of its first latent frames, their tokens at t = 0, as WanImageToVideoPipeline gives it
  (`expand_timesteps`)."""
  if "first_frame" in batch:
    clean = first_frame_tokens(cfg, noisy.shape)[None]
    noisy, t = with_first_frame(cfg, batch, noisy), jnp.where(clean, 0.0, t.reshape(len(t), -1))
  hidden_states = noisy
  if first_frame_input(cfg) == "channels":
    hidden_states = jnp.concatenate([noisy, first_frame_mask(cfg, noisy),
                                     batch["condition"].astype(noisy.dtype)], axis=1)
  return dict(hidden_states=hidden_states, timestep=t * TIMESTEP_SCALE,
              encoder_hidden_states=batch["text"], encoder_hidden_states_image=batch.get("image"))


def condition(model_config, cfg: WanConfig, key, batch, noisy, t):
  """The 2.2 TI2V 5B's image-to-video use (`first_frame_conditioning_p`): with that probability a
  video's first latent frame stays clean, at t = 0 for its tokens, and out of the loss, as
  WanImageToVideoPipeline gives it the image's latents (the VAE is causal: a clip's first latent
  frame is its first frame's). Images (one latent frame) never are. Other Wans take no clean
  frame: an I2V model is given the first frame through its input channels, every sample."""
  p = model_config.first_frame_conditioning_p
  frames = noisy.shape[2]
  if first_frame_input(cfg) != "clean" or p == 0 or frames == 1:
    return noisy, t, None
  chosen = jax.random.uniform(key, t.shape) < p  # [B]
  clean = chosen[:, None] & (jnp.arange(frames) < cfg.patch_size[0])[None]  # [B, F]
  noisy = jnp.where(clean[:, None, :, None, None], batch["latents"].astype(noisy.dtype), noisy)
  clean_tokens = chosen[:, None] & first_frame_tokens(cfg, noisy.shape)[None]  # [B, L]
  # the loss's error is averaged over the last axis (columns): a mask over the rest broadcasts
  kept = (~clean).astype(jnp.float32)[:, None, :, None]
  return noisy, jnp.where(clean_tokens, 0.0, t[:, None]), kept


# The released diffusers folders' scheduler (model_index.json's): UniPC over flow sigmas at the
# 480p flow shift, 3 (a folder's own config wins); WanPipeline's classifier-free guidance 5
# against the negative prompt, and no sigmas passed to the scheduler
RELEASED_SCHEDULER = dict(_class_name="UniPCMultistepScheduler", prediction_type="flow_prediction",
                          use_flow_sigmas=True, flow_shift=3.0)
SAMPLING = Sampling(
    scheduler=lambda cfg: RELEASED_SCHEDULER, spacing="scheduler", guidance_mode="cfg", steps=50,
    guidance=5.0, latent_shape=lambda cfg, grid: (cfg.out_channels, *grid), given=with_first_frame)


FAMILY = Family(
    type="wan",
    diffusers_class="WanTransformer3DModel",
    config_from_diffusers=config_from_diffusers,
    diffusers_rows=DIFFUSERS_TABLE,
    single_file=SingleFile(
        rows=None,  # Wan's original names are ours
        signature="head.modulation",
        prefixes=("model.diffusion_model.", "diffusion_model."),  # ComfyUI's repackagings
        foreign=(),
        config=config_from_single_file,
        folder_class="WanModel"),  # Wan-AI's folders: config.json + shards of the original names
    checkpoint_path=checkpoint_path,
    model_keys=dict(
        diffusers_path=Key(
            "", TEXT, "a diffusers Wan folder (transformer, VAE, UMT5 text encoder)"),
        ckpt_path=Key("", TEXT, "or Wan-AI's folder (config.json and the original weights, "
                      "the T5 and VAE .pth, google/umt5-xxl/, and for 2.1 I2V its CLIP .pth); "
                      "wins over diffusers_path"),
        transformer_path=Key(
            "", TEXT, "or ComfyUI's transformer (bf16 or fp8_e4m3fn .safetensors); wins over "
            "the folders"),
        llm_path=Key(
            "", TEXT, "ComfyUI's UMT5 text encoder (umt5_xxl_fp16 or fp8_e4m3fn_scaled "
            ".safetensors); wins over the folders' (their tokenizer is still used)"),
        expert=Key(
            "", choice("", *EXPERTS),
            "Wan 2.2 A14B (a diffusers folder of two experts): the one this run trains, on its "
            "side of the folder's boundary_ratio (high_noise: t >= it; low_noise: below)"),
        frame_rate=Key(
            0, number(0),
            "videos are decoded at this many frames per second; 0: the model's (`frame_rate`: "
            "Wan 2.1 and 2.2 A14B 16, 2.2 TI2V 5B 24)"),
        first_frame_conditioning_p=Key(
            0.0, PROBABILITY, "Wan 2.2 TI2V 5B: with this probability a video's first latent "
            "frame stays clean, at t = 0, and out of the loss (image to video); an I2V model "
            "takes the first frame through its input channels every sample")),
    make_module=Wan,
    stacks=block_stacks,
    stacked=STACKED,
    layers_around_stacks=(1, 1),  # diffusion-pipe's layers: embedding, blocks, output
    lora_targets=LORA_TARGETS,
    float8_targets=LORA_TARGETS,  # the frozen weights float8 storage covers: the blocks' Linears
    # diffusion-pipe's (ComfyUI's) form, which diffusers' WanPipeline.load_lora_weights also takes
    lora_prefix="diffusion_model.",
    check_inputs=check_inputs,
    random_inputs=random_inputs,
    random_batch=random_batch,
    shared_inputs=(),
    position_ids=None,
    shift_timesteps=shift_timesteps,
    training_inputs=training_inputs,
    condition=condition,
    sampling=SAMPLING,
    sampling_experts=sampling_experts,
    torch_side="diffpipe_jax.encoders.wan",
)
