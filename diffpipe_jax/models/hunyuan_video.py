"""HunyuanVideo transformer in Flax.

Reimplements diffusers `HunyuanVideoTransformer3DModel` with Tencent's parameter names
(`double_blocks.{i}.img_attn_qkv`, `single_blocks.{i}.linear1`, ...): the names of the official
checkpoint and of the LoRAs diffusion-pipe and ComfyUI exchange, so the official file loads by
the naming rule and LoRA export needs no splitting of fused weights. A diffusers folder loads
through `DIFFUSERS_TABLE` (its split q/k/v joined). The 20 double- and 40 single-stream blocks are
Flux's (`layers.DoubleStreamBlock`, `layers.SingleStreamBlock`) with the text after the image,
RoPE on the image tokens only and the padded text masked; they run as two stacks (`stacks`).

Before the blocks: the 1x2x2 patch embedding (a Conv3d whose window is its stride, so a Linear
over each patch), the timestep, guidance and CLIP-pooled embeddings, and the token refiner that
turns the LLaMA states into the text stream. `FAMILY`, at the end, is what the trainer knows of it.
"""
import dataclasses
from typing import Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from diffpipe_jax import flow, stacks
from diffpipe_jax.convert import table
from diffpipe_jax.convert.table import Row
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import Family, Sampling, SingleFile, config_dataclass
from diffpipe_jax.models import layers
from diffpipe_jax.models.layers import Linear
from diffpipe_jax.rules import TEXT, Key, number

GUIDANCE_SCALE = 1000.0  # the model takes guidance * 1000, as HunyuanVideoPipeline passes it
TIMESTEP_SCALE = 1000.0  # and sigma * 1000
REFINER_MLP_RATIO = 4.0  # fixed in diffusers and Tencent's code, whatever the config's mlp_ratio
OFFICIAL_MODEL = "hunyuan-video-t2v-720p"  # the transformer's folder in Tencent's ckpts/
OFFICIAL_FILE = "transformers/mp_rank_00_model_states.pt"  # inside OFFICIAL_MODEL


@dataclasses.dataclass(frozen=True)
class HunyuanVideoConfig:
  """The hyperparameters of diffusers' `HunyuanVideoTransformer3DModel` config.json, same names
  (those it allows one value of are checked by `config_from_diffusers`)."""
  in_channels: int = 16
  out_channels: int = 16
  num_attention_heads: int = 24
  attention_head_dim: int = 128
  num_layers: int = 20
  num_single_layers: int = 40
  num_refiner_layers: int = 2
  mlp_ratio: float = 4.0
  patch_size: int = 2
  patch_size_t: int = 1
  guidance_embeds: bool = True
  text_embed_dim: int = 4096
  pooled_projection_dim: int = 768
  rope_theta: float = 256.0
  rope_axes_dim: Sequence[int] = (16, 56, 56)

  @property
  def inner_dim(self):
    return self.num_attention_heads * self.attention_head_dim

  @property
  def patch(self):
    return (self.patch_size_t, self.patch_size, self.patch_size)


# config.json keys whose other values we do not implement (image-to-video conditioning)
FIXED = dict(qk_norm="rms_norm", image_condition_type=None)
STACKED = ("double_blocks", "single_blocks")
# diffusion-pipe's LoRA targets: every Linear of the double and single blocks.
LORA_TARGETS = (r"double_blocks\..*", r"single_blocks\..*")


def config_from_diffusers(cfg: dict) -> HunyuanVideoConfig:
  return config_dataclass(HunyuanVideoConfig, cfg, FIXED, " (text to video only)")


