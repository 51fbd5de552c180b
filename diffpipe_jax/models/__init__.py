"""The public entry point `load(model_type, path, dtype=...)`: a model of any registered family
(`diffpipe_jax.family`) from any of its checkpoint formats, or of random weights (`init_random`).
"""
import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from diffpipe_jax import convert
from diffpipe_jax import family as family_lib
from diffpipe_jax.convert import table
from diffpipe_jax.errors import UserError
from diffpipe_jax.family import Family
from diffpipe_jax.models import layers
from diffpipe_jax.runtime import Runtime


@dataclasses.dataclass
class Model:
  """A loaded model: call it with the diffusers forward's named inputs (numpy or jax arrays).
  `runtime` runs it (in training, evals, samples and calls alike)."""
  family: Family
  config: Any
  module: Any
  params: Any
  runtime: Runtime = Runtime()

  def __post_init__(self):
    forward = self.runtime.single_microbatch()
    apply = lambda variables, inputs: forward.apply(self.module, variables, **inputs)
    self._apply = forward.compile(apply)

  def __call__(self, **inputs) -> jax.Array:
    inputs = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    return self._apply({"params": self.params}, self.family.check_inputs(self.config, inputs))


def abstract_params(family: Family, module, config):
  """Parameter shapes and dtypes of `module`, computed without allocating anything."""
  dummy = family.random_inputs(config)
  return jax.eval_shape(lambda: module.init(jax.random.key(0), **dummy))["params"]


def storage_finalizer(family: Family, transformer_dtype: Optional[str]):
  """Per-leaf hook for the frozen weights' storage: "float8" keeps the block Linears' kernels
  in float8_e4m3fn with per-channel scales; norms, biases, embedders and final layers stay.
  A kernel that is float8 already (a float8 checkpoint's) keeps its values, at scale 1."""
  if transformer_dtype in (None, ""):
    return None
  if transformer_dtype != "float8":
    raise UserError(f"transformer_dtype={transformer_dtype!r}; use '' (same as dtype) or 'float8'")
  @jax.jit
  def quantize(kernel):  # one scale per output channel: `kernel_scale` [..., out]
    q, scale = layers.quantize_float8(kernel, axis=-2)
    return q, jnp.squeeze(scale, -2)

  def finalize(path, value):
    if not is_float8_kernel(family, path):
      return {path: value}
    if value.dtype == jnp.float8_e4m3fn:
      q, scale = value, jnp.ones(value.shape[:-2] + value.shape[-1:], jnp.float32)
    else:
      q, scale = quantize(value)
    return {path: q, path[:-1] + ("kernel_scale",): scale}
  return finalize


def is_float8_kernel(family: Family, path) -> bool:
  """Whether float8 storage covers this leaf: a kernel of the family's `float8_targets`."""
  return path[-1] == "kernel" and table.matches(".".join(path[:-1]), family.float8_targets)


def make_module(family, config, dtype, param_dtype, attention_impl):
  """The family's module for `load`'s settings (which see)."""
  if attention_impl == "auto":
    attention_impl = layers.default_attention_implementation(dtype)
  return family.make_module(config, dtype=dtype, param_dtype=param_dtype or dtype,
                         attention_impl=attention_impl)


def checkpoint_config(model_type: str, path: str, axes_dims_rope=None):
  """The model config of a checkpoint (read from its config.json or its tensor shapes)."""
  return convert.open_checkpoint(family_lib.get(model_type), path, axes_dims_rope).config


def _placement(family, transformer_dtype, placement):
  """(put, finalize) for leaves made one at a time (`convert.load_params`' hooks): `put` places a
  weight (default: the default device), `finalize` gives its storage dtype, then the placement's
  swap (float8 is swapped too)."""
  storage = storage_finalizer(family, transformer_dtype) or (lambda path, value: {path: value})

  def finalize(path, value):
    leaves = storage(path, value)
    return leaves if placement is None else {p: placement.settle(p, v) for p, v in leaves.items()}
  return (placement.put if placement is not None else lambda path, x: jax.device_put(x)), finalize


def load(model_type: str, path: str, dtype=jnp.float32, param_dtype=None, transformer_dtype=None,
         attention_impl: Optional[str] = "auto", runtime: Runtime = Runtime(), axes_dims_rope=None,
         placement=None, progress=True) -> Model:
  """Loads a model of `model_type` (one of `family.names()`) from a diffusers folder, an
  original single file (a float8 one loads as the float8 base, "float8" below, without a
  high-precision copy), or the released folder that holds it.

  dtype: compute dtype; param_dtype: storage dtype of the weights (default: dtype);
  transformer_dtype: "float8" stores the blocks' frozen Linear kernels in float8 (and
    `layers.Linear` then runs their matmuls in float8).
  attention_impl: "auto" (cuDNN on GPU for 16-bit, else XLA), "cudnn", "xla" or None (XLA).
  runtime: how the model runs (`runtime.Runtime`), whose form of the weights `placement` stores.
  axes_dims_rope: only for single files of non-standard head sizes, where it cannot be derived.
  placement: a sharding.Placement that places each converted leaf, one at a time (stage shares,
  swapped blocks in host memory); default: the default device.
  """
  family = family_lib.get(model_type)
  checkpoint = convert.open_checkpoint(family, path, axes_dims_rope)
  config = checkpoint.config
  module = make_module(family, config, dtype, param_dtype, attention_impl)
  put, finalize = _placement(family, transformer_dtype, placement)
  keeps_float8 = lambda p: transformer_dtype == "float8" and is_float8_kernel(family, p)
  params = convert.load_params(abstract_params(family, module, config), family, checkpoint,
                               param_dtype or dtype, put=put, finalize=finalize, progress=progress,
                               keeps_float8=keeps_float8)
  return Model(family, config, module, params if placement is None else placement.pack(params),
               runtime)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def random_weight(name, shape, dtype, key):
  """A stand-in for a trained weight (flax's default init): kernels normal with variance
  1/fan_in, biases zero, norm weights one."""
  if name == "kernel":
    return (jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5).astype(dtype)
  return (jnp.zeros if name == "bias" else jnp.ones)(shape, dtype)


def init_random(model_type: str, config, key, dtype=jnp.float32, param_dtype=None,
                transformer_dtype=None, attention_impl: Optional[str] = "auto",
                runtime: Runtime = Runtime(), placement=None) -> Model:
  """A model of random weights (`random_weight`) of a family config (benchmarks, full-size
  shapes), made, stored and placed as `load` does a checkpoint's: one leaf at a time, largest
  first, so that the device never holds a whole high-precision copy beside the float8 one."""
  family = family_lib.get(model_type)
  module = make_module(family, config, dtype, param_dtype, attention_impl)
  put, finalize = _placement(family, transformer_dtype, placement)
  flat = {}
  for n, (path, leaf) in enumerate(table.largest_first(table.flatten(abstract_params(family, module, config)))):
    weight = random_weight(path[-1], leaf.shape, leaf.dtype, jax.random.fold_in(key, n))
    flat.update(finalize(path, put(path, weight)))
  params = table.unflatten(flat)
  return Model(family, config, module, params if placement is None else placement.pack(params),
               runtime)
