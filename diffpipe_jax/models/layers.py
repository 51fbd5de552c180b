"""Building blocks shared by the diffusion transformers (Flux, LTX-Video, HunyuanVideo).

Module and parameter names mirror the diffusers modules they reimplement (`to_q`, `norm_q`,
`linear_1`, `net.0.proj`, ...), so that a Flax path joined with "." is the diffusers key and
checkpoint conversion is a naming rule plus a small table (see `diffpipe_jax.convert`).

Every module takes `dtype` (compute), `param_dtype` (storage) and `lora_dropout` (see `Module`).
Norms, RoPE and the timestep sinusoids are computed in float32 whatever the compute dtype, as
diffusers does.
"""
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax import programs, runtime, sequence, stacks

Dtype = Any


class Module(nn.Module, kw_only=True):
  """Our modules' shared settings, handed down unchanged to every submodule through `self.kw`."""
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  lora_dropout: float = 0.0  # dropout on the input of each LoRA (training only; rng "dropout")

  @property
  def kw(self):
    return dict(dtype=self.dtype, param_dtype=self.param_dtype, lora_dropout=self.lora_dropout)


class Transformer(Module, kw_only=True):
  """A family's transformer, whose stacks of blocks run as the runtime runs them (`run_blocks`)."""
  attention_impl: Optional[str] = None

  def run_blocks(self, run_stacks, specs, blocks, x, per_sample, shared):
    """x through a stack of each of `blocks` (unbound modules, each called as
    block(x, *shared, *per_sample)) by `run_stacks` (the runtime's: `runtime.Runtime`); `specs`:
    the family's (name, length, cost) of each stack, its weights and LoRA this module's
    variables of that name."""
    built = [stacks.Stack(name, block, length,
                          stacked_params(self, name, block, length, x, *shared, *per_sample),
                          self.get_variable("lora", name) if self.has_variable("lora", name) else None)
             for (name, length, _), block in zip(specs, blocks)]
    key = self.make_rng("dropout") if self.lora_dropout > 0 else None
    return run_stacks(built, x, per_sample, shared, key=key)


class Linear(Module):
  """`torch.nn.Linear` with a Flax (in, out) kernel, plus a LoRA when the variables hold one.

  The LoRA lives in its own collection, `lora/.../lora_A` [in, r] and `lora_B` [r, out] (alpha =
  r, so scale 1), so base weights and adapter are separate trees: only the adapter is
  differentiated and optimised. See `diffpipe_jax.lora`. A frozen kernel may be stored in
  float8 with a per-output-channel `kernel_scale` (`quantize_float8`); its matmul then runs
  in float8 (`float8_matmul`). Its input is an array or a list of arrays, taken as their
  concatenation on the last axis, which is then never written out (`matmul_of_parts`: the
  single-stream blocks' output Linear, benchmarks/HISTORY.md "Sampling and the step: the weight
  copies XLA added"). `lora_down`: its LoRA's down
  projection of x where the caller computed it (`linears_of_one_input`).
  """
  features: int

  @nn.compact
  def __call__(self, x, lora_down=None):
    parts = [p.astype(self.dtype) for p in (x if isinstance(x, (list, tuple)) else [x])]
    in_place = runtime.kernels_in_place()  # the runtime's matmul policy
    float8 = self.has_variable("params", "kernel_scale")
    # Joined: a float8 kernel's activations, quantised per row of the whole input; and, where
    # the matmuls read a scanned layer's kernel in place (below), parts that are smaller joined
    # than the kernel, of which each row slice would be copied at every call.
    if float8 or (in_place and len(parts) > 1
                  and math.prod(parts[0].shape[:-1]) < self.features):
      parts = [jnp.concatenate(parts, -1)]
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (sum(p.shape[-1] for p in parts), self.features), self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
    if float8:
      y = float8_matmul(parts[0], kernel, self.get_variable("params", "kernel_scale"))
    else:
      y = matmul_of_parts(parts, kernel.astype(self.dtype), summed_apart=not in_place)
    bias = bias.astype(self.dtype)
    if self.lora_a() is None:
      return programs.keep(y + bias)
    if lora_down is None:
      lora_down = self.lora_down(parts)
    lora_out = lora_down @ self.get_variable("lora", "lora_B").astype(self.dtype)
    # A matmul that reads a scanned layer's slice of a stacked kernel copies that slice first
    # unless it has no epilogue (a bias, or a GELU that follows) and an addend that the step does
    # not keep: so, where the scanned step keeps no matmul output (`runtime.kernels_in_place`), the
    # bias joins the LoRA's output, the matmul's addend, and the sum is fenced off from what
    # follows; where the step keeps them, that placement copies more (benchmarks/HISTORY.md, "The
    # bias beside the LoRA, the modulations ahead" and "Every kernel read in place").
    if in_place:
      return programs.keep(jax.lax.optimization_barrier(y + (lora_out + bias)))
    return programs.keep(y + bias + lora_out)

  def lora_down(self, parts):
    """The LoRA's down projection of the parts (its input), kept for the backward pass."""
    if self.lora_dropout > 0:
      keys = jax.random.split(self.make_rng("dropout"), len(parts))
      parts = [jnp.where(jax.random.bernoulli(key, 1 - self.lora_dropout, p.shape),
                         p / (1 - self.lora_dropout), 0) for p, key in zip(parts, keys)]
    return programs.keep(matmul_of_parts(parts, self.lora_a()))

  def lora_a(self):
    """The LoRA's down kernel in the compute dtype; None where the variables hold no LoRA."""
    if not self.has_variable("lora", "lora_A"):
      return None
    return self.get_variable("lora", "lora_A").astype(self.dtype)


