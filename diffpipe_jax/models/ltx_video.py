"""LTX-Video transformer in Flax.

Reimplements diffusers `LTXVideoTransformer3DModel` with the same parameter names (the names its
LoRAs are exported in); the blocks are one stack (`stacks`), so their parameters are one array
per weight (`transformer_blocks/attn1/to_q/kernel` is [num_layers, D, D]).

What sets it apart from Flux: RoPE over the whole inner dim (the frequencies of the three axes
interleaved, the heads' channels one after the other), q/k RMSNorm across heads, cross-attention
to the T5 states with their padding masked, and AdaLN-single: one timestep embedding, per sample
or per token, that every block offsets by its own `scale_shift_table`.

`SINGLE_FILE_TABLE` maps Lightricks' single file (`ltx-video-2b-v0.9*.safetensors`, which also
holds the VAE) onto the diffusers names. `FAMILY`, at the end, is what the trainer knows of it.
"""
import dataclasses
import functools
import json
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax import flow, programs, stacks
from diffpipe_jax.convert.table import Row
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import Family, Sampling, SingleFile, config_dataclass
from diffpipe_jax.models import layers
from diffpipe_jax.models.layers import Linear
from diffpipe_jax.rules import PROBABILITY, TEXT, Key, number

VAE_TEMPORAL_RATIO = 8  # video frames per latent frame
VAE_SPATIAL_RATIO = 32  # pixels per latent row or column
ROPE_BASE = np.array([20.0, 2048.0, 2048.0], np.float32)  # what diffusers divides (f, h, w) by
ROPE_THETA = 10000.0
QK_NORM_EPS = 1e-5  # fixed by diffusers' LTXAttention, whatever the config's norm_eps
TIMESTEP_SCALE = 1000.0  # the model takes sigma * 1000, as LTXPipeline passes it
RELEASED_HEADS = {2048: 32, 4096: 32}  # inner dim -> heads of the released models (2B, 13B)


@dataclasses.dataclass(frozen=True)
class LTXVideoConfig:
  """The hyperparameters of diffusers' `LTXVideoTransformer3DModel` config.json, same names
  (those it allows one value of are checked by `config_from_diffusers`)."""
  in_channels: int = 128
  out_channels: int = 128
  patch_size: int = 1
  patch_size_t: int = 1
  num_attention_heads: int = 32
  attention_head_dim: int = 64
  cross_attention_dim: int = 2048
  num_layers: int = 28
  norm_elementwise_affine: bool = False
  norm_eps: float = 1e-6
  caption_channels: int = 4096

  @property
  def inner_dim(self):
    return self.num_attention_heads * self.attention_head_dim


# config.json keys whose other values diffusers does not implement, or we do not
FIXED = dict(activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
             attention_bias=True, attention_out_bias=True)
STACKED = ("transformer_blocks",)
# diffusion-pipe's LoRA targets: every Linear inside the blocks.
LORA_TARGETS = (r"transformer_blocks\..*",)


def config_from_diffusers(cfg: dict) -> LTXVideoConfig:
  return config_dataclass(LTXVideoConfig, cfg, FIXED)


