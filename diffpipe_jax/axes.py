"""Where arrays are split, in one table: the logical names of array dimensions -> the mesh's axes,
as maxtext's `logical_axis_rules` (configs/base.yml). Every PartitionSpec of the package is built
by `spec`, and the mesh's axes are `MESH` (`sharding.make_mesh`): no other module names a mesh
axis (a test checks). It imports nothing of the package, so that the layers' `sequence` can.
"""
from jax.sharding import PartitionSpec

DATA, STAGE, SEQ = "data", "stage", "seq"
MESH = (DATA, STAGE, SEQ)  # in the order of `sharding.make_mesh`'s device grid

RULES = {
    "batch": DATA,  # a batch's rows: data parallelism
    "layers": STAGE,  # a block stack's layers, stored per stage ([S, ...]): pipeline parallelism
    "tokens": SEQ,  # a block's activations along their sequence: sequence parallelism
    "heads": SEQ,  # attention's q, k, v along their heads (Ulysses' all-to-alls)
}


def spec(*logical, manual=()):
  """The PartitionSpec of an array whose leading dimensions are named `logical` (None, and any
  dimension after them: not split); a dimension whose mesh axis is in `manual` (made manual by a
  `jax.shard_map` around) is not split."""
  return PartitionSpec(*(None if name is None or RULES[name] in manual else RULES[name]
                         for name in logical))
