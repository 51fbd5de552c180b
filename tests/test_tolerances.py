"""The bound of tests/tolerances.py catches real mistakes: each below is one that a placement,
programs per block or a conversion could make, in one layer, and is over the bound by 100x at least
(where rounding stays 5x under it)."""
import jax
import jax.numpy as jnp
import pytest

import test_programs
from tolerances import FLOAT32_REORDERING, assert_close, norm, rel_err
from diffpipe_jax import lora

STACK, LAYER = "transformer_blocks", 1  # the tiny model's last double block


def fails_by_far(got, want):
  with pytest.raises(AssertionError, match="relative error"):
    assert_close(got, want)
  assert rel_err(got, want) > 100 * FLOAT32_REORDERING, rel_err(got, want)


def exchanged(x, y, layer):
  """x (a stack's tree: leaves [layers, ...]) with y's slices at `layer`."""
  return jax.tree.map(lambda a, b: a.at[layer].set(b[layer]), x, y)


@pytest.fixture(scope="module")
def adapter(flux):
  """A LoRA on every target, its B non-zero (a trained one's)."""
  init = lora.init(flux.params, flux.family.lora_targets, 4, jnp.float32, jax.random.key(0))
  leaves, tree = jax.tree.flatten(init)
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(jax.random.key(i), x.shape)
                                   for i, x in enumerate(leaves)])


@pytest.fixture(scope="module")
def forward(flux):
  """The model's output with a LoRA, on fixed inputs: one program for the mistakes below."""
  inputs = flux.family.random_inputs(flux.config, batch=2, seed=3)
  return jax.jit(lambda params, adapter: flux.module.apply({"params": params, "lora": adapter}, **inputs))


def test_q_and_k_exchanged_in_one_block_fail(flux, adapter, forward):
  """A fused qkv split in the wrong order, in one block."""
  block = flux.params[STACK]
  swapped = dict(block, **{"attn.to_q": exchanged(block["attn.to_q"], block["attn.to_k"], LAYER),
                           "attn.to_k": exchanged(block["attn.to_k"], block["attn.to_q"], LAYER)})
  fails_by_far(forward(dict(flux.params, **{STACK: swapped}), adapter), forward(flux.params, adapter))


def test_a_lora_a_layer_off_fails(flux, adapter, forward):
  """One module's LoRA in each block applied to the next block's (a placement's layer order off by
  one)."""
  block = adapter[STACK]
  rolled = dict(block, **{"attn.to_q": jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), block["attn.to_q"])})
  fails_by_far(forward(flux.params, dict(adapter, **{STACK: rolled})), forward(flux.params, adapter))


def test_a_dropped_layers_gradient_fails():
  """The LoRA gradient of one layer lost (a stage's padding mask on a real layer, say), of the
  layer whose gradient is the smallest; in the blocks of tests/test_programs.py (no compile)."""
  grads = jax.grad(test_programs.model)(*test_programs.arguments(n_layers=6, width=8))
  layer = min(range(6), key=lambda i: norm(grads["layers"][i]))
  dropped = dict(grads, layers=[jnp.zeros_like(g) if i == layer else g for i, g in enumerate(grads["layers"])])
  fails_by_far(dropped, grads)
