"""programs: a function of unrolled layers run as programs per block gives what jax gives for
the whole function, and compiles the same programs whatever the number of layers."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax import programs
from diffpipe_jax.models import layers


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, scale):
    w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1],) * 2)
    return x + jnp.tanh(x @ w + x @ self.get_variable("lora", "a")) * scale


def model(adapter, weights, x, scale):
  """A head that the adapter reaches, unrolled blocks (their index a literal), an integer passed
  between pieces and a constant: a scalar."""
  h = jnp.sin(x) * adapter["head"] + jnp.asarray(np.linspace(0, 1, x.shape[-1]), x.dtype)
  for i, (w, a) in enumerate(zip(weights, adapter["layers"])):
    h = layers.block_program(Block(), h, {"w": w}, {"a": a}, (scale,), None, i)
  top = jnp.argmax(h[0])
  return jnp.mean(h ** 2) + h[0, top]


def arguments(n_layers, width, seed=0):
  keys = iter(jax.random.split(jax.random.key(seed), 2 * n_layers + 2))
  normal = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(width)
  adapter = dict(head=normal(width) + 1, layers=[normal(width, width) for _ in range(n_layers)])
  return adapter, [normal(width, width) for _ in range(n_layers)], normal(3, width), jnp.float32(0.5)


def test_split_function_gives_jax_value_and_gradient():
  args = arguments(4, 8)
  want_value, want_grad = jax.value_and_grad(model)(*args)
  value, grad = programs.value_and_grad(model)(*args)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(programs.split(model)(*args), model(*args), rtol=1e-6)


def test_programs_do_not_grow_with_the_layers():
  """Every layer of a stack reuses one forward and one backward program: a model of 6 layers
  lowers as many programs as one of 2 (each of its own width, so that nothing is shared)."""
  lowered = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _, **kw: lowered.append(kw.get("fun_name"))
      if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)
  counts = []
  for n_layers, width in ((2, 5), (6, 7)):
    start = len(lowered)
    step = programs.value_and_grad(model)
    args = arguments(n_layers, width)
    step(*args)
    counts.append(len(lowered) - start)
    step(*arguments(n_layers, width, seed=1))  # the same shapes: nothing new
    assert len(lowered) - start == counts[-1]
  assert counts[0] == counts[1], counts