def config_from_single_file(shapes: dict, metadata: dict, axes_dims_rope=None) -> LTXVideoConfig:
  """Sizes from the tensor shapes of a Lightricks single file; the head count (which no shape
  shows) and norm_eps from the `config` its metadata holds (Lightricks' loader reads it too),
  else those of the released model of that width. `axes_dims_rope` does not apply."""
  if axes_dims_rope is not None:
    raise UserError("axes_dims_rope does not apply to LTX-Video, whose RoPE spans the inner dim")
  stored = json.loads(metadata.get("config", "{}")).get("transformer", {})
  inner, in_channels = shapes["patchify_proj.weight"]
  heads = stored.get("num_attention_heads", RELEASED_HEADS.get(inner))
  if heads is None:
    raise UserError(f"this LTX-Video file has no `config` in its metadata and an inner dim "
                    f"({inner}) of no released model, so its head count is unknown: give a "
                    "diffusers folder or a file with Lightricks' metadata")
  return LTXVideoConfig(
      in_channels=in_channels,
      out_channels=shapes["proj_out.weight"][0],
      num_attention_heads=heads,
      attention_head_dim=inner // heads,
      cross_attention_dim=shapes["transformer_blocks.0.attn2.to_k.weight"][1],
      num_layers=len({k.split(".")[1] for k in shapes if k.startswith("transformer_blocks.")}),
      norm_elementwise_affine="transformer_blocks.0.norm1.weight" in shapes,
      norm_eps=stored.get("norm_eps", LTXVideoConfig.norm_eps),
      caption_channels=shapes["caption_projection.linear_1.weight"][1],
  )


