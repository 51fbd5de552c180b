"""Shared layers: the float8 matmul of a float8 base, and the XLA flags set on import."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax.models import layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def float8_dots(fn, *args):
  """The dtypes of the operands of every dot_general in fn's jaxpr (custom VJPs included)."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        yield tuple(str(v.aval.dtype) for v in eqn.invars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub)
  return list(walk(jaxpr))


def dequantised_rows(x):
  q, scale = layers.quantize_float8(x, axis=-1)
  return q.astype(jnp.float32) * scale


def test_float8_matmul_quantises_rows_and_runs_in_float8():
  """Forward: x quantised per row (one token at 1e5 times the others must not cost them
  their precision) times the float8 kernel, its scales on the output; backward: the output
  cotangent times the channel scales, quantised per row, times the kernel transposed. Both
  matmuls take float8 operands, so that XLA calls a float8 GEMM."""
  kx, kk, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (2, 8, 64)).at[0, 3].multiply(1e5)
  kernel, kernel_scale = layers.quantize_float8(jax.random.normal(kk, (64, 48)) * 0.1, axis=-2)
  kernel_scale = kernel_scale[0]
  ct = jax.random.normal(kc, (2, 8, 48))
  dequantised_kernel = kernel.astype(jnp.float32) * kernel_scale

  y, vjp = jax.vjp(lambda x: layers.float8_matmul(x, kernel, kernel_scale), x)
  np.testing.assert_allclose(y, dequantised_rows(x) @ dequantised_kernel, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(vjp(ct)[0], dequantised_rows(ct * kernel_scale) @ kernel.T.astype(jnp.float32),
                             rtol=1e-4, atol=1e-5)
  # against full precision: e4m3 keeps 3 mantissa bits, so a few percent, row by row
  exact = x @ dequantised_kernel
  err = np.linalg.norm(y - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
  assert 1e-3 < err.max() < 0.05, err

  grad = lambda x: jax.grad(lambda x: jnp.sum(layers.float8_matmul(x, kernel, kernel_scale) * ct))(x)
  assert float8_dots(grad, x) == [("float8_e4m3fn", "float8_e4m3fn")] * 2


def test_triton_gemms_are_off_unless_the_user_sets_them():
  show = [sys.executable, "-c", "import diffpipe_jax, os; print(os.environ['XLA_FLAGS'])"]
  run = lambda flags: subprocess.run(show, env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=flags),
                                     capture_output=True, text=True, check=True).stdout.strip()
  assert run("--xla_force_host_platform_device_count=2") == (
      "--xla_force_host_platform_device_count=2 --xla_gpu_enable_triton_gemm=false")
  assert run("--xla_gpu_enable_triton_gemm=true") == "--xla_gpu_enable_triton_gemm=true"