def config_from_single_file(shapes: dict, metadata: dict, axes_dims_rope=None) -> HunyuanVideoConfig:
  """Every size from the tensor shapes of Tencent's names (the official `.pt` holds no config);
  the RoPE axes, which no shape shows, are the released model's (scaled for other head sizes,
  `layers.default_rope_axes`) unless given; rope_theta is the released 256."""
  inner, in_channels, *patch = shapes["img_in.proj.weight"]
  head_dim = shapes["double_blocks.0.img_attn_q_norm.weight"][0]
  count = lambda prefix: len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})
  try:
    axes = tuple(axes_dims_rope or layers.default_rope_axes(head_dim))
  except ValueError as e:
    raise UserError(f"{e} (the RoPE axes of this HunyuanVideo checkpoint, which it does not "
                    "store; they sum to the head size)") from None
  return HunyuanVideoConfig(
      in_channels=in_channels,
      out_channels=shapes["final_layer.linear.weight"][0] // int(np.prod(patch)),
      num_attention_heads=inner // head_dim,
      attention_head_dim=head_dim,
      num_layers=count("double_blocks."),
      num_single_layers=count("single_blocks."),
      num_refiner_layers=count("txt_in.individual_token_refiner.blocks."),
      mlp_ratio=shapes["double_blocks.0.img_mlp.fc1.weight"][0] / inner,
      patch_size=patch[1],
      patch_size_t=patch[0],
      guidance_embeds="guidance_in.mlp.0.weight" in shapes,
      text_embed_dim=shapes["txt_in.input_embedder.weight"][1],
      pooled_projection_dim=shapes["vector_in.in_layer.weight"][1],
      rope_axes_dim=axes)


