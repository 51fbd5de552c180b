"""Sequence parallelism over the mesh's 'seq' axis (`sequence_parallel`), by sharding annotations.

Every block's activations [B, tokens, D] are split along their tokens over 'seq' (`over_tokens`,
at each block's input and output), and attention takes its q, k, v split along their heads
instead (`over_heads`), its output going back to the tokens: XLA's partitioner makes each change
an all-to-all, so that each device attends over the whole sequence for its share of the heads
(Ulysses), while the rest of a block, token by token, runs on its share of the tokens. Token and
head counts that do not divide by N are padded by the partitioner (uneven sharding; 24 heads
over 16 devices compute as 32), the padding kept out of every result. Text tokens, masks, RoPE
tables and per-token timesteps follow the activations they meet. Outside `parallel(mesh)`, or
with N = 1, the annotations are nothing. Nothing here knows a model family.
"""
import contextlib

import jax

from diffpipe_jax import axes


def parallel(mesh):
  """The context in which traced blocks split their sequence over `mesh`'s 'seq' axis."""
  return jax.set_mesh(mesh) if dict(mesh.shape).get(axes.SEQ, 1) > 1 else contextlib.nullcontext()


def _constrained(x, *logical):
  """x with its leading dimensions split as `axes.spec(*logical)`, but over the mesh axes that a
  `jax.shard_map` around it has made manual (a pipeline's 'data')."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or dict(mesh.shape).get(axes.SEQ, 1) == 1 or axes.SEQ in mesh.manual_axes:
    return x
  return jax.lax.with_sharding_constraint(x, axes.spec(*logical, manual=mesh.manual_axes))


def over_tokens(x):
  """x [B, tokens, ...] split along its tokens over 'seq' (its batch over 'data')."""
  return _constrained(x, "batch", "tokens")


def whole(x):
  """x [B, ...] split along its batch over 'data' only, each device of a 'seq' group holding all
  of its tokens: what a caller keeps between programs (the sampler's latents), which would
  otherwise leave split over 'seq' and make the next call compile again."""
  return _constrained(x, "batch")


def over_heads(x):
  """x [B, tokens, heads, head_dim] split along its heads over 'seq' (its batch over 'data')."""
  return _constrained(x, "batch", None, "heads")
