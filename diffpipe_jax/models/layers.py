"""Building blocks shared by the diffusion transformers (Flux, LTX-Video, HunyuanVideo).

Module and parameter names mirror the diffusers modules they reimplement (`to_q`, `norm_q`,
`linear_1`, `net.0.proj`, ...), so that a Flax path joined with "." is the diffusers key and
checkpoint conversion is a naming rule plus a small table (see `diffpipe_jax.convert`).

Every module takes `dtype` (compute), `param_dtype` (storage) and `lora_dropout` (see `Module`).
Norms, RoPE and the timestep sinusoids are computed in float32 whatever the compute dtype, as
diffusers does.
"""
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

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
  """A family's transformer: the settings of how its block stacks run, which `models.load` sets."""
  attention_impl: Optional[str] = None
  remat: Optional[Callable] = None  # a jax.checkpoint policy for each block, None: no remat
  unrolled: bool = False  # the blocks unrolled rather than scanned (see stacks.run_unrolled)


class Linear(Module):
  """`torch.nn.Linear` with a Flax (in, out) kernel, plus a LoRA when the variables hold one.

  The LoRA lives in its own collection, `lora/.../lora_A` [in, r] and `lora_B` [r, out] (alpha =
  r, so scale 1), so base weights and adapter are separate trees: only the adapter is
  differentiated and optimised. See `diffpipe_jax.lora`. A frozen kernel may be stored in
  float8 with a per-output-channel `kernel_scale` (`quantize_float8`); its matmul then runs
  in float8 (`float8_matmul`).
  """
  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                        self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
    x = x.astype(self.dtype)
    if self.has_variable("params", "kernel_scale"):
      y = float8_matmul(x, kernel, self.get_variable("params", "kernel_scale"))
    else:
      y = x @ kernel.astype(self.dtype)
    y = y + bias.astype(self.dtype)
    if self.has_variable("lora", "lora_A"):
      a, b = self.get_variable("lora", "lora_A"), self.get_variable("lora", "lora_B")
      if self.lora_dropout > 0:
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - self.lora_dropout, x.shape)
        x = jnp.where(keep, x / (1 - self.lora_dropout), 0)
      y = y + (x @ a.astype(self.dtype)) @ b.astype(self.dtype)
    return y


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
    x32 = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
    return (x32 * weight.astype(jnp.float32)).astype(self.dtype)


class AdaLNModulation(Module):
  """`linear(silu(emb))` split into `num_chunks` [B, D] tensors (diffusers' `norm*.linear`)."""
  dim: int
  num_chunks: int

  @nn.compact
  def __call__(self, emb):
    out = Linear(self.num_chunks * self.dim, name="linear", **self.kw)(nn.silu(emb))
    return jnp.split(out, self.num_chunks, axis=-1)


def timestep_sinusoids(t, dim=256, max_period=10000.0):
  """diffusers `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)`."""
  half = dim // 2
  # Computed in float32 in the same order as diffusers: the arguments reach 1000 rad, so a
  # frequency one ulp away from torch's already shows as 1e-6 of output error.
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = t.astype(jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class MLPEmbedder(Module):
  """linear_1 -> activation -> linear_2 (diffusers `TimestepEmbedding`: SiLU;
  `PixArtAlphaTextProjection`: SiLU or GELU(tanh))."""
  dim: int
  activation: Callable = nn.silu

  @nn.compact
  def __call__(self, x):
    kw = self.kw
    x = Linear(self.dim, name="linear_1", **kw)(x.astype(self.dtype))
    return Linear(self.dim, name="linear_2", **kw)(self.activation(x))


class FeedForward(Module):
  """diffusers `FeedForward(activation_fn="gelu-tanh")`: net.0.proj -> GELU(tanh) -> net.2."""
  dim: int
  mult: float = 4.0

  @nn.compact
  def __call__(self, x):
    kw = self.kw
    h = Linear(int(self.dim * self.mult), name="net.0.proj", **kw)(x)
    return Linear(self.dim, name="net.2", **kw)(nn.gelu(h, approximate=True))


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


def apply_rope(x, rope):
  """Rotate interleaved channel pairs of x [B, S, N, H] by tables [S, H] (the same for every
  head) or [S, N, H] (LTX-Video's, which span the heads); float32 math."""
  cos, sin = (t[None, :, None] if t.ndim == 2 else t[None] for t in rope)
  x32 = x.astype(jnp.float32)
  pairs = x32.reshape(*x.shape[:-1], -1, 2)
  rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
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
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation=implementation)


def default_attention_implementation(dtype) -> Optional[str]:
  """cuDNN's fused kernel where it applies (GPU, 16-bit); XLA's otherwise."""
  if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  return None


