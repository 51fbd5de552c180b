"""The runtime: how a model is run, chosen once from the config and the placement.

A `Runtime` owns every execution mode, so that the models know none: how the block stacks run
(scanned, unrolled, swapped, pipelined: `run_stacks`, which the models receive and call), the
per-block rematerialisation policy, the matmul policy of the Linears (`kernels_in_place`, read
from a context while a function is traced), and how a function is compiled and differentiated
(one jitted program, or programs per block over unrolled layers: `programs`).

`REMAT_POLICIES` names the rematerialisation policies (`activation_checkpointing`);
`unrolled_for` decides whether a run's layers are unrolled (which the placement also stores).
Nothing here knows a model family.
"""
import contextvars
import dataclasses
import functools
from typing import Any, Optional

import jax

from diffpipe_jax import programs, stacks as stacks_lib
from diffpipe_jax.errors import UserError

REMAT_POLICIES = {
    "none": None, "block": jax.checkpoint_policies.nothing_saveable,
    # keep the matmul outputs, recompute the cheap elementwise work between them
    "block_save_dots": programs.keeps_for_backward,
    # keep attention's outputs only: the backward pass recomputes the Linears, not the
    # attention, which at long sequences is most of a block's forward work
    "block_save_attention": programs.saves_attention,
    # as "block", but each block's input waits for the backward pass in host memory
    "block_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(stacks_lib.BLOCK_INPUT,),
        offload_src="device", offload_dst="pinned_host")}


def unrolled_or_default(unrolled: Optional[bool], remat: str, pipelined: bool, swapped: bool) -> bool:
  """`unrolled` as set, or where it is None the faster mode of the run
  (BENCHMARKS.md#scanned-or-unrolled): unrolled on one stage without remat (the scan would stack
  every block's residuals) or with swapped blocks (their copies hidden per layer, and with
  "block_offload" the block inputs' copies too); otherwise scanned, which a pipeline needs, and
  which with per-block remat is as fast or faster (its one program is GPU-bound, where the
  unrolled step's per-block programs wait on the host)."""
  if unrolled is not None:
    return unrolled
  return not pipelined and (remat == "none" or swapped)


def unrolled_for(config) -> bool:
  """Whether a run's blocks are unrolled (`unrolled_or_default` of its config), checked against
  its other settings (`remat_policy`: a UserError where they conflict)."""
  pipelined, swapped = config.pipeline_stages > 1, config.blocks_to_swap > 0
  remat = config.activation_checkpointing
  unrolled = unrolled_or_default(config.unrolled, remat, pipelined, swapped)
  remat_policy(remat, unrolled, pipelined, swapped)
  return unrolled


def remat_policy(remat: str, unrolled: bool = False, pipelined: bool = False, swapped: bool = False):
  """The jax.checkpoint policy of `activation_checkpointing=remat`, checked against the other
  settings that decide how the blocks run."""
  if remat not in REMAT_POLICIES:
    raise UserError(f"activation_checkpointing={remat!r}; use one of {sorted(REMAT_POLICIES)}")
  if unrolled and pipelined:
    raise UserError("unrolled=True unrolls the blocks of one-stage runs (pipeline_stages=1); "
                    "set unrolled=False")
  if swapped and not unrolled and remat == "block_offload":
    raise UserError("activation_checkpointing='block_offload' with blocks_to_swap runs unrolled "
                    "(scanned, the swapped blocks' inputs stay on the device); set unrolled=True "
                    "or leave it unset")
  if pipelined and swapped:
    raise UserError(stacks_lib.SWAP_NEEDS_ONE_STAGE)
  return REMAT_POLICIES[remat]


_KERNELS_IN_PLACE = contextvars.ContextVar("kernels_in_place", default=False)


def kernels_in_place() -> bool:
  """Whether the Linears traced now read the scanned layers' kernels in place (`layers.Linear`;
  `Runtime.kernels_in_place`)."""
  return _KERNELS_IN_PLACE.get()


