"""How JAX and PyTorch share a GPU in one process (measured: ../shared/REFERENCE.md section 8).

JAX takes its pool (by default 75% of the card) at its first array, and keeps it; PyTorch gets
what is left. So the job runs in this order: PyTorch caches the datasets and encodes the sample
prompts before JAX allocates anything (the whole card is its), loading the VAE alone and then
the text encoders alone (`cache.update_cache`), and frees them; JAX then takes its pool for
training, and PyTorch decodes samples in the rest (`Encoders.decode`: the VAE tiled, or on the
CPU, when that is not enough).

`max_device_memory_gib` caps what both frameworks use of each GPU, as on a smaller card (a
24 GB one on an 80 GB GPU, or two jobs sharing one GPU): JAX's pool is its usual share of the
cap, and PyTorch is held to the cap while caching, then to the rest of it beside JAX's pool.
"""
import os

from diffpipe_jax.errors import UserError

JAX_SHARE = 0.75  # JAX's default share of a card (XLA_PYTHON_CLIENT_MEM_FRACTION)
JAX_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GIB = 2**30


# Each framework's CUDA context, outside its pool or limit: 0.52 GiB measured for PyTorch's alone
# on an H100 (BENCHMARKS.md#full-job). A real card holds them too, so the cap
# does: without them the HunyuanVideo job under a 24 GiB cap peaked at 24.03 GiB.
CONTEXT_BYTES = 0.5 * GIB


def fractions(cap_bytes: float, card_bytes: float) -> dict:
  """The fractions of a card of `card_bytes` that keep a process, the frameworks' contexts
  included, within `cap_bytes`: JAX's pool (its usual share of the cap, as of a card that size),
  PyTorch's limit while caching (PyTorch's context alone: no JAX array yet) and beside JAX's pool
  and both contexts."""
  jax_pool = JAX_SHARE * cap_bytes
  return dict(jax=jax_pool / card_bytes, torch_caching=(cap_bytes - CONTEXT_BYTES) / card_bytes,
              torch_training=(cap_bytes - jax_pool - 2 * CONTEXT_BYTES) / card_bytes)


class Sharing:
  """The cap on a GPU's memory for both frameworks (`max_device_memory_gib`; 0: none). Made
  before JAX's backend starts (it reads its pool size then); `training()` once PyTorch's
  caching models are freed."""

  def __init__(self, cap_gib: float):
    self.fractions = None
    if not cap_gib:
      return
    import jax._src.xla_bridge as xla_bridge  # its pool size is read when its backend starts
    import torch
    if not torch.cuda.is_available():
      return  # the CPU: no pool to share
    if xla_bridge.backends_are_initialized():
      raise RuntimeError("max_device_memory_gib must be applied before JAX's backend starts")
    card = torch.cuda.mem_get_info()[1]
    if cap_gib * GIB > card:
      raise UserError(f"max_device_memory_gib={cap_gib:g} is more than the GPU's "
                      f"{card / GIB:.1f} GiB; lower it, or 0 for the whole card")
    self.fractions = fractions(cap_gib * GIB, card)
    if self.fractions["torch_training"] <= 0:
      raise UserError(f"max_device_memory_gib={cap_gib:g} leaves PyTorch nothing beside JAX's pool "
                      f"({JAX_SHARE:.0%}) and the two CUDA contexts; use at least "
                      f"{2 * CONTEXT_BYTES / GIB / (1 - JAX_SHARE) + 1:g}, or 0 for the whole card")
    if JAX_FRACTION_VARIABLE in os.environ:
      raise UserError(f"max_device_memory_gib={cap_gib:g} sets JAX's pool, and "
                      f"{JAX_FRACTION_VARIABLE}={os.environ[JAX_FRACTION_VARIABLE]} is set too: "
                      "unset one of them")
    os.environ[JAX_FRACTION_VARIABLE] = f"{self.fractions['jax']:.4f}"
    torch.cuda.set_per_process_memory_fraction(self.fractions["torch_caching"])

  def training(self):
    """PyTorch's limit beside JAX's pool, from now on."""
    if self.fractions:
      import torch
      torch.cuda.set_per_process_memory_fraction(self.fractions["torch_training"])