def linears_of_one_input(x, names: Sequence[str], widths: Sequence[int], **kw):
  """x through one Linear per name, of the given output widths (submodules of the calling
  compact module), their LoRAs' down projections computed as one matmul of their joined down
  kernels: for q, k and v, one rank-sized matmul rather than three, forward and backward, where
  each is a kernel launch for little work. Not with LoRA dropout, which draws a mask per Linear."""
  linears = [Linear(w, name=n, **kw) for n, w in zip(names, widths)]
  kernels = [linear.lora_a() for linear in linears]
  if linears[0].lora_dropout > 0 or any(k is None for k in kernels):
    return [linear(x) for linear in linears]
  joined = programs.keep(x.astype(linears[0].dtype) @ jnp.concatenate(kernels, axis=-1))
  downs = split_widths(joined, [k.shape[-1] for k in kernels])
  return [linear(x, down) for linear, down in zip(linears, downs)]


def split_widths(x, widths: Sequence[int]):
  """x split on its last axis into consecutive pieces of the given widths."""
  return jnp.split(x, np.cumsum(widths)[:-1].tolist(), axis=-1)


def matmul_of_parts(parts, kernel, summed_apart=False):
  """concatenate(parts, -1) @ kernel without the concatenation: each part times its rows of the
  kernel (contiguous), summed. XLA makes one product the other's matmul addend, and a matmul
  with an addend copies its static slice of a kernel; `summed_apart` keeps the products apart
  (the sum then fuses into what follows), so that each reads its rows in place."""
  if len(parts) == 1:
    return parts[0] @ kernel
  starts = np.cumsum([0] + [p.shape[-1] for p in parts])
  products = [p @ kernel[start:end] for p, start, end in zip(parts, starts[:-1], starts[1:])]
  first, *rest = jax.lax.optimization_barrier(products) if summed_apart else products
  return sum(rest, first)