# Tencent's (our) module -> the diffusers module(s) it holds, joined along the output rows.
_D, _S, _R = "double_blocks.{i}.", "single_blocks.{i}.", "txt_in.individual_token_refiner.blocks.{i}."
_TD, _TS = "transformer_blocks.{i}.", "single_transformer_blocks.{i}."
_TR = "context_embedder.token_refiner.refiner_blocks.{i}."
_QKV = tuple(f"attn.to_{p}" for p in "qkv")
DIFFUSERS_TABLE = (
    Row("img_in.proj", ("x_embedder.proj",)),
    Row("txt_in.input_embedder", ("context_embedder.proj_in",)),
    *(Row(f"txt_in.t_embedder.mlp.{a}", (f"context_embedder.time_text_embed.timestep_embedder.linear_{b}",))
      for a, b in ((0, 1), (2, 2))),
    *(Row(f"txt_in.c_embedder.linear_{b}", (f"context_embedder.time_text_embed.text_embedder.linear_{b}",))
      for b in (1, 2)),
    Row(_R + "norm1", (_TR + "norm1",)),
    Row(_R + "self_attn_qkv", tuple(_TR + p for p in _QKV)),
    Row(_R + "self_attn_proj", (_TR + "attn.to_out.0",)),
    Row(_R + "norm2", (_TR + "norm2",)),
    Row(_R + "mlp.fc1", (_TR + "ff.net.0.proj",)),
    Row(_R + "mlp.fc2", (_TR + "ff.net.2",)),
    Row(_R + "adaLN_modulation.1", (_TR + "norm_out.linear",)),
    *(Row(f"{ours}.mlp.{a}", (f"time_text_embed.{theirs}_embedder.linear_{b}",))
      for ours, theirs in (("time_in", "timestep"), ("guidance_in", "guidance"))
      for a, b in ((0, 1), (2, 2))),
    Row("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    Row("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
    Row(_D + "img_mod.linear", (_TD + "norm1.linear",)),
    Row(_D + "img_attn_qkv", tuple(_TD + p for p in _QKV)),
    Row(_D + "img_attn_q_norm", (_TD + "attn.norm_q",)),
    Row(_D + "img_attn_k_norm", (_TD + "attn.norm_k",)),
    Row(_D + "img_attn_proj", (_TD + "attn.to_out.0",)),
    Row(_D + "img_mlp.fc1", (_TD + "ff.net.0.proj",)),
    Row(_D + "img_mlp.fc2", (_TD + "ff.net.2",)),
    Row(_D + "txt_mod.linear", (_TD + "norm1_context.linear",)),
    Row(_D + "txt_attn_qkv", tuple(_TD + f"attn.add_{p}_proj" for p in "qkv")),
    Row(_D + "txt_attn_q_norm", (_TD + "attn.norm_added_q",)),
    Row(_D + "txt_attn_k_norm", (_TD + "attn.norm_added_k",)),
    Row(_D + "txt_attn_proj", (_TD + "attn.to_add_out",)),
    Row(_D + "txt_mlp.fc1", (_TD + "ff_context.net.0.proj",)),
    Row(_D + "txt_mlp.fc2", (_TD + "ff_context.net.2",)),
    Row(_S + "linear1", tuple(_TS + p for p in (*_QKV, "proj_mlp"))),
    Row(_S + "linear2", (_TS + "proj_out",)),
    Row(_S + "q_norm", (_TS + "attn.norm_q",)),
    Row(_S + "k_norm", (_TS + "attn.norm_k",)),
    Row(_S + "modulation.linear", (_TS + "norm.linear",)),
    Row("final_layer.linear", ("proj_out",)),
    # Tencent orders the final modulation (shift, scale); diffusers' AdaLayerNormContinuous (scale, shift).
    Row("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap_halves=True),
)


def tencent_tensors(diffusers_tensors: dict) -> dict:
  """diffusers-named torch-order tensors -> Tencent's names (the official file's)."""
  return table.to_single_file(diffusers_tensors, DIFFUSERS_TABLE)


DOUBLE_NAMES = {stream: layers.StreamNames(
    f"{stream}_mod.linear", (f"{stream}_attn_qkv",),
    (f"{stream}_attn_q_norm", f"{stream}_attn_k_norm"), f"{stream}_attn_proj",
    (f"{stream}_mlp.fc1", f"{stream}_mlp.fc2")) for stream in ("img", "txt")}
SINGLE_NAMES = layers.SingleStreamNames("modulation.linear", ("linear1",), ("q_norm", "k_norm"),
                                        "linear2")


class TokenRefiner(layers.Module):
  """diffusers `HunyuanVideoTokenRefiner` (Tencent's `txt_in`): the LLaMA states projected to the
  inner dim and refined by self-attention blocks over the kept tokens, conditioned on the
  timestep and the masked mean of the raw states. Padded tokens attend to the kept ones (diffusers
  lets them see the first token only): they are never attended to, so nothing else changes."""
  cfg: HunyuanVideoConfig
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, text, timestep_sinusoids, mask):
    c, kw = self.cfg, self.kw
    dim = c.inner_dim
    weights = mask.astype(jnp.float32)[..., None]
    pooled = ((text.astype(jnp.float32) * weights).sum(1) / weights.sum(1)).astype(self.dtype)
    temb = (layers.MLPEmbedder(dim, names=("mlp.0", "mlp.2"), name="t_embedder", **kw)(timestep_sinusoids)
            + layers.MLPEmbedder(dim, name="c_embedder", **kw)(pooled))
    x = Linear(dim, name="input_embedder", **kw)(text.astype(self.dtype))
    for i in range(c.num_refiner_layers):
      prefix = f"individual_token_refiner.blocks.{i}."
      gate_msa, gate_mlp = layers.adaln_chunks(temb, 2, prefix + "adaLN_modulation.1", **kw)
      h = layers.LayerNorm(name=prefix + "norm1", **kw)(x)
      q, k, v = (t.reshape(*t.shape[:-1], c.num_attention_heads, c.attention_head_dim)
                 for t in layers.projections(h, (prefix + "self_attn_qkv",), (dim,) * 3, **kw))
      attn = layers.merge_heads(layers.attention(q, k, v, mask, self.attention_impl))
      x = x + gate_msa[:, None] * Linear(dim, name=prefix + "self_attn_proj", **kw)(attn)
      h = Linear(int(dim * REFINER_MLP_RATIO), name=prefix + "mlp.fc1", **kw)(
          layers.LayerNorm(name=prefix + "norm2", **kw)(x))
      x = x + gate_mlp[:, None] * Linear(dim, name=prefix + "mlp.fc2", **kw)(nn.silu(h))
    return x


# As Flux's: a double and a single block have the same matmul FLOPs per token and attention.
block_stacks = stacks.equal_cost(STACKED, ("num_layers", "num_single_layers"))


class HunyuanVideo(layers.Transformer):
  """The transformer. Inputs have diffusers' names and meanings; see `__call__`."""
  cfg: HunyuanVideoConfig

  @nn.compact
  def __call__(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
               pooled_projections, guidance=None, run_stacks=stacks.run_stacks):
    """hidden_states [B, C, F, H, W] latents (H, W multiples of the patch); timestep [B] in
    0..1000; encoder_hidden_states [B, T, text_embed_dim] LLaMA states whose
    encoder_attention_mask [B, T] (1 = keep) is right-padded; pooled_projections [B,
    pooled_projection_dim] CLIP's pooled output; guidance [B] (scale x 1000). Returns the
    prediction [B, out_channels, F, H, W]."""
    c, kw = self.cfg, self.kw
    grid = tuple(n // p for n, p in zip(hidden_states.shape[2:], c.patch))
    img = Linear(c.inner_dim, name="img_in.proj", **kw)(
        layers.patchify(hidden_states, c.patch).astype(self.dtype))
    sinusoids = lambda v: layers.timestep_sinusoids(v).astype(self.dtype)
    temb = layers.MLPEmbedder(c.inner_dim, names=("mlp.0", "mlp.2"), name="time_in", **kw)(
        sinusoids(timestep))
    if c.guidance_embeds:
      temb += layers.MLPEmbedder(c.inner_dim, names=("mlp.0", "mlp.2"), name="guidance_in", **kw)(
          sinusoids(guidance))
    temb += layers.MLPEmbedder(c.inner_dim, names=("in_layer", "out_layer"), name="vector_in",
                               **kw)(pooled_projections)
    txt = TokenRefiner(c, self.attention_impl, name="txt_in", **kw)(
        encoder_hidden_states, sinusoids(timestep), encoder_attention_mask)

    rope = layers.rope_tables(jnp.asarray(layers.grid_positions(grid)), c.rope_axes_dim, c.rope_theta)
    x = jnp.concatenate([img, txt], axis=1)
    # float, not boolean: the blocks' inputs get cotangents (swapped blocks add them up)
    mask = jnp.concatenate([jnp.ones(img.shape[:2], jnp.float32),
                            encoder_attention_mask.astype(jnp.float32)], axis=1)
    double = layers.DoubleStreamBlock(c.num_attention_heads, c.mlp_ratio, txt.shape[1],
                                      **DOUBLE_NAMES, text_first=False,
                                      attention_impl=self.attention_impl, parent=None, **kw)
    single = layers.SingleStreamBlock(c.num_attention_heads, c.mlp_ratio, SINGLE_NAMES,
                                      self.attention_impl, parent=None, **kw)
    x = self.run_blocks(run_stacks, block_stacks(c), (double, single), x, (temb, mask), (rope,))
    img = x[:, :img.shape[1]]

    shift, scale = layers.adaln_chunks(temb, 2, "final_layer.adaLN_modulation.1", **kw)
    out = Linear(int(np.prod(c.patch)) * c.out_channels, name="final_layer.linear", **kw)(
        layers.modulate(layers.layer_norm(img), shift, scale))
    return layers.unpatchify(out, grid, c.patch)


# ---- inputs --------------------------------------------------------------------------------------


REQUIRED = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
            "pooled_projections")


def check_inputs(cfg: HunyuanVideoConfig, inputs: dict) -> dict:
  """Validates `HunyuanVideoTransformer3DModel.forward`'s named inputs, with errors that say what
  to pass."""
  missing = [k for k in REQUIRED if inputs.get(k) is None]
  unknown = sorted(set(inputs) - set(REQUIRED) - {"guidance"})
  if missing or unknown:
    raise TypeError(f"HunyuanVideo inputs: missing {missing}, unexpected {unknown}; expected "
                    f"{REQUIRED} and `guidance` (guidance-distilled checkpoints)")
  x, text, mask = (inputs[k] for k in ("hidden_states", "encoder_hidden_states", "encoder_attention_mask"))
  if x.ndim != 5 or x.shape[1] != cfg.in_channels or any(
      n % p for n, p in zip(x.shape[2:], cfg.patch)):
    raise ValueError(f"hidden_states {x.shape}: pass latents [B, {cfg.in_channels}, F, H, W] with "
                     f"F, H, W multiples of the patch {cfg.patch}")
  batch = x.shape[0]
  if text.shape[::2] != (batch, cfg.text_embed_dim):
    raise ValueError(f"encoder_hidden_states {text.shape}: pass LLaMA states "
                     f"[{batch}, T, {cfg.text_embed_dim}]")
  if mask.shape != text.shape[:2] or bool(jnp.any(jnp.diff(mask.astype(jnp.float32), axis=-1) > 0)):
    raise ValueError(f"encoder_attention_mask {mask.shape}: pass {text.shape[:2]}, 1 for the "
                     "kept tokens first, then 0 for the padding (right padding)")
  if cfg.guidance_embeds and inputs.get("guidance") is None:
    raise ValueError("this HunyuanVideo checkpoint has a guidance embedding: pass `guidance` [B], "
                     "the guidance scale x 1000 (1000.0 for training)")
  if not cfg.guidance_embeds and inputs.get("guidance") is not None:
    raise ValueError("this HunyuanVideo checkpoint has no guidance embedding: pass guidance=None")
  out = dict(inputs)
  for k in ("timestep", "guidance"):
    if out.get(k) is not None:
      out[k] = jnp.broadcast_to(jnp.asarray(out[k], jnp.float32), (batch,))
  return out


def random_inputs(cfg: HunyuanVideoConfig, batch=1, frames=2, height=2, width=3, txt_len=6,
                  seed=0) -> dict:
  """Random forward inputs for a token grid of frames x height x width patches (numpy float32):
  padded text (every sample keeps at least one token, and pads one when it can), the guidance
  diffusion-pipe trains with (1 x 1000). At a sampling guidance of 6 x 1000 the sinusoids' 6000
  rad show one ulp of a frequency, and torch's float32 exp is not correctly rounded (2 of the
  128 are off), so an exact port differs from diffusers by up to 4e-5 there."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  kept = rng.integers(1, max(txt_len, 2), batch)
  sizes = [n * p for n, p in zip((frames, height, width), cfg.patch)]
  return dict(
      hidden_states=normal(batch, cfg.in_channels, *sizes),
      timestep=rng.uniform(50.0, 1000.0, batch).astype(np.float32),
      encoder_hidden_states=normal(batch, txt_len, cfg.text_embed_dim),
      encoder_attention_mask=(np.arange(txt_len)[None] < kept[:, None]).astype(np.float32),
      pooled_projections=normal(batch, cfg.pooled_projection_dim),
      guidance=np.full(batch, GUIDANCE_SCALE, np.float32) if cfg.guidance_embeds else None)


def random_batch(cfg: HunyuanVideoConfig, batch=1, frames=2, height=2, width=3, txt_len=6,
                 seed=0) -> dict:
  """`random_inputs` as a batch of cached samples (what `training_inputs` takes)."""
  inputs = random_inputs(cfg, batch, frames, height, width, txt_len, seed)
  return dict(latents=inputs["hidden_states"], text=inputs["encoder_hidden_states"],
              text_mask=inputs["encoder_attention_mask"], pooled=inputs["pooled_projections"])


# ---- training ------------------------------------------------------------------------------------


def checkpoint_path(model_config) -> str:
  """`model.transformer_path` (a ComfyUI or official file), else `model.ckpt_path` (Tencent's
  folder), else `model.diffusers_path`."""
  path = model_config.transformer_path or model_config.ckpt_path or model_config.diffusers_path
  if not path:
    raise UserError("set --config.model.diffusers_path, --config.model.ckpt_path (Tencent's "
                    "folder) or --config.model.transformer_path (or run the embedded default: "
                    "--config configs/hunyuan_video.py:tiny)")
  return path


def training_inputs(model_config, cfg: HunyuanVideoConfig, batch: dict, noisy, t) -> dict:
  """Model inputs for a batch of cached samples: latents [B, C, F, H, W] (here already noised),
  LLaMA states `text` [B, T, D] and their right-padded `text_mask`, CLIP `pooled` [B, D'];
  t [B] in [0, 1]; the guidance embedding takes `model.guidance` (x 1000, as diffusion-pipe)."""
  n = noisy.shape[0]
  guidance = (jnp.full((n,), model_config.guidance * GUIDANCE_SCALE, jnp.float32)
              if cfg.guidance_embeds else None)
  return dict(hidden_states=noisy, timestep=t * TIMESTEP_SCALE, encoder_hidden_states=batch["text"],
              encoder_attention_mask=batch["text_mask"], pooled_projections=batch["pooled"],
              guidance=guidance)


# HunyuanVideoPipeline's: shift 7, sigmas to 0, distilled guidance 6 (x 1000)
SAMPLING = Sampling(
    scheduler=lambda cfg: dict(shift=7.0), spacing="0", guidance_mode="embedded", steps=50,
    guidance=6.0, latent_shape=lambda cfg, grid: (cfg.in_channels, *grid))


FAMILY = Family(
    type="hunyuan-video",
    diffusers_class="HunyuanVideoTransformer3DModel",
    config_from_diffusers=config_from_diffusers,
    diffusers_rows=DIFFUSERS_TABLE,
    single_file=SingleFile(
        rows=None,  # Tencent's names are ours
        signature="txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",
        prefixes=("model.diffusion_model.", "diffusion_model."),  # ComfyUI's repackagings
        foreign=(),
        config=config_from_single_file,
        locations=(OFFICIAL_FILE, f"{OFFICIAL_MODEL}/{OFFICIAL_FILE}")),
    checkpoint_path=checkpoint_path,
    model_keys=dict(
        diffusers_path=Key(
            "", TEXT, "a diffusers HunyuanVideo folder (transformer, VAE, both text encoders)"),
        ckpt_path=Key(
            "", TEXT,
            "or Tencent's folder: hunyuan-video-t2v-720p/, text_encoder/, text_encoder_2/"),
        transformer_path=Key(
            "", TEXT, "or ComfyUI's transformer (bf16 or fp8_e4m3fn .safetensors), or Tencent's "
            ".pt; wins over the folders"),
        vae_path=Key("", TEXT, "ComfyUI's VAE .safetensors, or Tencent's vae/pytorch_model.pt; "
                     "wins over the folders"),
        llm_path=Key("", TEXT, "ComfyUI's LLaMA text encoder folder; wins over the folders"),
        clip_path=Key("", TEXT, "ComfyUI's CLIP-L text encoder folder; wins over the folders"),
        guidance=Key(
            1.0, number(0), "the guidance embedding's input while training (x 1000 inside)")),
    make_module=HunyuanVideo,
    stacks=block_stacks,
    stacked=STACKED,
    layers_around_stacks=(1, 1, 1),  # diffusion-pipe's layers: embedding, double blocks, join, single, output
    lora_targets=LORA_TARGETS,
    float8_targets=LORA_TARGETS,  # the frozen weights float8 storage covers: the blocks' Linears
    lora_prefix="transformer.",  # diffusion-pipe's form: transformer. + Tencent's names
    check_inputs=check_inputs,
    random_inputs=random_inputs,
    random_batch=random_batch,
    shared_inputs=(),
    position_ids=None,
    shift_timesteps=flow.shift_by_config,
    training_inputs=training_inputs,
    condition=None,
    sampling=SAMPLING,
    torch_side="diffpipe_jax.encoders.hunyuan_video",
)