# Lightricks' single file: diffusers' names but for these three modules (and the VAE beside).
_B = "transformer_blocks.{i}."
_SAME = ("caption_projection.linear_1", "caption_projection.linear_2", "proj_out",
         *(_B + m for m in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                            "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                            "ff.net.0.proj", "ff.net.2", "norm1", "norm2")))
_TABLE = dict(params=(("scale_shift_table", "scale_shift_table"),))
SINGLE_FILE_TABLE = (
    Row("patchify_proj", ("proj_in",)),
    *(Row("adaln_single." + m, ("time_embed." + m,)) for m in (
        "emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")),
    *(Row(_B + f"attn{n}.{p}_norm", (_B + f"attn{n}.norm_{p}",)) for n in (1, 2) for p in "qk"),
    *(Row(m, (m,)) for m in _SAME),
    Row("", ("",), **_TABLE),  # the model's own final scale_shift_table
    Row("transformer_blocks.{i}", ("transformer_blocks.{i}",), **_TABLE),
)


def rope_frequencies(dim: int) -> np.ndarray:
  """theta ** linspace(0, 1, dim // 6) * pi / 2 in float32, as diffusers computes it: torch's
  linspace (each half counted from its own end), the power rounded from float64. The angles
  reach 1e4 rad, so one ulp of a frequency already shows."""
  n = dim // 6
  step = np.float32(1) / np.float32(n - 1)
  i = np.arange(n, dtype=np.float32)
  exponents = np.where(i < n // 2, step * i, np.float32(1) - step * (np.float32(n - 1) - i))
  powers = (ROPE_THETA ** exponents.astype(np.float64)).astype(np.float32)
  return powers * np.float32(np.pi) / np.float32(2)


def rope_tables(coords, dim: int):
  """diffusers `LTXVideoRotaryPosEmbed` of video_coords [3, S]: (cos, sin) [S, dim], the
  `dim // 6` frequencies major and the (f, h, w) axes interleaved, each angle on a channel
  pair, after `dim % 6` channels that are not rotated."""
  grid = (coords.astype(jnp.float32) / ROPE_BASE[:, None]).T  # [S, 3]
  angles = rope_frequencies(dim)[None, :, None] * (grid[:, None, :] * 2 - 1)
  angles = angles.reshape(grid.shape[0], -1)
  pad = dim % 6
  ones, zeros = jnp.ones((grid.shape[0], pad)), jnp.zeros((grid.shape[0], pad))
  return (jnp.concatenate([ones, jnp.repeat(jnp.cos(angles), 2, axis=-1)], axis=-1),
          jnp.concatenate([zeros, jnp.repeat(jnp.sin(angles), 2, axis=-1)], axis=-1))


def rms_norm(x, eps):
  """RMSNorm without a weight, in float32 (diffusers' RMSNorm with elementwise_affine=False)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def modulation(table, temb):
  """AdaLN-single: a block's `table` [6, D] plus the shared timestep modulation [B, L, 6 D]
  (L = 1 per sample, or per token) -> six [B, L, D] that broadcast over the tokens."""
  mod = table.astype(temb.dtype) + temb.reshape(*temb.shape[:2], *table.shape)
  return [mod[:, :, i] for i in range(table.shape[0])]


class Block(layers.Module):
  """diffusers `LTXVideoTransformerBlock`: modulated self-attention with RoPE, cross-attention
  to the text (on the unnormalised stream, ungated; `context_mask` [B, T] 1 = keep), modulated
  feed-forward."""
  cfg: LTXVideoConfig
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, rope, context, temb, context_mask):
    c, kw = self.cfg, self.kw
    table = self.param("scale_shift_table", nn.initializers.normal(c.inner_dim ** -0.5),
                       (6, c.inner_dim), self.param_dtype)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation(table, temb)
    attention = dict(qk_norm="across_heads", eps=QK_NORM_EPS, implementation=self.attention_impl,
                     **kw)
    h = self._norm("norm1", x) * (1 + scale_msa) + shift_msa
    x = x + layers.SelfAttention(c.num_attention_heads, c.attention_head_dim, name="attn1",
                                 **attention)(h, rope) * gate_msa
    x = x + layers.CrossAttention(c.num_attention_heads, c.attention_head_dim, name="attn2",
                                  **attention)(x, context, keep_mask(context_mask))
    h = self._norm("norm2", x) * (1 + scale_mlp) + shift_mlp
    return x + layers.FeedForward(c.inner_dim, name="ff", **kw)(h) * gate_mlp

  def _norm(self, name, x):
    if self.cfg.norm_elementwise_affine:
      return layers.RMSNorm(eps=self.cfg.norm_eps, name=name, **self.kw)(x)
    return rms_norm(x, self.cfg.norm_eps)


block_stacks = stacks.equal_cost(STACKED, ("num_layers",))  # one stack


class LTXVideo(layers.Transformer):
  """The transformer. Inputs have diffusers' names and meanings; see `__call__`."""
  cfg: LTXVideoConfig

  @nn.compact
  def __call__(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask,
               video_coords, run_stacks=stacks.run_stacks):
    """hidden_states [B, S, C] packed latents (f, h, w order); encoder_hidden_states [B, T,
    caption_channels]; timestep [B] or per token [B, S], in 0..1000; encoder_attention_mask
    [B, T] 1 = keep; video_coords [3, S] (or diffusers' [B, 3, S], rows alike). Returns the
    prediction [B, S, out_channels]. `check_inputs` makes these of diffusers' other forms."""
    c, kw = self.cfg, self.kw
    x = Linear(c.inner_dim, name="proj_in", **kw)(hidden_states.astype(self.dtype))
    batch = x.shape[0]
    sinusoids = layers.timestep_sinusoids(timestep.reshape(-1)).astype(self.dtype)
    emb = layers.MLPEmbedder(c.inner_dim, name="time_embed.emb.timestep_embedder", **kw)(sinusoids)
    temb = programs.ahead(Linear(6 * c.inner_dim, name="time_embed.linear", **kw)(nn.silu(emb)))
    temb, emb = temb.reshape(batch, -1, temb.shape[-1]), emb.reshape(batch, -1, emb.shape[-1])
    context = layers.MLPEmbedder(c.inner_dim, functools.partial(nn.gelu, approximate=True),
                                 name="caption_projection", **kw)(encoder_hidden_states)
    cos, sin = rope_tables(video_coords if video_coords.ndim == 2 else video_coords[0], c.inner_dim)
    per_head = (x.shape[1], c.num_attention_heads, c.attention_head_dim)
    rope = (cos.reshape(per_head), sin.reshape(per_head))
    # float, not boolean: the blocks' inputs get cotangents (swapped blocks add them up)
    mask = encoder_attention_mask.astype(jnp.float32)

    block = Block(c, self.attention_impl, parent=None, **kw)
    x = self.run_blocks(run_stacks, block_stacks(c), [block], x, (context, temb, mask), (rope,))

    table = self.param("scale_shift_table", nn.initializers.normal(c.inner_dim ** -0.5),
                       (2, c.inner_dim), self.param_dtype)
    mod = table.astype(emb.dtype) + emb[:, :, None]  # the one embedding offset by both rows
    shift, scale = mod[:, :, 0], mod[:, :, 1]
    return Linear(c.out_channels, name="proj_out", **kw)(layers.layer_norm(x) * (1 + scale) + shift)


def keep_mask(encoder_attention_mask):
  """diffusers' additive bias (1 - m) * -10000 as a boolean mask: the same softmax in float32
  (exp(-10000) is 0) where any token is kept; where none is, the bias is uniform and so no
  mask at all."""
  keep = encoder_attention_mask > 0.5
  return keep | ~keep.any(-1, keepdims=True)


# ---- inputs --------------------------------------------------------------------------------------


def pipeline_rope_scale(frame_rate):
  """LTXPipeline's `rope_interpolation_scale`: the VAE's ratios over the frame rate in time."""
  return (VAE_TEMPORAL_RATIO / frame_rate, VAE_SPATIAL_RATIO, VAE_SPATIAL_RATIO)


def video_coords(indices, rope_interpolation_scale, cfg: LTXVideoConfig):
  """video_coords [3, S] of latent grid indices [S, 3] (numpy or jax), as diffusers scales its
  grid: index * rope_interpolation_scale * patch size, in float32 (the model divides by
  ROPE_BASE). diffusers takes no scale as the raw indices, undivided."""
  if rope_interpolation_scale is None:
    return (indices * ROPE_BASE).T
  scale = np.asarray([float(s) for s in rope_interpolation_scale], np.float32)
  patch = np.array([cfg.patch_size_t, cfg.patch_size, cfg.patch_size], np.float32)
  return (indices * scale * patch).T


REQUIRED = ("hidden_states", "encoder_hidden_states", "timestep")
GRID = ("num_frames", "height", "width")
OPTIONAL = ("encoder_attention_mask", *GRID, "rope_interpolation_scale", "video_coords")


def check_inputs(cfg: LTXVideoConfig, inputs: dict) -> dict:
  """Validates `LTXVideoTransformer3DModel.forward`'s named inputs, with errors that say what to
  pass, and turns them into the module's: timestep [B] or [B, S], a mask, video_coords [3, S]
  (from the latent grid ints if not given)."""
  missing = [k for k in REQUIRED if inputs.get(k) is None]
  unknown = sorted(set(inputs) - set(REQUIRED) - set(OPTIONAL))
  if missing or unknown:
    raise TypeError(f"LTX-Video inputs: missing {missing}, unexpected {unknown}; expected "
                    f"{REQUIRED}, optionally {OPTIONAL}")
  x, text = inputs["hidden_states"], inputs["encoder_hidden_states"]
  if x.ndim != 3 or x.shape[-1] != cfg.in_channels:
    raise ValueError(f"hidden_states {x.shape}: pass packed latents [B, S, {cfg.in_channels}]")
  batch, tokens = x.shape[:2]
  if text.shape[::2] != (batch, cfg.caption_channels):
    raise ValueError(f"encoder_hidden_states {text.shape}: pass T5 states "
                     f"[{batch}, T, {cfg.caption_channels}]")
  mask = inputs.get("encoder_attention_mask")
  if mask is None:
    mask = jnp.ones(text.shape[:2], jnp.float32)
  if mask.shape != text.shape[:2]:
    raise ValueError(f"encoder_attention_mask {mask.shape}: pass {text.shape[:2]}, 1 = keep "
                     "the text token, 0 = padding")
  return dict(hidden_states=x, encoder_hidden_states=text, encoder_attention_mask=mask,
              timestep=_timestep(inputs["timestep"], batch, tokens),
              video_coords=_coords(cfg, inputs, tokens))


def _timestep(t, batch, tokens):
  t = jnp.asarray(t, jnp.float32)
  if t.ndim == 2 and t.shape[1] == 1:
    t = t[:, 0]
  if t.ndim <= 1 and t.size in (1, batch):
    return jnp.broadcast_to(t, (batch,))
  if t.shape == (batch, tokens):
    return t
  raise ValueError(f"timestep {t.shape}: pass one per sample [{batch}] or one per token "
                   f"[{batch}, {tokens}], in 0..1000 (sigma * 1000)")


def _coords(cfg, inputs, tokens):
  """video_coords [3, S]: as given (diffusers' [B, 3, S] must be alike across the batch), else
  of the latent grid and `rope_interpolation_scale`."""
  coords = inputs.get("video_coords")
  if coords is None:
    grid = [inputs.get(k) for k in GRID]
    if any(g is None for g in grid):
      raise ValueError("pass video_coords [B, 3, S], or num_frames, height and width (the "
                       "latent grid) with rope_interpolation_scale, (8 / frame_rate, 32, 32) "
                       "as LTXPipeline passes it")
    grid = tuple(int(g) for g in grid)
    if np.prod(grid) != tokens:
      raise ValueError(f"num_frames x height x width = {grid} is not the {tokens} tokens of "
                       "hidden_states: pass the latent grid")
    scale = inputs.get("rope_interpolation_scale")
    return jnp.asarray(video_coords(layers.grid_positions(grid), scale, cfg))
  if coords.ndim == 3:
    if not bool(jnp.all(coords == coords[:1])):
      raise ValueError("video_coords differ across the batch: only coordinates shared by the "
                       "batch are supported; pass [3, S]")
    coords = coords[0]
  if coords.shape != (3, tokens):
    raise ValueError(f"video_coords {coords.shape}: pass [3, {tokens}] or [B, 3, {tokens}]")
  return coords


def random_inputs(cfg: LTXVideoConfig, batch=1, frames=2, height=3, width=3, txt_len=6,
                  seed=0) -> dict:
  """Random forward inputs for a latent grid of frames x height x width tokens (numpy float32):
  padded text (every sample keeps at least one token, and pads one when it can), the RoPE
  coordinates LTXPipeline makes at 25 fps."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  kept = rng.integers(1, max(txt_len, 2), batch)
  coords = video_coords(layers.grid_positions((frames, height, width)), pipeline_rope_scale(25), cfg)
  return dict(
      hidden_states=normal(batch, frames * height * width, cfg.in_channels),
      encoder_hidden_states=normal(batch, txt_len, cfg.caption_channels),
      timestep=rng.uniform(50.0, 1000.0, batch).astype(np.float32),
      encoder_attention_mask=(np.arange(txt_len)[None] < kept[:, None]).astype(np.float32),
      video_coords=np.stack([coords] * batch))


def random_batch(cfg: LTXVideoConfig, batch=1, frames=2, height=3, width=3, txt_len=6,
                 seed=0) -> dict:
  """`random_inputs` as a batch of cached samples (what `training_inputs` takes)."""
  inputs = random_inputs(cfg, batch, frames, height, width, txt_len, seed)
  ids = layers.grid_positions((frames, height, width))
  return dict(latents=inputs["hidden_states"], text=inputs["encoder_hidden_states"],
              text_mask=inputs["encoder_attention_mask"], position_ids=np.stack([ids] * batch))


# ---- training ------------------------------------------------------------------------------------


def checkpoint_path(model_config) -> str:
  """`model.single_file_path` (Lightricks' file), else `model.diffusers_path`."""
  path = model_config.single_file_path or model_config.diffusers_path
  if not path:
    raise UserError("set --config.model.diffusers_path or --config.model.single_file_path "
                    "(or run the embedded default: --config configs/ltx_video.py:tiny)")
  return path


def training_inputs(model_config, cfg: LTXVideoConfig, batch: dict, noisy, t) -> dict:
  """Model inputs for a batch of cached samples: packed latents (here already noised), T5
  states `text` [B, T, D] and their `text_mask`, latent grid `position_ids` [B, L, 3] (RoPE
  scaled as LTXPipeline does at `model.frame_rate`); t [B] or per token [B, L], in [0, 1]."""
  coords = video_coords(batch["position_ids"][0], pipeline_rope_scale(model_config.frame_rate), cfg)
  return dict(hidden_states=noisy, encoder_hidden_states=batch["text"],
              encoder_attention_mask=batch["text_mask"], timestep=t * TIMESTEP_SCALE,
              video_coords=coords)


def condition(model_config, cfg: LTXVideoConfig, key, batch, noisy, t):
  """diffusion-pipe's `first_frame_conditioning_p`: with that probability, a video's first latent
  frame stays clean, at t = 0, and out of the loss, so that the model learns to continue a given
  first frame. Images (one latent frame) never are: nothing would be left to learn."""
  p = model_config.first_frame_conditioning_p
  if p == 0:
    return noisy, t, None
  frame = batch["position_ids"][..., 0]  # [B, L]
  chosen = (jax.random.uniform(key, t.shape) < p) & (frame > 0).any(-1)
  clean = (frame == 0) & chosen[:, None]
  noisy = jnp.where(clean[..., None], batch["latents"].astype(noisy.dtype), noisy)
  return noisy, jnp.where(clean, 0.0, t[:, None]), (~clean).astype(jnp.float32)


# LTXPipeline's: the released scheduler (REFERENCE-video.md), classifier-free guidance 3
SAMPLING = Sampling(
    scheduler=lambda cfg: dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                               base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1),
    spacing="1/N", guidance_mode="cfg", steps=50, guidance=3.0,
    latent_shape=lambda cfg, grid: (grid[0] * grid[1] * grid[2], cfg.in_channels))


FAMILY = Family(
    type="ltx-video",
    diffusers_class="LTXVideoTransformer3DModel",
    config_from_diffusers=config_from_diffusers,
    diffusers_rows=None,
    single_file=SingleFile(
        rows=SINGLE_FILE_TABLE,
        signature="patchify_proj.weight",  # tells a Lightricks LTX-Video file from others
        prefixes=("model.diffusion_model.",),  # Lightricks' own files, beside `vae.`
        foreign=("vae.",),
        config=config_from_single_file),
    checkpoint_path=checkpoint_path,
    model_keys=dict(
        diffusers_path=Key(
            "", TEXT, "a diffusers LTX-Video folder: the T5 encoder (and VAE, transformer)"),
        single_file_path=Key(
            "", TEXT, "or Lightricks' single file for transformer and VAE; wins if set"),
        frame_rate=Key(
            25, number(0, above=True),
            "videos are decoded, and RoPE scaled, at this many frames per second"),
        first_frame_conditioning_p=Key(
            0.0, PROBABILITY, "with this probability a sample's first latent frame stays clean "
            "(t ~ 0, no loss on it): the model learns to continue a given first frame (image to "
            "video)")),
    make_module=LTXVideo,
    stacks=block_stacks,
    stacked=STACKED,
    layers_around_stacks=(1, 1),  # diffusion-pipe's layers: embedding, blocks, output
    lora_targets=LORA_TARGETS,
    float8_targets=LORA_TARGETS,  # the frozen weights float8 storage covers: the blocks' Linears
    # diffusion-pipe's (ComfyUI's) form, which diffusers' LTXPipeline.load_lora_weights also takes
    lora_prefix="diffusion_model.",
    check_inputs=check_inputs,
    random_inputs=random_inputs,
    random_batch=random_batch,
    shared_inputs=("video_coords",),
    position_ids=layers.grid_positions,
    shift_timesteps=flow.shift_by_config,
    training_inputs=training_inputs,
    condition=condition,
    sampling=SAMPLING,
    torch_side="diffpipe_jax.encoders.ltx_video",
)
