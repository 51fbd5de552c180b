"""FLUX.1 transformer (dev with guidance embedding, schnell without) in Flax.

Reimplements diffusers `FluxTransformer2DModel` with the same parameter names (the names its
LoRAs are exported in); the 19 double- and 38 single-stream blocks (`layers.DoubleStreamBlock`,
`layers.SingleStreamBlock`, shared with HunyuanVideo) are two stacks (`stacks`), so their
parameters are one array per weight (`transformer_blocks/attn.to_q/kernel` is
[num_layers, D, D]) that the runtime's `run_stacks` runs (`runtime`).

`SINGLE_FILE_TABLE` maps the Black Forest Labs single-file format (`flux1-dev.safetensors`) onto
the diffusers names; `diffpipe_jax.convert` reads it in both directions. `FAMILY`, at the end,
is what the trainer knows of Flux.
"""
import dataclasses
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from diffpipe_jax import flow, stacks
from diffpipe_jax.convert.table import Row
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import Family, Sampling, SingleFile, config_dataclass
from diffpipe_jax.models import layers
from diffpipe_jax.models.layers import Linear
from diffpipe_jax.rules import FLAG, TEXT, Key, number


@dataclasses.dataclass(frozen=True)
class FluxConfig:
  """The hyperparameters of diffusers' `FluxTransformer2DModel` config.json, same names."""
  patch_size: int = 1
  in_channels: int = 64
  out_channels: int = 64
  num_layers: int = 19
  num_single_layers: int = 38
  attention_head_dim: int = 128
  num_attention_heads: int = 24
  joint_attention_dim: int = 4096
  pooled_projection_dim: int = 768
  guidance_embeds: bool = False
  axes_dims_rope: Sequence[int] = (16, 56, 56)
  mlp_ratio: float = 4.0  # fixed in diffusers; read from the shapes of a single file
  timestep_dim: int = 256  # the sinusoid width, likewise

  @property
  def inner_dim(self):
    return self.num_attention_heads * self.attention_head_dim


STACKED = ("transformer_blocks", "single_transformer_blocks")
# diffusion-pipe's LoRA targets: every Linear inside the blocks, AdaLN modulation included.
LORA_TARGETS = (r"transformer_blocks\..*", r"single_transformer_blocks\..*")


def config_from_diffusers(cfg: dict) -> FluxConfig:
  return config_dataclass(FluxConfig, cfg)


def config_from_single_file(shapes: dict, axes_dims_rope=None) -> FluxConfig:
  """Derives every hyperparameter from the tensor shapes of a BFL single file."""
  inner, in_ch = shapes["img_in.weight"]
  head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
  count = lambda prefix: len({k.split(".")[1] for k in shapes if k.startswith(prefix + ".")})
  return FluxConfig(
      in_channels=in_ch,
      out_channels=shapes["final_layer.linear.weight"][0],
      num_layers=count("double_blocks"),
      num_single_layers=count("single_blocks"),
      attention_head_dim=head_dim,
      num_attention_heads=inner // head_dim,
      joint_attention_dim=shapes["txt_in.weight"][1],
      pooled_projection_dim=shapes["vector_in.in_layer.weight"][1],
      guidance_embeds="guidance_in.in_layer.weight" in shapes,
      axes_dims_rope=tuple(axes_dims_rope or layers.default_rope_axes(head_dim)),
      mlp_ratio=shapes["double_blocks.0.img_mlp.0.weight"][0] / inner,
      timestep_dim=shapes["time_in.in_layer.weight"][1],
  )


