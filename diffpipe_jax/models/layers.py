"""Building blocks shared by the diffusion transformers (Flux, LTX-Video, HunyuanVideo).

Module and parameter names mirror the diffusers modules they reimplement (`to_q`, `norm_q`,
`linear_1`, `net.0.proj`, ...), so that a Flax path joined with "." is the diffusers key and
checkpoint conversion is a naming rule plus a small table (see `diffpipe_jax.convert`).

Every module takes `dtype` (compute), `param_dtype` (storage) and `lora_dropout` (see `Module`).
Norms, RoPE and the timestep sinusoids are computed in float32 whatever the compute dtype, as
diffusers does.
"""
import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

Dtype = Any


class Module(nn.Module, kw_only=True):
  """Our modules' shared settings, handed down unchanged to every submodule through `self.kw`."""
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  lora_dropout: float = 0.0  # dropout on the input of each LoRA (training only; rng "dropout")

  @property
  def kw(self):
    return dict(dtype=self.dtype, param_dtype=self.param_dtype, lora_dropout=self.lora_dropout)


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
  """linear_1 -> SiLU -> linear_2 (diffusers `TimestepEmbedding`, `PixArtAlphaTextProjection`)."""
  dim: int

  @nn.compact
  def __call__(self, x):
    kw = self.kw
    x = Linear(self.dim, name="linear_1", **kw)(x.astype(self.dtype))
    return Linear(self.dim, name="linear_2", **kw)(nn.silu(x))


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
  """Rotate interleaved channel pairs of x [B, S, N, H] by tables [S, H]; float32 math."""
  cos, sin = (t[None, :, None, :] for t in rope)
  x32 = x.astype(jnp.float32)
  pairs = x32.reshape(*x.shape[:-1], -1, 2)
  rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q, k, v, implementation: Optional[str] = None):
  """Softmax attention on [B, S, N, H] tensors: cuDNN flash attention on GPU, XLA elsewhere."""
  return jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def default_attention_implementation(dtype) -> Optional[str]:
  """cuDNN's fused kernel where it applies (GPU, 16-bit); XLA's otherwise."""
  if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  return None


