"""Model families and the public entry point `load(name, path, dtype=...)`.

A family is a module (e.g. `models/flux.py`) that provides its config (`config_from_diffusers`,
`config_from_single_file`), `make_module`, `random_inputs`, `check_inputs`, the names of its
stacked block groups (`STACKED`) and its single-file conversion table. Adding a model is adding a
file and a row here.
"""
import dataclasses
import functools
import importlib
from typing import Any, Optional

import jax
import jax.numpy as jnp

from diffpipe_jax import convert, programs
from diffpipe_jax.convert import table
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
    apply = lambda variables, inputs: self.module.apply(variables, **inputs)
    # unrolled layers run as programs per block, which also copy swapped layers' weights
    self._apply = (jax.jit if self.module.scan_layers else programs.split)(apply)

  def __call__(self, **inputs) -> jax.Array:
    inputs = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    return self._apply({"params": self.params}, self.family.check_inputs(self.config, inputs))


def abstract_params(fam, module, config):
  """Parameter shapes and dtypes of `module`, computed without allocating anything."""
  dummy = fam.random_inputs(config)
  return jax.eval_shape(lambda: module.init(jax.random.key(0), **dummy))["params"]


REMAT_POLICIES = {
    "none": None, "block": jax.checkpoint_policies.nothing_saveable,
    # keep the matmul outputs, recompute the cheap elementwise work between them
    "block_save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # as "block", but each block's input waits for the backward pass in host memory
    "block_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(layers.BLOCK_INPUT,),
        offload_src="device", offload_dst="pinned_host")}


def storage_finalizer(fam, transformer_dtype: Optional[str]):
  """Per-leaf hook for the frozen weights' storage: "float8" keeps the block Linears' kernels
  in float8_e4m3fn with per-channel scales; norms, biases, embedders and final layers stay."""
  if transformer_dtype in (None, ""):
    return None
  if transformer_dtype != "float8":
    raise ValueError(f"transformer_dtype={transformer_dtype!r}; use '' (same as dtype) or 'float8'")
  @jax.jit
  def quantize(kernel):  # one scale per output channel: `kernel_scale` [..., out]
    q, scale = layers.quantize_float8(kernel, axis=-2)
    return q, jnp.squeeze(scale, -2)

  def finalize(path, value):
    if path[-1] != "kernel" or not table.matches(".".join(path[:-1]), fam.FLOAT8_TARGETS):
      return {path: value}
    q, scale = quantize(value)
    return {path: q, path[:-1] + ("kernel_scale",): scale}
  return finalize


def remat_policy(remat: str, scan_layers: bool = True, pipelined: bool = False, swapped: bool = False):
  """The jax.checkpoint policy of `activation_checkpointing=remat`, checked against the other
  settings that decide how the blocks run."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f"activation_checkpointing={remat!r}; use one of {sorted(REMAT_POLICIES)}")
  if not scan_layers and (remat == "block_offload" or pipelined):
    raise ValueError(f"scan_layers=False unrolls the blocks of one-stage runs that keep block "
                     f"inputs on the device (activation_checkpointing={remat!r}, pipelined: "
                     f"{pipelined}); set scan_layers=True")
  if pipelined and swapped:
    raise ValueError(layers.SWAP_NEEDS_ONE_STAGE)
  return REMAT_POLICIES[remat]


def _module(fam, config, dtype, param_dtype, attention_impl, remat, scan_layers):
  if attention_impl == "auto":
    attention_impl = layers.default_attention_implementation(dtype)
  return fam.make_module(config, dtype=dtype, param_dtype=param_dtype or dtype,
                         attention_impl=attention_impl, remat=remat_policy(remat, scan_layers),
                         scan_layers=scan_layers)


def checkpoint_config(name: str, path: str, axes_dims_rope=None):
  """The model config of a checkpoint (read from its config.json or its tensor shapes)."""
  return convert.open_checkpoint(family(name), path, axes_dims_rope)[0]


def _placement(fam, transformer_dtype, layout):
  """(put, finalize) for leaves made one at a time (`convert.load_params`' hooks): `put` places a
  weight (default: the default device), `finalize` gives its storage dtype, then the layout's
  swap (float8 is swapped too)."""
  storage = storage_finalizer(fam, transformer_dtype) or (lambda path, value: {path: value})

  def finalize(path, value):
    leaves = storage(path, value)
    return leaves if layout is None else {p: layout.settle(p, v) for p, v in leaves.items()}
  return (layout.put if layout is not None else lambda path, x: jax.device_put(x)), finalize


def load(name: str, path: str, dtype=jnp.float32, param_dtype=None, transformer_dtype=None,
         attention_impl: Optional[str] = "auto", remat="none", scan_layers=True, axes_dims_rope=None,
         layout=None, progress=True) -> Model:
  """Loads model `name` ("flux") from a diffusers folder or an original single file.

  dtype: compute dtype; param_dtype: storage dtype of the weights (default: dtype);
  transformer_dtype: "float8" stores the blocks' frozen Linear kernels in float8 (and
    `layers.Linear` then runs their matmuls in float8).
  attention_impl: "auto" (cuDNN on GPU for 16-bit, else XLA), "cudnn", "xla" or None (XLA).
  remat: a `REMAT_POLICIES` key: "none", or "block" (rematerialise each block in the backward
  pass) and its variants. scan_layers=False unrolls the blocks (a faster step: see `programs`).
  axes_dims_rope: only for single files of non-standard head sizes, where it cannot be derived.
  layout: a sharding.Layout that places each converted leaf, one at a time (stage shares,
  swapped blocks in host memory); default: the default device.
  """
  fam = family(name)
  config, files, rows = convert.open_checkpoint(fam, path, axes_dims_rope)
  module = _module(fam, config, dtype, param_dtype, attention_impl, remat, scan_layers)
  put, finalize = _placement(fam, transformer_dtype, layout)
  params = convert.load_params(abstract_params(fam, module, config), fam, files, rows,
                               param_dtype or dtype, put=put, finalize=finalize, progress=progress)
  return Model(fam, config, module, params if layout is None else layout.pack(params))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def random_weight(name, shape, dtype, key):
  """A stand-in for a trained weight (flax's default init): kernels normal with variance
  1/fan_in, biases zero, norm weights one."""
  if name == "kernel":
    return (jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5).astype(dtype)
  return (jnp.zeros if name == "bias" else jnp.ones)(shape, dtype)


def init_random(name: str, config, key, dtype=jnp.float32, param_dtype=None, transformer_dtype=None,
                attention_impl: Optional[str] = "auto", remat="none", scan_layers=True,
                layout=None) -> Model:
  """A model of random weights (`random_weight`) of a family config (benchmarks, full-size
  shapes), made, stored and placed as `load` does a checkpoint's: one leaf at a time, largest
  first, so that the device never holds a whole high-precision copy beside the float8 one."""
  fam = family(name)
  module = _module(fam, config, dtype, param_dtype, attention_impl, remat, scan_layers)
  put, finalize = _placement(fam, transformer_dtype, layout)
  flat = {}
  for n, (path, leaf) in enumerate(table.largest_first(table.flatten(abstract_params(fam, module, config)))):
    weight = random_weight(path[-1], leaf.shape, leaf.dtype, jax.random.fold_in(key, n))
    flat.update(finalize(path, put(path, weight)))
  params = table.unflatten(flat)
  return Model(fam, config, module, params if layout is None else layout.pack(params))