def quantize_float8(x, axis):
  """float8_e4m3fn x with one float32 scale per slice along `axis` (its max maps to e4m3's max):
  x ~= q * scale, the scale keeping `axis` as size 1. A kernel [..., in, out] takes axis=-2
  (one scale per output channel, which then applies to the matmul's output), activations -1."""
  # The max is exact in x's own dtype; no float32 copy of a whole stacked kernel for it.
  amax = jnp.abs(x).max(axis=axis, keepdims=True).astype(jnp.float32)
  scale = jnp.maximum(amax, 1e-12) / float(jnp.finfo(jnp.float8_e4m3fn).max)
  return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def _float8_dot(q, q_scale, kernel, contract, channel_scale, dtype):
  """(q * q_scale) @ kernel * channel_scale as one float8 GEMM (cuBLASLt on Hopper), with both
  scales applied to its output: a row scale and a column scale commute with the matmul."""
  y = jax.lax.dot_general(q, kernel, (((q.ndim - 1,), (contract,)), ((), ())),
                          preferred_element_type=dtype)
  return (y.astype(jnp.float32) * q_scale * channel_scale).astype(dtype)


@jax.custom_vjp
def float8_matmul(x, kernel, kernel_scale):
  """x @ (kernel * kernel_scale) for a float8 kernel [in, out] with per-output-channel scales.

  x is quantised to float8 per row (token) on the fly, so the matmul runs in float8 (twice
  Hopper's bf16 rate) and the kernel is never upcast. The backward pass quantises the output
  cotangent the same way; the kernel is frozen, so only x gets a gradient."""
  return _float8_dot(*quantize_float8(x, -1), kernel, 0, kernel_scale, x.dtype)


def _float8_matmul_fwd(x, kernel, kernel_scale):
  return float8_matmul(x, kernel, kernel_scale), (kernel, kernel_scale)


def _float8_matmul_bwd(residuals, ct):
  kernel, kernel_scale = residuals
  return _float8_dot(*quantize_float8(ct * kernel_scale, -1), kernel, 1, 1.0, ct.dtype), None, None


float8_matmul.defvjp(_float8_matmul_fwd, _float8_matmul_bwd)


