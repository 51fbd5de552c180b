"""How close two float32 computations of one quantity must be: measured over the whole quantity
(an array, or every leaf of a tree of them, such as a LoRA's gradients), not entry by entry."""
import jax
import numpy as np

# Two float32 computations of one quantity that sum in different orders (another placement or
# programs per block, swapped weights, diffusers' torch, the CPU's vector width and FMA, which XLA
# compiles for) differ by their roundings (eps = 1.2e-7 each), compounded through the layers, a
# backward pass, Adam's steps. Over the whole quantity, on the tiny models, with AVX-512 and FMA as
# with AVX alone: ours against ours at most 2e-6 (a LoRA after 3 steps; gradients 1.2e-6),
# against diffusers 5.6e-6. 1e-5 (~80 eps), the brief's bound for parity with diffusers, leaves
# ours 5x room for another machine; the real mistakes of tests/test_tolerances.py are 4000x over.
FLOAT32_REORDERING = 1e-5
# Against diffusers with a random LoRA (its B as large as a trained one's), which PEFT adds in its
# own order: up to 1.1e-5 for a forward pass, and 3.7e-5 after 4 sampling steps, whose guidance
# (4.5) amplifies each step's difference.
LORA_PARITY = 1e-4


def differences(got, want):
  """got - want, leaf by leaf, in float64."""
  assert jax.tree.structure(got) == jax.tree.structure(want), (jax.tree.structure(got), jax.tree.structure(want))
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), got, want)


def norm(tree):
  """The 2-norm over every entry of every leaf."""
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(leaf, np.float64))) for leaf in jax.tree.leaves(tree))))


def rel_err(got, want):
  """||got - want|| / ||want|| over the whole tree (or array)."""
  return norm(differences(got, want)) / norm(want)


def largest_difference(got, want):
  """The path of the leaf where got and want differ most (in norm)."""
  path, _ = max(jax.tree_util.tree_leaves_with_path(jax.tree.map(norm, differences(got, want))),
                key=lambda leaf: leaf[1])
  return jax.tree_util.keystr(path) or "the array"


def assert_close(got, want, bound=FLOAT32_REORDERING, what=""):
  error = rel_err(got, want)
  assert error <= bound, (f"{what + ': ' if what else ''}relative error {error:.3g} > {bound:.3g}, most in "
                          f"{largest_difference(got, want)}")