@dataclasses.dataclass(frozen=True)
class Runtime:
  """How a model runs: `remat`, a `REMAT_POLICIES` key; `unrolled`, the blocks unrolled (their
  weights stored per layer: the placement's `unrolled`) rather than scanned; `pipeline`, a
  `sharding.pipeline.Pipeline` over the mesh's stages (None: one stage)."""
  remat: str = "none"
  unrolled: bool = False
  pipeline: Any = None

  def __post_init__(self):
    remat_policy(self.remat, self.unrolled, self.pipeline is not None)

  @classmethod
  def of(cls, placement, remat: str = "none") -> "Runtime":
    """The runtime of a `sharding.Placement` (its unrolled layers, its pipeline)."""
    return cls(remat, placement.unrolled, placement.pipeline)

  @property
  def kernels_in_place(self) -> bool:
    """Whether the Linears are written so that their matmuls read the scanned layers' kernels in
    place (`layers.Linear`): in the scanned step that keeps none of a block's matmul outputs,
    "block" (measured: BENCHMARKS.md#flux-step-remat; the trials: benchmarks/HISTORY.md, "The
    bias beside the LoRA, the modulations ahead" and "Every kernel read in place";
    "block_offload" keeps none either, but has not been measured; nor has
    "block_save_attention", which keeps attention's outputs only)."""
    return self.remat in ("block", "block_save_attention") and not self.unrolled

  @property
  def offloads_between_programs(self) -> bool:
    """Whether `programs.value_and_grad` moves the block inputs the backward pass keeps to host
    memory ("block_offload" unrolled), each block running as "block" does."""
    return self.unrolled and self.remat == "block_offload"

  def single_microbatch(self) -> "Runtime":
    """The runtime of a forward pass of one batch (evals, samples): a pipeline's stages run it
    as one microbatch."""
    if self.pipeline is None:
      return self
    return dataclasses.replace(self, pipeline=self.pipeline.single_microbatch())

  def run_stacks(self, stacks, x, per_sample, shared, *, key=None):
    """What a model calls to run its block stacks (`stacks.Stack`s): through the pipeline, or on
    one device (`stacks.run_stacks`), each block under the remat policy (where
    `offloads_between_programs`, "block"'s)."""
    policy = REMAT_POLICIES["block" if self.offloads_between_programs else self.remat]
    if self.pipeline is not None:
      return self.pipeline.run(stacks, x, per_sample, shared, remat=policy, key=key)
    return stacks_lib.run_stacks(stacks, x, per_sample, shared, remat=policy, key=key,
                                 unrolled=self.unrolled)

  def traced(self, fn):
    """fn with this runtime's matmul policy set while it runs, so while it is traced. A
    derivative is wrapped whole (`value_and_grad`): its backward pass may trace the model's code
    again (a custom_vjp's recomputation) after the forward pass has returned."""
    @functools.wraps(fn)
    def in_policy(*args, **kwargs):
      token = _KERNELS_IN_PLACE.set(self.kernels_in_place)
      try:
        return fn(*args, **kwargs)
      finally:
        _KERNELS_IN_PLACE.reset(token)
    return in_policy

  def apply(self, module, variables, **inputs):
    """`module.apply(variables, **inputs)` of a model's module, its stacks run by this runtime."""
    return self.traced(module.apply)(variables, **inputs, run_stacks=self.run_stacks)

  def compile(self, fn, jit_options=None):
    """fn as one jitted program; or, with the layers unrolled, as programs per block, which also
    copy swapped layers' weights to the device (`programs.per_block`: one program of every unrolled
    layer would take minutes to compile at full size). Jitted with `jit_options` (None: jit's
    defaults; the programs' `programs.JIT_OPTIONS`)."""
    if self.unrolled:
      return programs.per_block(fn, programs.JIT_OPTIONS if jit_options is None else jit_options)
    return jax.jit(fn, **(jit_options or {}))

  def value_and_grad(self, fn, jit_options=programs.JIT_OPTIONS):
    """jax.value_and_grad(fn) of its first argument: traced whole (to be jitted), or with the
    layers unrolled, run as programs per block, each jitted with `jit_options` (with
    "block_offload", the block inputs kept for the backward pass wait in host memory)."""
    if self.unrolled:  # (whose matmul policy is the default)
      return programs.value_and_grad(fn, jit_options, offload=self.offloads_between_programs)
    return self.traced(jax.value_and_grad(fn))