class Attention(Module):
  """diffusers-style attention: `to_q/k/v`, per-head `norm_q/k` RMSNorm, RoPE, optional joint
  text stream (`add_{q,k,v}_proj`, `norm_added_{q,k}`, `to_add_out`) concatenated in front of the
  main stream, and an optional output projection `to_out.0` (absent in `pre_only` blocks).

  Returns the main stream's output, or (main, context) when `context` is given.
  """
  heads: int
  head_dim: int
  pre_only: bool = False
  implementation: Optional[str] = None

  def _project(self, x, names):
    kw = self.kw
    q, k, v = (Linear(self.heads * self.head_dim, name=n, **kw)(x).reshape(
        *x.shape[:-1], self.heads, self.head_dim) for n in names[:3])
    q = RMSNorm(name=names[3], **kw)(q)
    k = RMSNorm(name=names[4], **kw)(k)
    return q, k, v

  @nn.compact
  def __call__(self, x, rope, context=None):
    kw = self.kw
    q, k, v = self._project(x, ("to_q", "to_k", "to_v", "norm_q", "norm_k"))
    if context is not None:
      cq, ck, cv = self._project(
          context, ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k"))
      q, k, v = (jnp.concatenate(p, axis=1) for p in ((cq, q), (ck, k), (cv, v)))
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    out = attention(q, k, v, self.implementation)
    out = out.reshape(*out.shape[:2], self.heads * self.head_dim)
    if context is None:
      return out if self.pre_only else Linear(x.shape[-1], name="to_out.0", **kw)(out)
    ctx_out, out = out[:, :context.shape[1]], out[:, context.shape[1]:]
    return (Linear(x.shape[-1], name="to_out.0", **kw)(out),
            Linear(context.shape[-1], name="to_add_out", **kw)(ctx_out))


@dataclasses.dataclass(frozen=True)
class Stack:
  """A group of identical blocks whose parameters (and LoRA) are stacked on a leading layer axis.
  `block` is an unbound module called as `block(x, *per_sample, *shared)` -> x."""
  name: str
  block: nn.Module
  length: int
  params: Any
  lora: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Swapped:
  """Stacked weights split on their layer axis: the resident layers stacked in device memory,
  the swapped ones (`swap_positions`) in pinned host memory. Of one weight (`split_layers`):
  one host array per swapped layer, on the way to the stack's form. Of a whole stack
  (`pack_layers`, the form the model runs): `device` is the tree of resident weights, and each
  swapped layer is one byte buffer, copied to the device by one DMA that runs beside the
  compute (XLA's GPU scheduler keeps at most two copies in flight, so a layer's dozen arrays,
  copied one by one, would keep the compute waiting)."""
  device: Any
  pinned_host: tuple


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerArrays:
  """A stacked leaf [length, ...] stored as one array per layer (`scan_layers=False`). Each
  layer's matmuls then read their operands in place, as arguments of the step, and every layer
  runs the same programs: a static slice of a stacked weight fuses into the matmul that reads
  it, making each layer's matmul a program of its own, autotuned on its own (at Flux size,
  90 s more of compile)."""
  arrays: tuple


def is_layer_arrays(leaf) -> bool:
  return isinstance(leaf, LayerArrays)


def unstack(leaf) -> LayerArrays:
  return LayerArrays(tuple(leaf[i] for i in range(leaf.shape[0])))


def restack(tree):
  """The inverse of `unstack`, on every `LayerArrays` of a tree."""
  return jax.tree.map(lambda a: jnp.stack(a.arrays) if is_layer_arrays(a) else a, tree,
                      is_leaf=is_layer_arrays)


def layer_of(tree, i: int):
  """Layer i of a stack's tree of stacked arrays or `LayerArrays`."""
  return jax.tree.map(lambda a: a.arrays[i] if is_layer_arrays(a) else a[i], tree,
                      is_leaf=is_layer_arrays)


def swap_positions(length: int, swapped: int) -> tuple:
  """The layers of a stack of `length` whose weights live in host memory when `swapped` of them
  do: spread evenly, so that each one's copy overlaps the resident layers computed before it."""
  return tuple((2 * j + 1) * length // (2 * swapped) for j in range(swapped))


def is_swapped(leaf) -> bool:
  return isinstance(leaf, Swapped)


def swapped_stacks(params) -> list:
  """The `Swapped` stacks (or weights) of a parameter tree."""
  return [leaf for leaf in jax.tree.leaves(params, is_leaf=is_swapped) if is_swapped(leaf)]


def host_layers(params) -> int:
  """How many layers of a stack live in host memory (its params are `Swapped`), 0 if none."""
  return len(params.pinned_host) if is_swapped(params) else 0


def split_layers(weight, swapped: int):
  """A stacked weight [length, ...] -> `Swapped` (still where `weight` is; jit-able)."""
  host = swap_positions(weight.shape[0], swapped)
  resident = np.array([i for i in range(weight.shape[0]) if i not in host], dtype=np.int32)
  return Swapped(weight[resident], tuple(weight[i] for i in host))


def pack_layers(stack, pack_layer):
  """A stack's tree of `split_layers` weights -> one `Swapped` whose host layers are
  `layer_bytes` buffers, each made by `pack_layer` (`layer_bytes` placed in host memory)."""
  leaves, treedef = jax.tree.flatten(stack, is_leaf=is_swapped)
  return Swapped(treedef.unflatten([leaf.device for leaf in leaves]),
                 tuple(pack_layer([leaf.pinned_host[j] for leaf in leaves])
                       for j in range(len(leaves[0].pinned_host))))


def to_device(tree):
  """The tree's arrays in device memory (a copy from host memory where they are there)."""
  return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


def layer_bytes(weights):
  """One layer's weights (any dtypes, wherever they are) as one uint8 vector on the device."""
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
  return jnp.concatenate([as_bytes(a) for a in to_device(weights)])


def layer_from_bytes(buffer, like):
  """The weights of one layer from its `layer_bytes` buffer; `like`: the stack's stacked
  weights (their shapes and dtypes)."""
  leaves, treedef = jax.tree.flatten(like)
  weights, offset = [], 0
  for a in leaves:
    shape, itemsize = a.shape[1:], a.dtype.itemsize
    size = math.prod(shape) * itemsize
    raw = jax.lax.slice_in_dim(buffer, offset, offset + size).reshape(shape + ((itemsize,) if itemsize > 1 else ()))
    weights.append(jax.lax.bitcast_convert_type(raw, a.dtype))
    offset += size
  return treedef.unflatten(weights)


SWAP_NEEDS_ONE_STAGE = "blocks_to_swap needs pipeline_stages=1 (a pipeline already divides the weights)"
LAYER_WEIGHTS = "layer_weights"  # the checkpoint name of one layer's slice of the stacked weights
BLOCK_INPUT = "block_input"  # the checkpoint name of each block's input (what per-block remat keeps)


def apply_block(block: nn.Module, x, params, lora, args, key, i):
  """Layer i of a stack of `block`s (dropout key: `key` folded with i)."""
  variables = {"params": params, **({"lora": lora} if lora is not None else {})}
  rngs = None if key is None else {"dropout": jax.random.fold_in(key, i)}
  return block.apply(variables, checkpoint_name(x, BLOCK_INPUT), *args, rngs=rngs)


# One unrolled layer: in a jitted function it is inlined (traced and lowered once for all of a
# stack's layers); in a function that `programs` splits, the point where it cuts, so that a
# stack's forward and backward programs compile once and every layer reuses them.
block_program = jax.jit(apply_block, static_argnums=(0,))


def run_layers(stack: Stack, x, args, *, remat: Optional[Callable] = None, key=None, start=None,
               count=None, valid=None, scan=True):
  """x through the layers of `stack` by lax.scan, each rematerialised under the jax.checkpoint
  policy `remat` (None: no rematerialisation).

  The whole stack: the stacked weights are the scan's xs, which the backward pass reads in place.
  With `scan=False` a Python loop of `block_program` calls instead (each under `remat`): each
  layer's residuals are buffers of their own rather than slices of stacked ones that the scan
  fills and copies back out (at full Flux size, 18% of the step); its weights and LoRA are best
  stored per layer (`LayerArrays`; those of swapped layers in host memory). Jitted whole, that
  is a program of every layer, which takes minutes to compile at Flux size: the trainer runs it
  split into programs per block (`programs`), which also copy swapped layers' weights.
  A chunk (`count` layers from layer `start`, the pipeline's): each layer slices its weights
  inside a checkpoint that never saves the slice, so the backward pass slices again instead of
  keeping a stacked copy; where `valid[i]` is False, layer i passes x on unchanged (padding of
  uneven stages: computed, as the busy stages compute meanwhile, and selected away).
  A stack with swapped layers (`Swapped` weights): see `run_swapped`.
  """
  apply = lambda x, params, lora, i: apply_block(stack.block, x, params, lora, args, key, i)
  if count is not None:
    @functools.partial(jax.checkpoint, prevent_cse=False,
                       policy=remat or jax.checkpoint_policies.save_anything_except_these_names(LAYER_WEIGHTS))
    def apply_layer(x, i):
      take = lambda tree: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
      return apply(x, jax.tree.map(lambda a: checkpoint_name(a, LAYER_WEIGHTS), take(stack.params)),
                   take(stack.lora), i)

    def layer(x, j):
      i = start + j
      y = apply_layer(x, i)
      return (y if valid is None else jnp.where(valid[i], y, x)), None
    return jax.lax.scan(layer, x, jnp.arange(count))[0]

  if host_layers(stack.params):
    return run_swapped(stack, x, args, key)
  if not scan:
    # Jitted whole, XLA is free to schedule a remat's recomputation early, saving nothing;
    # split into programs (`programs`), each block's backward program recomputes it.
    call = functools.partial(block_program, stack.block)
    if remat is not None:
      call = jax.checkpoint(call, policy=remat, prevent_cse=False)
    for i in range(stack.length):
      x = call(x, *layer_of((stack.params, stack.lora), i), args, key, i)
    return x
  assert not any(map(is_layer_arrays, jax.tree.leaves(stack.params, is_leaf=is_layer_arrays))), (
      "weights stored per layer (a layout of scan_layers=False) run unrolled: scan_layers=False")
  run = apply if remat is None else jax.checkpoint(apply, prevent_cse=False, policy=remat)
  layer = lambda x, xs: (run(x, *xs), None)
  return jax.lax.scan(layer, x, (stack.params, stack.lora, jnp.arange(stack.length)))[0]


def run_swapped(stack: Stack, x, args, key):
  """x through a stack whose swapped layers' weights are in host memory (`Swapped`).

  Each swapped layer is its own call, between scans of the resident layers, so its weights are
  one host buffer that the device copies by DMA beside the compute. A swapped layer and the
  resident layers after it form one `fetch_ahead` unit, whose backward pass copies the weights
  while the resident layers' backward runs; in the forward pass the copy may start two units
  before (not earlier, which would hold every layer's weights at once). Every layer is
  rematerialised in the backward pass (whatever `activation_checkpointing` says: a swapped
  layer's weights must be copied again anyway), in order (`recompute_in_order`).
  """
  def layer(x, lora, args, weights, index):
    i, weight_index, key = index  # layer, its weights' index (None: `weights` are the layer's own)
    if weight_index is not None:
      weights = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, weight_index, keepdims=False), weights)
    return apply_block(stack.block, x, weights, lora, args, key, i)

  def run_resident(x, lora, args, weights, first, end, swapped_before):
    """Layers first..end-1, all resident (weights index: layer - swapped_before)."""
    if first == end:
      return x
    step = lambda x, xs: (recompute_in_order(layer, x, xs[0], args, weights,
                                             (xs[1], xs[1] - swapped_before, key)), None)
    return jax.lax.scan(step, x, (lora, jnp.arange(first, end)))[0]

  resident = stack.params.device
  positions = swap_positions(stack.length, host_layers(stack.params))
  # The LoRA in pieces (resident runs, swapped layers) by one split, whose gradient is one
  # concatenation rather than a full-size sum per piece.
  bounds = sorted({0, stack.length, *positions, *(i + 1 for i in positions)})
  loras = dict(zip(bounds, split_layer_axis(stack.lora, np.diff(bounds).tolist())))
  stack_input, unit_inputs = x, []
  if positions[0] > 0:
    x = run_resident(x, loras[0], args, resident, 0, positions[0], 0)
  for j, first in enumerate(positions):
    end = positions[j + 1] if j + 1 < len(positions) else stack.length
    # A layer's copy takes about as long as a unit's forward pass, so it may start two units
    # ahead (with one, every other copy kept the compute waiting: measured).
    ready = unit_inputs[j - 2] if j >= 2 else stack_input
    host, _ = jax.lax.optimization_barrier((stack.params.pinned_host[j], jax.lax.stop_gradient(ready)))
    after = functools.partial(run_resident, first=first + 1, end=end, swapped_before=j + 1)
    lora = (jax.tree.map(lambda a: a[0], loras[first]), loras[first + 1] if end > first + 1 else None)
    unit_inputs.append(x)
    x = fetch_ahead(layer, after, x, lora, args, host, resident, (first, None, key))
  return x


