"""optax optimizers and learning-rate schedule from the config (diffusion-pipe's keys and optimizer
names).

Every optimizer runs on float32 copies of the gradients and the LoRA (`in_float32`): its moments
are float32 whatever `adapter.dtype`, and so are its updates, which `training_step.apply_gradients` adds
in float32 and rounds to the LoRA's dtype. With a bfloat16 LoRA, `adamw_optimi` keeps what that
rounding loses and adds it back later (`kahan_summation`, as the optimi library does).

Optimizer states stay trees of arrays shaped like the LoRA's leaves (same leading axes), so that
the placements that store the LoRA per pipeline stage or per layer (`sharding.Placement`) carry
them as they carry the LoRA, and checkpoints hold them as any pytree.
"""
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# optimizer.type, in any case (diffusion-pipe's users write `AdamW8bit`, `Prodigy`)
OPTIMIZERS = ("adamw", "adamw_optimi", "adamw8bit", "prodigy")
# After the warm-up: lr -> schedule over the decay steps.
SCHEDULES = {"constant": lambda lr, steps: optax.constant_schedule(lr),
             "linear": lambda lr, steps: optax.linear_schedule(lr, 0.0, steps),
             "cosine": lambda lr, steps: optax.cosine_decay_schedule(lr, steps)}


def schedule(lr, warmup_steps, total_steps, kind="constant"):
  """Linear warm-up from 0, then constant, linear decay to 0, or cosine decay to 0."""
  after = SCHEDULES[kind](lr, max(1, total_steps - warmup_steps))
  if warmup_steps <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def learning_rate(config, total_steps):
  """step -> lr: `force_constant_lr` at every step when set (a resumed run's too: the schedule is
  this function, not saved state), else the warm-up and `lr_scheduler` from `optimizer.lr`."""
  if config.force_constant_lr > 0:
    return optax.constant_schedule(config.force_constant_lr)
  return schedule(config.optimizer.lr, config.warmup_steps, total_steps, config.lr_scheduler)


