"""Do copies of weights from pinned host memory overlap compute? The question behind
`blocks_to_swap`, on a stand-in: L MLP layers (x + gelu(x @ a) @ b, FLUX's single-block MLP shape,
bf16) whose weights live in pinned host memory.

  python benchmarks/host_copy.py [--tokens 4608]

Rows: compute alone (weights already on the device); the copies alone; each layer copying its
weights by slicing a stacked host array inside a lax.scan, in the loop or one layer ahead (the
copy carried); each layer's weights a host array of its own, layers unrolled. Overlap shows as
a time near max(compute, copies) rather than their sum. `--smoke` runs a tiny shape on the CPU.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def median_ms(fn, *args, reps=10):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--tokens", type=int, default=4608)
  p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: tests the script")
  a = p.parse_args()
  dim, hidden, tokens = (3072, 12288, a.tokens) if not a.smoke else (64, 256, 32)
  n = a.layers
  device = jax.devices()[0]
  host = SingleDeviceSharding(device, memory_kind="pinned_host")
  on_device = SingleDeviceSharding(device, memory_kind="device")
  k = jax.random.split(jax.random.key(0), 3)
  w1 = jax.device_put(jax.random.normal(k[0], (n, dim, hidden), jnp.bfloat16) * 0.01, host)
  w2 = jax.device_put(jax.random.normal(k[1], (n, hidden, dim), jnp.bfloat16) * 0.01, host)
  per_layer = [[jax.device_put(w[i], host) for i in range(n)] for w in (w1, w2)]
  x = jax.random.normal(k[2], (tokens, dim), jnp.bfloat16)

  layer = lambda x, a, b: x + jax.nn.gelu(x @ a) @ b
  to_device = lambda a: jax.device_put(a, jax.memory.Space.Device)
  fetch = lambda w, i: to_device(jax.lax.dynamic_slice_in_dim(w, i, 1))[0]

  @jax.jit
  def compute_only(x, w1, w2):
    return jax.lax.scan(lambda x, ab: (layer(x, *ab), None), x, (w1, w2))[0]

  @jax.jit
  def copies_only(w1, w2):
    first = lambda w: w[0, 0].astype(jnp.float32)
    return jax.lax.scan(lambda c, i: (c + first(fetch(w1, i)) + first(fetch(w2, i)), None),
                        0.0, jnp.arange(n))[0]

  @jax.jit
  def scan_fetch(x, w1, w2):
    return jax.lax.scan(lambda x, i: (layer(x, fetch(w1, i), fetch(w2, i)), None), x, jnp.arange(n))[0]

  @jax.jit
  def scan_prefetch(x, w1, w2):
    def body(carry, i):
      x, a, b = carry
      ahead = jnp.minimum(i + 1, n - 1)
      return (layer(x, a, b), fetch(w1, ahead), fetch(w2, ahead)), None
    return jax.lax.scan(body, (x, fetch(w1, 0), fetch(w2, 0)), jnp.arange(n))[0][0]

  @jax.jit
  def unrolled_arrays(x, w1s, w2s):
    for a, b in zip(w1s, w2s):
      x = layer(x, to_device(a), to_device(b))
    return x

  gb = 2 * n * dim * hidden * 2 / 1e9
  print(f"{n} MLP layers, [{tokens}, {dim}] x [{dim}, {hidden}] bf16, weights {gb:.2f} GB in "
        f"pinned host memory; {device.device_kind}, jax {jax.__version__}")
  print("| variant | ms (median) |")
  print("|---|---|")
  resident = [jax.device_put(w, on_device) for w in (w1, w2)]
  rows = [("compute alone (weights on the device)", compute_only, (x, *resident)),
          ("copies alone (slices of stacked host arrays)", copies_only, (w1, w2)),
          ("scan, each layer copies its slice", scan_fetch, (x, w1, w2)),
          ("scan, the next layer's slice copied ahead", scan_prefetch, (x, w1, w2)),
          ("unrolled, one host array per layer", unrolled_arrays, (x, *per_layer))]
  for name, fn, args in rows:
    print(f"| {name} | {median_ms(fn, *args):.2f} |")


if __name__ == "__main__":
  main()