def split_layer_axis(tree, sizes):
  """[tree of the first sizes[0] layers, of the next sizes[1], ...] (None for None)."""
  if tree is None:
    return [None] * len(sizes)
  leaves, treedef = jax.tree.flatten(tree)
  parts = [jax.lax.split(a, sizes) for a in leaves]
  return [treedef.unflatten([p[k] for p in parts]) for k in range(len(sizes))]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def recompute_in_order(layer, x, lora, args, weights, index):
  """layer(x, lora, args, weights, index), recomputed in the backward pass only once its
  cotangent has arrived: a plain remat that XLA sees unrolled (or a scan of one step, inlined)
  may be recomputed as early as XLA likes, all layers at once. No gradient for weights, index."""
  return layer(x, lora, args, weights, index)


def _recompute_in_order_fwd(layer, x, lora, args, weights, index):
  return layer(x, lora, args, weights, index), (x, lora, args, weights, index)


def _recompute_in_order_bwd(layer, residuals, ct):
  (x, lora, args, weights, index), ct = jax.lax.optimization_barrier((residuals, ct))
  return (*recomputed_vjp(layer, x, lora, args, weights, index, ct), None, None)


def recomputed_vjp(layer, x, lora, args, weights, index, ct):
  """The gradients of layer(x, lora, args, weights, index) for x, lora, args, recomputing the
  layer (whose inputs must come after ct, through an optimization_barrier)."""
  # XLA turns the barrier into an ordering, after which its CSE would merge the recomputation
  # (and a weight slice) with the forward pass's: adding 0 * ct makes new values (XLA keeps
  # 0 * y for floats, for NaN's sake).
  zero = 0 * ct.reshape(-1)[0]
  x = x + zero.astype(x.dtype)
  salt = lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.integer) else a
  index = jax.tree.map(salt, index)
  _, vjp = jax.vjp(lambda x, lora, args: layer(x, lora, args, weights, index), x, lora, args)
  # All of this layer's gradients before the layer below starts: otherwise XLA's GPU scheduler
  # puts off the LoRA weight gradients, which are off the critical path, and keeps every
  # layer's recomputed activations alive until the end of the backward pass.
  return jax.lax.optimization_barrier(vjp(ct))