def make(config, total_steps):
  """`optimizer.type` after global-norm clipping, in float32 (the AdamWs without weight decay on
  1-D parameters); returns (tx, lr_fn). With prodigy, lr_fn (1.0, typically) multiplies its
  estimated learning rate, which each step's metrics carry (`training_step.apply_gradients`)."""
  o = config.optimizer
  kind, lr = o.type.lower(), learning_rate(config, total_steps)
  if kind == "prodigy":
    step = optax.contrib.prodigy(lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
  else:  # adamw as optax.adamw chains it (the same state: earlier runs resume)
    moments = scale_by_adam_8bit if kind == "adamw8bit" else optax.scale_by_adam
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    step = optax.chain(moments(*o.betas, eps=o.eps),
                       optax.add_decayed_weights(o.weight_decay, decay_mask),
                       optax.scale_by_learning_rate(lr))
  clip = [optax.clip_by_global_norm(config.gradient_clipping)] if config.gradient_clipping > 0 else []
  tx = in_float32(optax.chain(*clip, step))
  # optimi compensates low-precision weights only: in float32, adamw_optimi is adamw
  if kind == "adamw_optimi" and jnp.dtype(config.adapter.dtype) != jnp.float32:
    tx = optax.chain(tx, kahan_summation())
  return tx, lr


def in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` on float32 copies of the updates and parameters: its state and updates are float32."""
  f32 = lambda tree: optax.tree.cast(tree, jnp.float32)
  return optax.GradientTransformation(
      lambda params: tx.init(f32(params)),
      lambda updates, state, params=None: tx.update(f32(updates), state, f32(params)))


# ------------------------------------------------------------------ Kahan summation (optimi)
class KahanState(NamedTuple):
  compensation: optax.Updates  # per leaf, in the parameter's dtype: what rounding it lost so far


def kahan_summation() -> optax.GradientTransformation:
  """Rewrites float32 updates u of low-precision parameters p so that `optax.apply_updates`
  (p + u' in float32, rounded to p's dtype) stores p + u + c rounded, c being what the earlier
  roundings lost; the new c is what this one loses. Weights in bfloat16 then follow float32
  training where plain rounding drops every update below half their precision."""
  f32 = lambda x: x.astype(jnp.float32)

  def update(updates, state, params):
    targets = jax.tree.map(lambda p, u, c: f32(p) + u + f32(c), params, updates, state.compensation)
    # the rounded target minus p: exact in float32 unless they differ 2^16-fold in magnitude,
    # and then the compensation keeps the error, as it is taken from what is stored
    updates = jax.tree.map(lambda t, p: rounded(t, p.dtype) - f32(p), targets, params)
    # what apply_updates will store
    stored = jax.tree.map(lambda p, u: rounded(f32(p) + u, p.dtype), params, updates)
    compensation = jax.tree.map(lambda t, s, c: (t - s).astype(c.dtype), targets, stored,
                                state.compensation)
    return updates, KahanState(compensation)

  return optax.GradientTransformation(lambda params: KahanState(optax.tree.zeros_like(params)),
                                      update)


def rounded(x, dtype):
  """x rounded to `dtype`'s precision, in x's dtype: unlike a cast there and back, which XLA
  drops inside a fusion (its default xla_allow_excess_precision, on GPUs), this rounds."""
  info = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


# ------------------------------------------------------------------ 8-bit Adam moments
# The code book of the 8-bit moments: float8 e4m3's 256 values, a dynamic map (3 mantissa bits
# from a block's largest value down to 2^-6 / 448 of it, subnormals to 2^-9 / 448) in which
# rounding is a cast.
CODES = jnp.float8_e4m3fn
CODES_MAX = float(jnp.finfo(CODES).max)


def quantize(x, block: int = 256):
  """x [..., rows, cols] (float32) -> uint8 [..., rows * cols + 4 * blocks]: for each block of
  `block` values of the flattened matrix, the float8 codes of x / scale, then each block's
  float32 scale (its largest magnitude / CODES_MAX) as 4 bytes. One array with x's leading axes."""
  lead, flat = x.shape[:-2], x.reshape(*x.shape[:-2], -1)
  n, blocks = flat.shape[-1], -(-flat.shape[-1] // block)
  padded = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, blocks * block - n)])
  padded = padded.reshape(*lead, blocks, block)
  scale = jnp.max(jnp.abs(padded), axis=-1, keepdims=True) / CODES_MAX
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero block: codes 0
  codes = jnp.clip(padded / scale, -CODES_MAX, CODES_MAX).astype(CODES)
  codes = jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(*lead, blocks * block)[..., :n]
  scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8).reshape(*lead, 4 * blocks)
  return jnp.concatenate([codes, scale_bytes], axis=-1)


def dequantize(q, shape, block: int = 256):
  """The inverse of `quantize`, to float32 of `shape`."""
  lead, n = shape[:-2], math.prod(shape[-2:])
  codes = jax.lax.bitcast_convert_type(q[..., :n], CODES).astype(jnp.float32)
  scale = jax.lax.bitcast_convert_type(q[..., n:].reshape(*lead, -1, 4), jnp.float32)
  return (codes * jnp.repeat(scale, block, axis=-1)[..., :n]).reshape(shape)


class ScaleByAdam8bitState(NamedTuple):
  count: jax.Array
  mu: optax.Updates  # per leaf: the first moment, `quantize`d or float32
  rms: optax.Updates  # per leaf: the square root of the second moment, likewise (>= 0)


def scale_by_adam_8bit(b1=0.9, b2=0.999, eps=1e-8, *, block=256, min_size=4096):
  """`optax.scale_by_adam` with its moments stored in 8 bits (`quantize`), as bitsandbytes'
  AdamW8bit: block-wise scales, and float32 moments for leaves whose matrices (their last two
  axes) hold fewer than `min_size` values. The second moment is stored as its square root,
  whose range is half as many orders of magnitude; moments are computed in float32."""
  quantized = lambda shape: math.prod(shape[-2:]) >= min_size
  store = lambda x: quantize(x, block) if quantized(x.shape) else x
  load = lambda s, shape: dequantize(s, shape, block) if quantized(shape) else s

  def init(params):
    zeros = lambda p: store(jnp.zeros(p.shape, jnp.float32))
    return ScaleByAdam8bitState(jnp.zeros((), jnp.int32), jax.tree.map(zeros, params),
                                jax.tree.map(zeros, params))

  def update(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu = jax.tree.map(lambda g, m: b1 * load(m, g.shape) + (1 - b1) * g, updates, state.mu)
    rms = jax.tree.map(lambda g, r: jnp.sqrt(b2 * jnp.square(load(r, g.shape)) + (1 - b2) * g * g),
                       updates, state.rms)
    bias_mu, bias_rms = 1 - b1 ** count, jnp.sqrt(1 - b2 ** count)
    updates = jax.tree.map(lambda m, r: m / bias_mu / (r / bias_rms + eps), mu, rms)
    return updates, ScaleByAdam8bitState(count, jax.tree.map(store, mu), jax.tree.map(store, rms))

  return optax.GradientTransformation(init, update)
