"""Model families and the public entry point `load(name, path, dtype=...)`.

A family is a module (e.g. `models/flux.py`) that provides its config (`config_from_diffusers`,
`config_from_single_file`), `make_module`, `random_inputs`, `check_inputs`, the names of its
stacked block groups (`STACKED`) and its single-file conversion table. Adding a model is adding a
file and a row here.
"""
import dataclasses
import importlib
from typing import Any, Optional

import jax
import jax.numpy as jnp

from diffpipe_jax import convert
from diffpipe_jax.models import layers

FAMILIES = {"flux": "diffpipe_jax.models.flux"}


def family(name: str):
  if name not in FAMILIES:
    raise ValueError(f"unknown model type {name!r}; known: {sorted(FAMILIES)}")
  return importlib.import_module(FAMILIES[name])


@dataclasses.dataclass
class Model:
  """A loaded model: call it with the diffusers forward's named inputs (numpy or jax arrays)."""
  family: Any
  config: Any
  module: Any
  params: Any

  def __post_init__(self):
    self._apply = jax.jit(self.module.apply)

  def __call__(self, **inputs) -> jax.Array:
    inputs = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    return self._apply({"params": self.params}, **self.family.check_inputs(self.config, inputs))


def abstract_params(fam, module, config):
  """Parameter shapes and dtypes of `module`, computed without allocating anything."""
  dummy = fam.random_inputs(config)
  return jax.eval_shape(lambda: module.init(jax.random.key(0), **dummy))["params"]


def load(name: str, path: str, dtype=jnp.float32, param_dtype=None,
         attention_impl: Optional[str] = "auto", axes_dims_rope=None, progress=True) -> Model:
  """Loads model `name` ("flux") from a diffusers folder or an original single file.

  dtype: compute dtype; param_dtype: storage dtype of the weights (default: dtype).
  attention_impl: "auto" (cuDNN on GPU for 16-bit, else XLA), "cudnn", "xla" or None (XLA).
  axes_dims_rope: only for single files of non-standard head sizes, where it cannot be derived.
  """
  fam = family(name)
  param_dtype = param_dtype or dtype
  if attention_impl == "auto":
    attention_impl = layers.default_attention_implementation(dtype)
  config, files, rows = convert.open_checkpoint(fam, path, axes_dims_rope)
  module = fam.make_module(config, dtype=dtype, param_dtype=param_dtype, attention_impl=attention_impl)
  params = convert.load_params(abstract_params(fam, module, config), fam, files, rows, param_dtype,
                               progress=progress)
  return Model(fam, config, module, params)