recompute_in_order.defvjp(_recompute_in_order_fwd, _recompute_in_order_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fetch_ahead(layer, after, x, lora, args, host_buffer, weights, index):
  """after(layer(x, lora[0], args, the weights in host_buffer, index), lora[1], args, weights):
  a swapped layer and the resident layers (`weights`) after it. The backward pass copies the
  swapped layer's weights again as it starts, so that the copy runs beside the backward pass
  of `after` (which comes first) rather than after it. No gradient for the weights, index."""
  return after(layer(x, lora[0], args, fetch(host_buffer, weights), index), lora[1], args, weights)


def fetch(host_buffer, like):
  """One swapped layer's weights, copied from their host buffer (`like`: the stacked weights)."""
  return layer_from_bytes(to_device(host_buffer), like)


def _fetch_ahead_fwd(layer, after, x, lora, args, host_buffer, weights, index):
  y = layer(x, lora[0], args, fetch(host_buffer, weights), index)
  z, after_vjp = jax.vjp(lambda y, lora, args: after(y, lora, args, weights), y, lora[1], args)
  return z, ((x, lora[0], args, host_buffer, index, after_vjp), weights)


def _fetch_ahead_bwd(layer, after, residuals, ct):
  residuals, weights = residuals  # `weights`: only their shapes
  (x, lora, args, host_buffer, index, after_vjp), ct = jax.lax.optimization_barrier((residuals, ct))
  swapped_weights = fetch(host_buffer, weights)
  ct_y, ct_lora_after, ct_args_after = after_vjp(ct)
  ct_x, ct_lora, ct_args = recomputed_vjp(layer, x, lora, args, swapped_weights, index, ct_y)
  ct_args = jax.tree.map(jnp.add, ct_args, ct_args_after)
  return ct_x, (ct_lora, ct_lora_after), ct_args, None, None, None


fetch_ahead.defvjp(_fetch_ahead_fwd, _fetch_ahead_bwd)


def run_stacks(stacks: Sequence[Stack], x, per_sample, shared, *, remat=None, key=None, scan=True):
  """The stacks one after the other on one device (the pipeline's counterpart is in sharding)."""
  for n, stack in enumerate(stacks):
    x = run_layers(stack, x, (*per_sample, *shared), remat=remat, scan=scan,
                   key=None if key is None else jax.random.fold_in(key, n))
  return x


def stacked_params(module: nn.Module, name: str, block: nn.Module, length: int, *example_args):
  """`module`'s parameter subtree `name`: `length` initialisations of `block` stacked on a
  leading axis; when the variables already hold it (any layout), it is returned as it is."""
  if module.has_variable("params", name):
    return module.get_variable("params", name)
  init = lambda key: jax.vmap(lambda k: block.init(k, *example_args)["params"])(
      jax.random.split(key, length))
  return module.param(name, init)