# BFL single-file module -> the diffusers module(s) it holds (fused ones split by rows).
_D, _S = "double_blocks.{i}.", "single_blocks.{i}."
_TD, _TS = "transformer_blocks.{i}.", "single_transformer_blocks.{i}."
_NORM = dict(params=(("weight", "scale"),))
SINGLE_FILE_TABLE = (
    Row("img_in", ("x_embedder",)),
    Row("txt_in", ("context_embedder",)),
    Row("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
    Row("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
    Row("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    Row("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
    Row("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
    Row("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",)),
    Row(_D + "img_mod.lin", (_TD + "norm1.linear",)),
    Row(_D + "txt_mod.lin", (_TD + "norm1_context.linear",)),
    Row(_D + "img_attn.qkv", tuple(_TD + "attn.to_" + p for p in "qkv")),
    Row(_D + "txt_attn.qkv", tuple(_TD + f"attn.add_{p}_proj" for p in "qkv")),
    Row(_D + "img_attn.norm.query_norm", (_TD + "attn.norm_q",), **_NORM),
    Row(_D + "img_attn.norm.key_norm", (_TD + "attn.norm_k",), **_NORM),
    Row(_D + "txt_attn.norm.query_norm", (_TD + "attn.norm_added_q",), **_NORM),
    Row(_D + "txt_attn.norm.key_norm", (_TD + "attn.norm_added_k",), **_NORM),
    Row(_D + "img_attn.proj", (_TD + "attn.to_out.0",)),
    Row(_D + "txt_attn.proj", (_TD + "attn.to_add_out",)),
    Row(_D + "img_mlp.0", (_TD + "ff.net.0.proj",)),
    Row(_D + "img_mlp.2", (_TD + "ff.net.2",)),
    Row(_D + "txt_mlp.0", (_TD + "ff_context.net.0.proj",)),
    Row(_D + "txt_mlp.2", (_TD + "ff_context.net.2",)),
    Row(_S + "linear1", tuple(_TS + p for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))),
    Row(_S + "linear2", (_TS + "proj_out",)),
    Row(_S + "norm.query_norm", (_TS + "attn.norm_q",), **_NORM),
    Row(_S + "norm.key_norm", (_TS + "attn.norm_k",), **_NORM),
    Row(_S + "modulation.lin", (_TS + "norm.linear",)),
    Row("final_layer.linear", ("proj_out",)),
    # BFL orders the final modulation (shift, scale); diffusers' AdaLayerNormContinuous (scale, shift).
    Row("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap_halves=True),
)


# The blocks' module names: diffusers', in which Flux's LoRAs are exported.
DOUBLE_NAMES = dict(
    img=layers.StreamNames("norm1.linear", tuple(f"attn.to_{p}" for p in "qkv"),
                           ("attn.norm_q", "attn.norm_k"), "attn.to_out.0",
                           ("ff.net.0.proj", "ff.net.2")),
    txt=layers.StreamNames("norm1_context.linear", tuple(f"attn.add_{p}_proj" for p in "qkv"),
                           ("attn.norm_added_q", "attn.norm_added_k"), "attn.to_add_out",
                           ("ff_context.net.0.proj", "ff_context.net.2")))
SINGLE_NAMES = layers.SingleStreamNames(
    "norm.linear", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    ("attn.norm_q", "attn.norm_k"), "proj_out")


# The double blocks, then the single ones. A double block has 2.4x the weights of a single one
# but the same matmul FLOPs per token (12 D^2: qkv 3, out 1, MLP 8 against qkv 3, MLP 4, fused
# out 5) and the same attention, so both cost the same.
block_stacks = stacks.equal_cost(STACKED, ("num_layers", "num_single_layers"))


class Flux(layers.Transformer):
  """The transformer. Inputs have diffusers' names and meanings; see `__call__`."""
  cfg: FluxConfig

  @nn.compact
  def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
               img_ids, txt_ids, guidance=None, run_stacks=stacks.run_stacks):
    """hidden_states [B, L, C] packed latents; encoder_hidden_states [B, T, joint_dim];
    pooled_projections [B, pooled_dim]; timestep [B] in [0, 1]; img_ids [L, 3]; txt_ids [T, 3];
    guidance [B] (dev only). Returns the prediction [B, L, C_out].
    `run_stacks` runs the block stacks: the runtime's (`runtime.Runtime`), by default scanned
    on one device."""
    c = self.cfg
    kw = self.kw
    img = Linear(c.inner_dim, name="x_embedder", **kw)(hidden_states.astype(self.dtype))
    txt = Linear(c.inner_dim, name="context_embedder", **kw)(encoder_hidden_states.astype(self.dtype))

    # Times are scaled x1000 in the compute dtype first, as diffusers does (bf16 rounds them).
    sinusoids = lambda v: layers.timestep_sinusoids(
        v.astype(self.dtype) * 1000, c.timestep_dim).astype(self.dtype)
    temb = layers.MLPEmbedder(c.inner_dim, name="time_text_embed.timestep_embedder", **kw)(
        sinusoids(timestep))
    if c.guidance_embeds:
      temb += layers.MLPEmbedder(c.inner_dim, name="time_text_embed.guidance_embedder", **kw)(
          sinusoids(guidance))
    temb += layers.MLPEmbedder(c.inner_dim, name="time_text_embed.text_embedder", **kw)(
        pooled_projections)

    rope = layers.rope_tables(jnp.concatenate([txt_ids, img_ids], axis=0), c.axes_dims_rope, 10000.0)
    x = jnp.concatenate([txt, img], axis=1)
    double = layers.DoubleStreamBlock(
        c.num_attention_heads, c.mlp_ratio, txt.shape[1], **DOUBLE_NAMES, text_first=True,
        attention_impl=self.attention_impl, parent=None, **kw)
    single = layers.SingleStreamBlock(c.num_attention_heads, c.mlp_ratio, SINGLE_NAMES,
                                      self.attention_impl, parent=None, **kw)
    x = self.run_blocks(run_stacks, block_stacks(c), (double, single), x, (temb,), (rope,))
    img = x[:, txt.shape[1]:]

    scale, shift = layers.adaln_chunks(temb, 2, "norm_out.linear", **kw)
    out_dim = c.patch_size ** 2 * c.out_channels
    return Linear(out_dim, name="proj_out", **kw)(layers.modulate(layers.layer_norm(img), shift, scale))


def check_inputs(cfg: FluxConfig, inputs: dict) -> dict:
  """Validates the named inputs of a forward call, with errors that say what to pass."""
  required = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
              "img_ids", "txt_ids")
  missing = [k for k in required if inputs.get(k) is None]
  unknown = sorted(set(inputs) - set(required) - {"guidance"})
  if missing or unknown:
    raise TypeError(f"Flux inputs: missing {missing}, unexpected {unknown}; expected {required} "
                    "and `guidance` (FLUX.1-dev only)")
  if cfg.guidance_embeds and inputs.get("guidance") is None:
    raise ValueError("this Flux checkpoint has a guidance embedding (FLUX.1-dev): pass `guidance` "
                     "[B], e.g. 1.0 for training or the distilled CFG scale (3.5) for sampling")
  if not cfg.guidance_embeds and inputs.get("guidance") is not None:
    raise ValueError("this Flux checkpoint has no guidance embedding (FLUX.1-schnell): "
                     "pass guidance=None")
  out = dict(inputs)
  for k in ("img_ids", "txt_ids"):  # diffusers' deprecated batched ids: all rows are equal
    if out[k].ndim == 3:
      out[k] = out[k][0]
  out["timestep"] = jnp.broadcast_to(jnp.asarray(out["timestep"]), out["hidden_states"].shape[:1])
  if out.get("guidance") is not None:
    out["guidance"] = jnp.broadcast_to(jnp.asarray(out["guidance"]), out["hidden_states"].shape[:1])
  return out


def checkpoint_path(model_config) -> str:
  """`model.transformer_path` (a BFL single file), else `model.diffusers_path`."""
  path = model_config.transformer_path or model_config.diffusers_path
  if not path:
    raise UserError("set --config.model.diffusers_path or --config.model.transformer_path "
                    "(or run the embedded default: --config configs/flux.py:tiny)")
  return path


def training_inputs(model_config, cfg: FluxConfig, batch: dict, noisy, t) -> dict:
  """Model inputs for a batch of cached samples: packed latents [B, L, C] (here already noised),
  T5 states `text` [B, T, D], CLIP `pooled` [B, D'], `position_ids` [B, L, 3]; the guidance
  embedding (FLUX.1-dev) takes `model.guidance`."""
  n = noisy.shape[0]
  return dict(hidden_states=noisy, encoder_hidden_states=batch["text"],
              pooled_projections=batch["pooled"], timestep=t, img_ids=batch["position_ids"][0],
              txt_ids=jnp.zeros((batch["text"].shape[1], 3), jnp.float32),
              guidance=jnp.full((n,), model_config.guidance, jnp.float32) if cfg.guidance_embeds else None)


def shift_mu(image_tokens):
  """FluxPipeline's resolution-dependent shift: mu linear in image tokens, 0.5 at 256 to 1.15
  at 4096."""
  return 0.5 + (1.15 - 0.5) * (image_tokens - 256) / (4096 - 256)


def shift_timesteps(model_config, t, latents):
  """`model.shift`, or with `model.flux_shift` the shift FluxPipeline samples with at this
  resolution (`shift_mu` of the latents' tokens)."""
  if model_config.flux_shift:
    return flow.exponential_shift(t, shift_mu(latents.shape[1]))
  return flow.shift_by_config(model_config, t)


def position_ids(grid) -> np.ndarray:
  """Position ids of a cached bucket's packed latent grid (rows, columns)."""
  return image_ids(*grid)


def image_ids(height: int, width: int) -> np.ndarray:
  """Position ids [h*w, 3] of a packed latent grid: (0, row, column), as FluxPipeline makes them."""
  ids = np.zeros((height, width, 3), np.float32)
  ids[..., 1] = np.arange(height)[:, None]
  ids[..., 2] = np.arange(width)[None, :]
  return ids.reshape(-1, 3)


def random_batch(cfg: FluxConfig, batch=1, height=4, width=4, txt_len=6, seed=0) -> dict:
  """`random_inputs` as a batch of cached samples (what `training_inputs` takes)."""
  inputs = random_inputs(cfg, batch, height, width, txt_len, seed)
  return dict(latents=inputs["hidden_states"], text=inputs["encoder_hidden_states"],
              pooled=inputs["pooled_projections"],
              position_ids=np.stack([inputs["img_ids"]] * batch))


def random_inputs(cfg: FluxConfig, batch=1, height=4, width=4, txt_len=6, seed=0) -> dict:
  """Random forward inputs for a packed latent grid of height x width tokens (numpy float32)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return dict(
      hidden_states=normal(batch, height * width, cfg.in_channels * cfg.patch_size ** 2),
      encoder_hidden_states=normal(batch, txt_len, cfg.joint_attention_dim),
      pooled_projections=normal(batch, cfg.pooled_projection_dim),
      timestep=rng.uniform(0.05, 1.0, batch).astype(np.float32),
      img_ids=image_ids(height, width), txt_ids=np.zeros((txt_len, 3), np.float32),
      guidance=rng.uniform(1.0, 5.0, batch).astype(np.float32) if cfg.guidance_embeds else None)


# FluxPipeline's: FLUX.1-dev's scheduler (resolution-dependent shift) and distilled guidance 3.5;
# schnell's (no guidance embedding) has no shift
DEV_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                     base_image_seq_len=256, max_image_seq_len=4096, shift=3.0)
SAMPLING = Sampling(
    scheduler=lambda cfg: DEV_SCHEDULER if cfg.guidance_embeds else dict(shift=1.0),
    spacing="1/N", guidance_mode="embedded", steps=28, guidance=3.5,
    latent_shape=lambda cfg, grid: (grid[0] * grid[1], cfg.in_channels))


FAMILY = Family(
    type="flux",
    diffusers_class="FluxTransformer2DModel",
    config_from_diffusers=config_from_diffusers,
    diffusers_rows=None,
    single_file=SingleFile(
        rows=SINGLE_FILE_TABLE,
        signature="double_blocks.0.img_attn.qkv.weight",  # tells a BFL Flux file from others
        prefixes=("model.diffusion_model.", "diffusion_model."),  # ComfyUI-style repackagings
        foreign=(),
        # BFL's metadata holds no config
        config=lambda shapes, metadata, axes: config_from_single_file(shapes, axes)),
    checkpoint_path=checkpoint_path,
    model_keys=dict(
        diffusers_path=Key(
            "", TEXT, "a diffusers pipeline folder (holds transformer/, vae/, text encoders)"),
        transformer_path=Key("", TEXT, "or a BFL single file (flux1-dev.safetensors); wins if set"),
        flux_shift=Key(
            False, FLAG, "FluxPipeline's resolution-dependent shift instead of model.shift"),
        guidance=Key(1.0, number(0), "the guidance embedding's input in training (FLUX.1-dev)")),
    make_module=Flux,
    stacks=block_stacks,
    stacked=STACKED,
    layers_around_stacks=(1, 0, 1),  # diffusion-pipe's layers: embedding, double, single blocks, final layer
    lora_targets=LORA_TARGETS,
    float8_targets=LORA_TARGETS,  # the frozen weights that float8 storage covers: the blocks' Linears
    lora_prefix="transformer.",
    check_inputs=check_inputs,
    random_inputs=random_inputs,
    random_batch=random_batch,
    shared_inputs=("img_ids", "txt_ids"),
    position_ids=position_ids,
    shift_timesteps=shift_timesteps,
    training_inputs=training_inputs,
    condition=None,
    sampling=SAMPLING,
    torch_side="diffpipe_jax.encoders.flux",
)
