"""Resumable training state: run directories and orbax checkpoints arranged as diffusion-pipe's.

A run lives in `output_dir/YYYYMMDD_HH-MM-SS/`, its checkpoints in `global_step{N}/` beside the
exported LoRAs. orbax (on a local disk) writes a step into `global_stepN.orbax-checkpoint-tmp-*`,
adds `_CHECKPOINT_METADATA` (with a commit timestamp) and `commit_success.txt`, then renames it;
orbax itself only rejects the tmp name. We also require `commit_success.txt`, so a step dir that
lost it (a kill during a non-atomic copy or on a filesystem without atomic rename) is skipped too.
A training process holds the run's `.lock`, so a second one (a resume of a run still training)
is refused instead of writing the same checkpoints.
"""
import dataclasses
import datetime
import logging
import os
import re
import shutil
import time

import jax
import orbax.checkpoint as ocp
from etils import epath

from diffpipe_jax import locks
from diffpipe_jax.errors import UserError

STEP_PREFIX = "global_step"
COMMIT_FILE = "commit_success.txt"  # orbax writes it into the tmp dir before the rename
TMP_SUFFIX = ".orbax-checkpoint-tmp"
STEP_RE = re.compile(rf"^{STEP_PREFIX}(0|[1-9]\d*)$")
RUN_NAME_FORMAT = "%Y%m%d_%H-%M-%S"  # sorts chronologically, as diffusion-pipe's run dirs
LOCK_FILE = ".lock"  # not a step name, so orbax and the step listings ignore it


def new_run_dir(output_dir: str) -> str:
  """Creates `output_dir/<local time>/`; a name taken by a run started in the same second makes
  us wait for the next one, so names stay pure timestamps and "latest" can sort them."""
  os.makedirs(output_dir, exist_ok=True)
  while True:
    path = os.path.join(output_dir, datetime.datetime.now().strftime(RUN_NAME_FORMAT))
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      time.sleep(1.0 - time.time() % 1.0 + 0.01)


def lock_run_dir(run_dir: str) -> locks.Lock:
  """The run's lock, held while training into it; `UserError` if another process trains it."""
  return locks.hold(os.path.join(run_dir, LOCK_FILE), what=f"the run directory {run_dir}")


def is_complete(step_dir) -> bool:
  """A `global_stepN` dir that orbax finished: final name and its commit marker inside."""
  step_dir = epath.Path(step_dir)
  return (STEP_RE.match(step_dir.name) is not None and step_dir.is_dir()
          and (step_dir / COMMIT_FILE).exists())


def complete_steps(run_dir) -> list:
  """Steps with a complete checkpoint in `run_dir`, ascending."""
  run_dir = epath.Path(run_dir)
  if not run_dir.is_dir():
    return []
  return sorted(int(STEP_RE.match(p.name).group(1)) for p in run_dir.iterdir() if is_complete(p))


def incomplete_checkpoints(run_dir) -> list:
  """Checkpoint dirs a kill left half-written: orbax tmp dirs and step dirs without the marker."""
  run_dir = epath.Path(run_dir)
  if not run_dir.is_dir():
    return []
  return sorted(str(p) for p in run_dir.iterdir() if p.name.startswith(STEP_PREFIX) and p.is_dir()
                and (TMP_SUFFIX in p.name or STEP_RE.match(p.name)) and not is_complete(p))


def resolve_resume(output_dir: str, resume) -> str | None:
  """The run dir that `--resume_from_checkpoint` names, or None for a fresh run.

  "latest" / "true" picks the newest run with a complete checkpoint; anything else is a run dir
  name under `output_dir` or a path. A run without a complete checkpoint cannot be resumed.
  """
  if resume is None or str(resume) == "":
    return None
  if str(resume).lower() in ("latest", "true"):
    runs = sorted(name for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                  if complete_steps(os.path.join(output_dir, name)))
    if not runs:
      raise UserError(
          f"no run under {output_dir} has a complete checkpoint ({STEP_PREFIX}N/ with "
          f"{COMMIT_FILE}); start without --resume_from_checkpoint")
    return os.path.join(output_dir, runs[-1])
  run_dir = os.path.join(output_dir, resume)  # an absolute `resume` replaces output_dir
  if not os.path.isdir(run_dir):
    found = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    raise UserError(f"--resume_from_checkpoint={resume}: no run dir {run_dir}; runs under "
                            f"{output_dir}: {found or 'none'}")
  if not complete_steps(run_dir):
    raise UserError(f"--resume_from_checkpoint={resume}: {run_dir} has no complete checkpoint "
                     f"({STEP_PREFIX}N/ with {COMMIT_FILE}); incomplete: "
                     f"{incomplete_checkpoints(run_dir) or 'none'}")
  return run_dir


@dataclasses.dataclass(frozen=True)
class StepNameFormat(ocp.step.NameFormat):
  """orbax step naming `global_step{N}` (its standard format forces `prefix_N`), listing only
  complete steps so the manager never restores, counts or deletes a half-written one."""

  def build_name(self, step: int) -> str:
    return f"{STEP_PREFIX}{step}"

  def find_all(self, base_path):
    return iter(ocp.step.Metadata(step=s, path=epath.Path(base_path) / self.build_name(s))
                for s in complete_steps(base_path))

  def find_step(self, base_path, step: int):
    path = epath.Path(base_path) / self.build_name(step)
    if not is_complete(path):
      raise UserError(f"no complete checkpoint {path}")
    return ocp.step.Metadata(step=step, path=path)


def shapes(tree) -> dict:
  """{"lora/.../lora_A": (shape, dtype name)} of a pytree of arrays or their abstract values."""
  return {jax.tree_util.keystr(path, simple=True, separator="/"): (tuple(leaf.shape), str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Checkpointer:
  """Synchronous, atomic saves of (array pytree, JSON meta) into `run_dir/global_stepN/`,
  keeping the newest `keep`."""

  def __init__(self, run_dir: str, keep: int = 3):
    self.run_dir = run_dir
    for path in incomplete_checkpoints(run_dir):
      logging.warning("ignoring half-written checkpoint %s (killed while saving?)", path)
    self.manager = ocp.CheckpointManager(
        os.path.abspath(run_dir),  # handlers named up front, so metadata reads before any save
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, step_name_format=StepNameFormat(),
            enable_async_checkpointing=False, create=True))

  def save(self, step: int, state, meta: dict):
    """Returns once `global_step{step}` is committed, so a later crash cannot lose it."""
    stale = os.path.join(self.run_dir, StepNameFormat().build_name(step))
    if os.path.isdir(stale) and not is_complete(stale):  # the final rename needs the name free
      logging.warning("removing half-written checkpoint %s before saving step %d", stale, step)
      shutil.rmtree(stale)
    try:
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
      self.manager.wait_until_finished()
    except BaseException:  # a full disk, a signal: free what the failed save wrote
      for path in incomplete_checkpoints(self.run_dir):
        shutil.rmtree(path, ignore_errors=True)
      raise

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def saved_shapes(self, step: int | None = None) -> dict:
    """`shapes` of the state saved at `step` (default the newest), read from its metadata."""
    step = self.latest_step() if step is None else step
    return shapes(self.manager.item_metadata(step).state)

  def meta(self, step: int | None = None) -> dict:
    """The JSON meta saved with `step` (default the newest), without reading the state."""
    step = self.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore(self, step: int | None = None, abstract_state=None):
    """(state, meta) of `step` (default the newest); `abstract_state`, a pytree of
    jax.ShapeDtypeStruct, fixes the structure, dtypes and shardings of the restored arrays."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {self.run_dir}")
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out.state, out.meta