def layer_norm(x, eps=1e-6):
  """LayerNorm without affine parameters, in float32."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(x, shift, scale):
  """AdaLN: x * (1 + scale) + shift, with per-sample [B, D] shift and scale."""
  return x * (1 + scale[:, None]) + shift[:, None]


class RMSNorm(Module):
  """`torch.nn.RMSNorm` over the last axis; parameter `weight` as in torch."""
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    # The scale is made on its own (one float per row), not fused with the multiply into one
    # normalising kernel: the multiply then fuses into the kernel of what follows (RoPE), so
    # the normalised q and k are not written out in float32 and read back (benchmarks/HISTORY.md,
    # "Sampling and the step: the weight copies XLA added").
    scale = jax.lax.optimization_barrier(
        jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps))
    return (x32 * scale * weight.astype(jnp.float32)).astype(self.dtype)


class LayerNorm(Module):
  """`torch.nn.LayerNorm` over the last axis with its affine `weight` and `bias`, in float32."""
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
    y = layer_norm(x.astype(jnp.float32), self.eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def timestep_sinusoids(t, dim=256, max_period=10000.0):
  """diffusers `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)`."""
  args = t.astype(jnp.float32)[:, None] * sinusoid_frequencies(dim, max_period)[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def sinusoid_frequencies(dim: int, max_period: float) -> np.ndarray:
  """exp(-log(max_period) * i / half) in float32: the exponents in torch's float32 order, the
  power correctly rounded (XLA's float32 exp is not, and is 1 ulp off torch's for an eighth of
  them). The arguments reach 6000 rad (guidance 6 x 1000), where one ulp of a frequency is
  already 1e-4 rad."""
  half = dim // 2
  exponents = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half)
  return np.exp(exponents.astype(np.float64)).astype(np.float32)


class MLPEmbedder(Module):
  """linear_1 -> activation -> linear_2 (diffusers `TimestepEmbedding`: SiLU;
  `PixArtAlphaTextProjection`: SiLU or GELU(tanh)); `names`: the two Linears' (Tencent's
  `mlp.0`/`mlp.2`, `in_layer`/`out_layer`)."""
  dim: int
  activation: Callable = nn.silu
  names: Tuple[str, str] = ("linear_1", "linear_2")

  @nn.compact
  def __call__(self, x):
    kw = self.kw
    x = Linear(self.dim, name=self.names[0], **kw)(x.astype(self.dtype))
    return Linear(self.dim, name=self.names[1], **kw)(self.activation(x))


class FeedForward(Module):
  """diffusers `FeedForward(activation_fn="gelu-tanh")`: net.0.proj -> GELU(tanh) -> net.2."""
  dim: int
  mult: float = 4.0

  @nn.compact
  def __call__(self, x):
    kw = self.kw
    h = Linear(int(self.dim * self.mult), name="net.0.proj", **kw)(x)
    return Linear(self.dim, name="net.2", **kw)(nn.gelu(h, approximate=True))


def patchify(latents, patch):
  """[B, C, F, H, W] -> [B, F'*H'*W', C*pt*ph*pw]: tokens in (f, h, w) order, each patch's
  features in the Conv3d weight's (c, t, h, w) order (the patch embedding is a Linear over
  them)."""
  b, c, f, h, w = latents.shape
  pt, ph, pw = patch
  x = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
  x = x.transpose(0, 2, 4, 6, 1, 3, 5, 7)
  return x.reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens, grid, patch, channels_last=False):
  """[B, F'*H'*W', P] -> [B, C, F, H, W], the inverse of `patchify`: each token's P features in
  (c, t, h, w) order (HunyuanVideo's output Linear), or (t, h, w, c) with `channels_last`
  (Wan's)."""
  b = tokens.shape[0]
  (f, h, w), (pt, ph, pw) = grid, patch
  if channels_last:
    x = tokens.reshape(b, f, h, w, pt, ph, pw, -1).transpose(0, 7, 1, 4, 2, 5, 3, 6)
  else:
    x = tokens.reshape(b, f, h, w, -1, pt, ph, pw).transpose(0, 4, 1, 5, 2, 6, 3, 7)
  return x.reshape(b, x.shape[1], f * pt, h * ph, w * pw)


def grid_positions(grid) -> np.ndarray:
  """Token grid indices [F*H*W, 3] (frame, row, column) in the packed token order."""
  ids = np.stack(np.meshgrid(*map(np.arange, grid), indexing="ij"), -1)
  return ids.reshape(-1, 3).astype(np.float32)


def rope_tables(ids, axes_dims: Sequence[int], theta: float):
  """Rotary tables for n-D integer positions ids [S, n]: (cos, sin), each [S, sum(axes_dims)].

  Each axis i rotates `axes_dims[i]` channels as interleaved pairs (diffusers
  `get_1d_rotary_pos_embed(..., repeat_interleave_real=True, use_real=True)`).
  """
  cos, sin = [], []
  for axis, dim in enumerate(axes_dims):
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = ids[:, axis].astype(jnp.float32)[:, None] * inv_freq[None]
    cos.append(jnp.repeat(jnp.cos(angles), 2, axis=-1))
    sin.append(jnp.repeat(jnp.sin(angles), 2, axis=-1))
  return jnp.concatenate(cos, -1), jnp.concatenate(sin, -1)


def default_rope_axes(head_dim: int):
  """The RoPE axes of FLUX.1 and HunyuanVideo, (16, 56, 56) at head_dim 128: 16 channels rotated
  by time (frames; unused by FLUX.1) and the rest split between rows and columns. Scaled the
  same way for smaller heads; for a head that does not split so, pass the axes."""
  t = head_dim // 8
  hw = (head_dim - t) // 2
  if head_dim % 8 or hw % 2 or t + 2 * hw != head_dim:
    raise ValueError(f"cannot derive the RoPE axes for head_dim={head_dim}; pass axes_dims_rope")
  return (t, hw, hw)


def apply_rope(x, rope):
  """Rotate interleaved channel pairs of x [B, S, N, H] by tables [S, H] (the same for every
  head) or [S, N, H] (LTX-Video's, which span the heads); float32 math."""
  cos, sin = (t[None, :, None] if t.ndim == 2 else t[None] for t in rope)
  x32 = x.astype(jnp.float32)
  # each pair (a, b) -> (-b, a): the pair reversed, its first element negated (a stack of -b
  # and a makes XLA's norm-and-RoPE fusion slower: benchmarks/HISTORY.md, "Sampling: RoPE by
  # reversal")
  pairs = x32.reshape(*x.shape[:-1], -1, 2)
  rotated = (pairs[..., ::-1] * np.array([-1, 1], np.float32)).reshape(x.shape)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def apply_rope_to_prefix(x, rope):
  """`apply_rope` on the tokens the tables cover, the first ones (HunyuanVideo's image tokens
  before the text); the rest pass as they are."""
  n = rope[0].shape[0]
  if n == x.shape[1]:
    return apply_rope(x, rope)
  return jnp.concatenate([apply_rope(x[:, :n], rope), x[:, n:]], axis=1)


def attention(q, k, v, mask=None, implementation: Optional[str] = None):
  """Softmax attention on [B, S, N, H] tensors: cuDNN flash attention on GPU, XLA elsewhere.
  `mask` [B, S_kv] (True: attend) masks padded keys, which must follow the kept ones (right
  padding, as the tokenizers pad): it is passed as each row's key count, which cuDNN's kernel
  takes as it is (a mask would be a bias of [B, N, S_q, S_kv]). The one place attention is
  computed."""
  lengths = None if mask is None else jnp.sum(mask, axis=-1, dtype=jnp.int32)
  q, k, v = map(sequence.over_heads, (q, k, v))  # (sequence parallelism: all-to-all to the heads)
  return sequence.over_tokens(jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, implementation=implementation))


def default_attention_implementation(dtype) -> Optional[str]:
  """cuDNN's fused kernel where it applies (GPU, 16-bit); XLA's otherwise."""
  if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  return None


def projections(x, names: Sequence[str], widths: Sequence[int], **kw):
  """x through one Linear per name, of the given output widths; or, one name, through one
  fused Linear of their sum (Tencent's `img_attn_qkv`, `linear1`), split alike. Called inside a
  compact module, whose submodules the Linears become."""
  if len(names) == 1:
    fused = Linear(sum(widths), name=names[0], **kw)(x)
    return split_widths(fused, widths)
  return linears_of_one_input(x, names, widths, **kw)


def normed_heads(q, k, v, heads: int, norms: Sequence[str], qk_norm: str = "per_head",
                 eps: float = 1e-6, **kw):
  """q, k, v [B, S, heads * H] -> [B, S, heads, H], q and k RMS-normalised by the RMSNorms
  `norms`: per head (Flux, HunyuanVideo) or across heads before the split (LTX-Video)."""
  split = lambda t: t.reshape(*t.shape[:-1], heads, t.shape[-1] // heads)
  norm_q, norm_k = (RMSNorm(eps=eps, name=n, **kw) for n in norms)
  if qk_norm == "per_head":
    return norm_q(split(q)), norm_k(split(k)), split(v)
  if qk_norm == "across_heads":
    return split(norm_q(q)), split(norm_k(k)), split(v)
  raise ValueError(f"qk_norm={qk_norm!r}; use 'per_head' or 'across_heads'")


def project_qkv(x, heads: int, head_dim: int, names: Sequence[str], qk_norm: str = "per_head",
                kv_input=None, eps: float = 1e-6, **kw):
  """q, k, v [B, S, N, H] by the Linears `names[:3]` (k and v from `kv_input` when given: cross
  attention), q and k RMS-normalised (`eps`) by `names[3:]` (`normed_heads`)."""
  width = heads * head_dim
  if kv_input is None:
    q, k, v = linears_of_one_input(x, names[:3], (width,) * 3, **kw)
  else:
    q, (k, v) = Linear(width, name=names[0], **kw)(x), linears_of_one_input(
        kv_input, names[1:3], (width,) * 2, **kw)
  return normed_heads(q, k, v, heads, names[3:5], qk_norm, eps, **kw)


def merge_heads(x):
  """[B, S, N, H] -> [B, S, N * H]."""
  return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3])


MAIN_NAMES = ("to_q", "to_k", "to_v", "norm_q", "norm_k", "to_out.0")


class SelfAttention(Module):
  """diffusers-style self-attention: `to_q/k/v`, q/k RMSNorm (`norm_q/k`), RoPE (if tables are
  given: on the tokens they cover, the first ones) and the output projection `to_out.0`.
  `mask` [B, S] masks padded keys."""
  heads: int
  head_dim: int
  qk_norm: str = "per_head"
  eps: float = 1e-6
  implementation: Optional[str] = None
  names: Tuple[str, ...] = MAIN_NAMES  # q, k, v, their norms, then the output projection

  @nn.compact
  def __call__(self, x, rope=None, mask=None):
    q, k, v = project_qkv(x, self.heads, self.head_dim, self.names, self.qk_norm, eps=self.eps,
                          **self.kw)
    if rope is not None:
      q, k = apply_rope_to_prefix(q, rope), apply_rope_to_prefix(k, rope)
    out = merge_heads(attention(q, k, v, mask, self.implementation))
    return Linear(x.shape[-1], name=self.names[5], **self.kw)(out)


class CrossAttention(Module):
  """Queries from x, keys and values from the context (LTX-Video's `attn2`): `to_q/k/v`,
  q/k RMSNorm, no RoPE, `to_out.0`; `mask` [B, S_context] masks padded context tokens."""
  heads: int
  head_dim: int
  qk_norm: str = "across_heads"
  eps: float = 1e-6
  implementation: Optional[str] = None
  names: Tuple[str, ...] = MAIN_NAMES  # q, k, v, their norms, then the output projection

  @nn.compact
  def __call__(self, x, context, mask=None):
    q, k, v = project_qkv(x, self.heads, self.head_dim, self.names, self.qk_norm, context,
                          eps=self.eps, **self.kw)
    out = merge_heads(attention(q, k, v, mask, self.implementation))
    return Linear(x.shape[-1], name=self.names[5], **self.kw)(out)


def stacked_params(module: nn.Module, name: str, block: nn.Module, length: int, *example_args):
  """`module`'s parameter subtree `name`: `length` initialisations of `block` stacked on a
  leading axis; when the variables already hold it (in any placement's form), it is returned as
  it is."""
  if module.has_variable("params", name):
    return module.get_variable("params", name)
  init = lambda key: jax.vmap(lambda k: block.init(k, *example_args)["params"])(
      jax.random.split(key, length))
  return module.param(name, init)


# ---- the double- and single-stream blocks of Flux and HunyuanVideo -------------------------------


@dataclasses.dataclass(frozen=True)
class StreamNames:
  """Where one stream's weights are in a double-stream block, as module names (the family's
  export names): its AdaLN modulation Linear, its q/k/v projection (three Linears, or one fused
  Linear of the three), its q and k RMSNorms, its attention output, its MLP's two Linears."""
  modulation: str
  qkv: Tuple[str, ...]
  norms: Tuple[str, str]
  out: str
  mlp: Tuple[str, str]


@dataclasses.dataclass(frozen=True)
class SingleStreamNames:
  """Where a single-stream block's weights are: its modulation, the projection of q, k, v and
  the MLP's input (four Linears, or one fused), the q and k RMSNorms, and the Linear that takes
  the attention and MLP outputs together."""
  modulation: str
  qkv_mlp: Tuple[str, ...]
  norms: Tuple[str, str]
  out: str


def adaln_chunks(temb, chunks: int, name: str, **kw):
  """`linear(silu(temb))` split into `chunks` [B, D] (an AdaLN-Zero modulation), which a
  sampler computes ahead of its steps (`programs.ahead`)."""
  modulation = Linear(chunks * temb.shape[-1], name=name, **kw)(nn.silu(temb))
  return jnp.split(programs.ahead(modulation), chunks, axis=-1)


def rope_attention(q, k, v, rope, mask, implementation):
  """The stream blocks' attention: RoPE on the tokens its tables cover, heads merged."""
  q, k = apply_rope_to_prefix(q, rope), apply_rope_to_prefix(k, rope)
  return merge_heads(attention(q, k, v, mask, implementation))


class DoubleStreamBlock(Module):
  """The double-stream block of Flux and HunyuanVideo (the same maths, their own names): image
  and text streams with weights of their own, AdaLN-Zero modulated, one attention over both
  with RoPE on the tokens its tables cover (the first ones) and padded text keys masked
  (`mask` [B, S] over the joined sequence), then each stream's gated MLP. It takes and returns
  the joined sequence, text first (Flux) or last (HunyuanVideo), so that every block of a model
  carries one activation of one shape (as the pipeline needs)."""
  heads: int
  mlp_ratio: float
  txt_len: int
  img: StreamNames
  txt: StreamNames
  text_first: bool
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, rope, temb, mask=None):
    n, dim, kw = self.txt_len, x.shape[-1], self.kw
    img, txt = (x[:, n:], x[:, :n]) if self.text_first else (x[:, :-n], x[:, -n:])
    mods, qkvs = [], []
    for stream, names in ((img, self.img), (txt, self.txt)):
      mods.append(adaln_chunks(temb, 6, names.modulation, **kw))
      h = modulate(layer_norm(stream), mods[-1][0], mods[-1][1])
      qkvs.append(normed_heads(*projections(h, names.qkv, (dim,) * 3, **kw), self.heads,
                               names.norms, **kw))
    streams = (1, 0) if self.text_first else (0, 1)
    q, k, v = (jnp.concatenate([qkvs[i][j] for i in streams], axis=1) for j in range(3))
    out = rope_attention(q, k, v, rope, mask, self.attention_impl)
    img_out, txt_out = (out[:, n:], out[:, :n]) if self.text_first else (out[:, :-n], out[:, -n:])
    img = self._residual_mlp(img, img_out, mods[0], self.img)
    txt = self._residual_mlp(txt, txt_out, mods[1], self.txt)
    return jnp.concatenate([txt, img] if self.text_first else [img, txt], axis=1)

  def _residual_mlp(self, x, attn_out, mod, names):
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
    dim, kw = x.shape[-1], self.kw
    x = x + gate_msa[:, None] * Linear(dim, name=names.out, **kw)(attn_out)
    h = Linear(int(dim * self.mlp_ratio), name=names.mlp[0], **kw)(
        modulate(layer_norm(x), shift_mlp, scale_mlp))
    return x + gate_mlp[:, None] * Linear(dim, name=names.mlp[1], **kw)(nn.gelu(h, approximate=True))


class SingleStreamBlock(Module):
  """The single-stream block of Flux and HunyuanVideo on the joined sequence: parallel
  attention (RoPE on the tokens its tables cover, `mask` [B, S] over the keys) and GELU(tanh)
  MLP branches from one modulated input, joined by one output Linear, gated."""
  heads: int
  mlp_ratio: float
  names: SingleStreamNames
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, rope, temb, mask=None):
    dim, kw, names = x.shape[-1], self.kw, self.names
    shift, scale, gate = adaln_chunks(temb, 3, names.modulation, **kw)
    h = modulate(layer_norm(x), shift, scale)
    q, k, v, mlp = projections(h, names.qkv_mlp, (dim,) * 3 + (int(dim * self.mlp_ratio),), **kw)
    q, k, v = normed_heads(q, k, v, self.heads, names.norms, **kw)
    attn = rope_attention(q, k, v, rope, mask, self.attention_impl)
    out = Linear(dim, name=names.out, **kw)([attn, nn.gelu(mlp, approximate=True)])
    return x + gate[:, None] * out