def project_qkv(x, heads: int, head_dim: int, names: Sequence[str], qk_norm: str = "per_head",
                kv_input=None, eps: float = 1e-6, **kw):
  """q, k, v [B, S, N, H] by the Linears `names[:3]` (k and v from `kv_input` when given: cross
  attention), q and k RMS-normalised (`eps`) by `names[3:]`: per head (Flux, HunyuanVideo) or
  across heads before the split (LTX-Video). Called inside a compact module, whose submodules
  the projections become."""
  kv_input = x if kv_input is None else kv_input
  split = lambda t: t.reshape(*t.shape[:-1], heads, head_dim)
  q, k, v = (Linear(heads * head_dim, name=n, **kw)(source)
             for n, source in zip(names[:3], (x, kv_input, kv_input)))
  norm_q, norm_k = (RMSNorm(eps=eps, name=n, **kw) for n in names[3:5])
  if qk_norm == "per_head":
    return norm_q(split(q)), norm_k(split(k)), split(v)
  if qk_norm == "across_heads":
    return split(norm_q(q)), split(norm_k(k)), split(v)
  raise ValueError(f"qk_norm={qk_norm!r}; use 'per_head' or 'across_heads'")


def merge_heads(x):
  """[B, S, N, H] -> [B, S, N * H]."""
  return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3])


MAIN_NAMES = ("to_q", "to_k", "to_v", "norm_q", "norm_k")
CONTEXT_NAMES = ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k")


class SelfAttention(Module):
  """diffusers-style self-attention: `to_q/k/v`, q/k RMSNorm (`norm_q/k`), RoPE (if tables are
  given: on the tokens they cover, the first ones) and the output projection `to_out.0` (absent
  with `output=False`: single-stream blocks fuse it into their own). `mask` [B, S] masks
  padded keys."""
  heads: int
  head_dim: int
  output: bool = True
  qk_norm: str = "per_head"
  eps: float = 1e-6
  implementation: Optional[str] = None

  @nn.compact
  def __call__(self, x, rope=None, mask=None):
    q, k, v = project_qkv(x, self.heads, self.head_dim, MAIN_NAMES, self.qk_norm, eps=self.eps,
                          **self.kw)
    if rope is not None:
      q, k = apply_rope_to_prefix(q, rope), apply_rope_to_prefix(k, rope)
    out = merge_heads(attention(q, k, v, mask, self.implementation))
    return Linear(x.shape[-1], name="to_out.0", **self.kw)(out) if self.output else out


class JointAttention(Module):
  """Attention over two streams with weights of their own (diffusers' joint attention): the
  main stream x (`to_q/k/v`, `norm_q/k`, `to_out.0`) and the context (`add_{q,k,v}_proj`,
  `norm_added_{q,k}`, `to_add_out`), joined along the sequence: context first (Flux) or last
  (HunyuanVideo). RoPE tables cover the joined sequence, or the main stream only
  (`rope_on_context=False`). `mask` [B, S_joined] masks padded keys. Returns (main, context)."""
  heads: int
  head_dim: int
  context_first: bool = True
  rope_on_context: bool = True
  qk_norm: str = "per_head"
  eps: float = 1e-6
  implementation: Optional[str] = None

  @nn.compact
  def __call__(self, x, context, rope, mask=None):
    kw = self.kw
    main = project_qkv(x, self.heads, self.head_dim, MAIN_NAMES, self.qk_norm, eps=self.eps, **kw)
    ctx = project_qkv(context, self.heads, self.head_dim, CONTEXT_NAMES, self.qk_norm, eps=self.eps,
                      **kw)
    if not self.rope_on_context:
      main = (apply_rope(main[0], rope), apply_rope(main[1], rope), main[2])
    order = (ctx, main) if self.context_first else (main, ctx)
    q, k, v = (jnp.concatenate(p, axis=1) for p in zip(*order))
    if self.rope_on_context:
      q, k = apply_rope(q, rope), apply_rope(k, rope)
    out = merge_heads(attention(q, k, v, mask, self.implementation))
    n_ctx = context.shape[1]
    ctx_out, out = (out[:, :n_ctx], out[:, n_ctx:]) if self.context_first else (
        out[:, -n_ctx:], out[:, :-n_ctx])
    return (Linear(x.shape[-1], name="to_out.0", **kw)(out),
            Linear(context.shape[-1], name="to_add_out", **kw)(ctx_out))


class CrossAttention(Module):
  """Queries from x, keys and values from the context (LTX-Video's `attn2`): `to_q/k/v`,
  q/k RMSNorm, no RoPE, `to_out.0`; `mask` [B, S_context] masks padded context tokens."""
  heads: int
  head_dim: int
  qk_norm: str = "across_heads"
  eps: float = 1e-6
  implementation: Optional[str] = None

  @nn.compact
  def __call__(self, x, context, mask=None):
    q, k, v = project_qkv(x, self.heads, self.head_dim, MAIN_NAMES, self.qk_norm, context,
                          eps=self.eps, **self.kw)
    out = merge_heads(attention(q, k, v, mask, self.implementation))
    return Linear(x.shape[-1], name="to_out.0", **self.kw)(out)


def stacked_params(module: nn.Module, name: str, block: nn.Module, length: int, *example_args):
  """`module`'s parameter subtree `name`: `length` initialisations of `block` stacked on a
  leading axis; when the variables already hold it (any layout), it is returned as it is."""
  if module.has_variable("params", name):
    return module.get_variable("params", name)
  init = lambda key: jax.vmap(lambda k: block.init(k, *example_args)["params"])(
      jax.random.split(key, length))
  return module.param(name, init)
