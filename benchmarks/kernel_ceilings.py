"""What the library kernels give at the shapes of a Flux step, apart from the model: the Linears
that read one input as one matmul each or one matmul of their joined kernels; the AdaLN
modulations, one row (a step's, as diffusers computes them) or 28 rows (every step's at once, as
our sampler does: `programs.ahead`), with the weights read per second; and softmax attention
(cuDNN's, through JAX) beside torch's scaled_dot_product_attention on cuDNN. One table.

  python benchmarks/kernel_ceilings.py

Each figure is the mean of 30 calls after a warm-up, bf16. The matmuls compile as the sampling
step does (`programs.JIT_OPTIONS`: without XLA's dot merger, so separate Linears stay separate).
`--smoke` runs tiny shapes on the CPU (XLA's attention, torch's math kernel).
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project

# (what, tokens, the widths of the Linears that read one input): FLUX.1 at 1024x1024 (4,096
# image and 512 text tokens) and at 512x512 (1,024 and 512)
PROJECTIONS = (("double block, image q/k/v, 1024px", 4096, (3072,) * 3),
               ("double block, text q/k/v", 512, (3072,) * 3),
               ("single block, q/k/v + MLP in, 1024px", 4608, (3072,) * 3 + (12288,)),
               ("single block, q/k/v + MLP in, 512px", 1536, (3072,) * 3 + (12288,)))
# (what, the widths of its modulation Linears), each reading the timestep's embedding (3,072)
MODULATIONS = (("double block, image and text modulations", (6 * 3072,) * 2),
               ("single block, modulation", (3 * 3072,)))
SAMPLING_STEPS = 28
# (what, tokens, heads, head size): Flux at 1024 and 512, HunyuanVideo 512x512x33, LTX-Video 768x512x121
ATTENTION = (("Flux 1024px", 4608, 24, 128), ("Flux 512px", 1536, 24, 128),
             ("HunyuanVideo 512x512x33", 9472, 24, 128), ("LTX-Video 768x512x121", 6144, 32, 64))


def mean_ms(fn, *args, reps=30):
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / reps * 1e3


def torch_mean_ms(fn, reps=30):
  import torch
  sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
  fn()
  sync()
  t0 = time.perf_counter()
  for _ in range(reps):
    fn()
  sync()
  return (time.perf_counter() - t0) / reps * 1e3


def jitted(fn):
  """fn compiled as the sampling step compiles (`programs.JIT_OPTIONS`)."""
  from diffpipe_jax import programs
  return jax.jit(fn, **programs.JIT_OPTIONS)


def each_matmul(x, kernels):
  return [x @ k for k in kernels]


def projection_rows(smoke):
  key, rows = jax.random.key(0), []
  for what, tokens, widths in PROJECTIONS:
    if smoke:
      tokens, widths = 16, tuple(w // 96 for w in widths)
    x = jax.random.normal(key, (1, tokens, widths[0]), jnp.bfloat16)
    kernels = [jax.random.normal(key, (widths[0], w), jnp.bfloat16) * 0.02 for w in widths]
    separate, joined = jitted(each_matmul), jitted(lambda x, k: x @ k)
    tflop, tb = 2 * tokens * widths[0] * sum(widths) / 1e12, 2 * widths[0] * sum(widths) / 1e12
    for how, ms in (("one matmul per Linear", mean_ms(separate, x, kernels)),
                    ("one matmul of the joined kernels", mean_ms(joined, x, jnp.concatenate(kernels, 1)))):
      rows.append((f"{what}: {how}", ms, tflop / ms * 1e3, tb / ms * 1e3))
  return rows


def modulation_rows(smoke):
  key, rows = jax.random.key(0), []
  for what, widths in MODULATIONS:
    dim = 3072 // 96 if smoke else 3072
    widths = tuple(w * dim // 3072 for w in widths)
    kernels = [jax.random.normal(key, (dim, w), jnp.bfloat16) * 0.02 for w in widths]
    matmuls = jitted(each_matmul)
    tb = 2 * dim * sum(widths) / 1e12
    for how, steps in (("one step's row", 1), (f"{SAMPLING_STEPS} steps' rows at once", SAMPLING_STEPS)):
      ms = mean_ms(matmuls, jax.random.normal(key, (steps, dim), jnp.bfloat16), kernels)
      rows.append((f"{what}: {how}", ms, 2 * steps * dim * sum(widths) / 1e12 / ms * 1e3, tb / ms * 1e3))
  return rows


def attention_rows(smoke):
  import torch
  import torch.nn.functional as F
  from torch.nn.attention import SDPBackend, sdpa_kernel
  device = "cuda" if torch.cuda.is_available() else "cpu"
  backend, impl = (SDPBackend.MATH, "xla") if smoke else (SDPBackend.CUDNN_ATTENTION, "cudnn")
  rows = []
  for what, tokens, heads, head in ATTENTION:
    if smoke:
      tokens, heads, head = 32, 3, 8
    q = jax.random.normal(jax.random.key(0), (1, tokens, heads, head), jnp.bfloat16)
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl)
    forward = jax.jit(attend)
    both = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    qt = torch.randn(1, heads, tokens, head, device=device, dtype=torch.bfloat16, requires_grad=True)

    def torch_step(backward):
      out = F.scaled_dot_product_attention(qt, qt, qt)
      if backward:
        out.float().sum().backward()
    tflop = 4 * tokens ** 2 * heads * head / 1e12  # the forward's; the backward's is 2.5x
    with sdpa_kernel(backend):
      for how, ms, work in (
          ("JAX cuDNN, forward", mean_ms(forward, q, q, q), tflop),
          ("torch cuDNN, forward", torch_mean_ms(lambda: torch_step(False)), tflop),
          ("JAX cuDNN, forward + backward", mean_ms(both, q, q, q), 3.5 * tflop),
          ("torch cuDNN, forward + backward", torch_mean_ms(lambda: torch_step(True)), 3.5 * tflop)):
        rows.append((f"attention, {what} ({tokens} tokens): {how}", ms, work / ms * 1e3, None))
  return rows


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
  a = p.parse_args()
  if a.smoke:
    jax.config.update("jax_platforms", "cpu")
  print(f"Kernels at a Flux step's shapes, bf16, {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| kernel | ms | TFLOP/s | weights read, TB/s |")
  print("|---|---|---|---|")
  for what, ms, rate, read in projection_rows(a.smoke) + modulation_rows(a.smoke) + attention_rows(a.smoke):
    print(f"| {what} | {ms:.3f} | {rate:.1f} | {'-' if read is None else f'{read:.2f}'} |")


if __name__ == "__main__":
  main()
