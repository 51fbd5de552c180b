"""What a run logs: scalars and images to TensorBoard and metrics.jsonl (process 0 only)."""
import json
import os

from tensorboardX import SummaryWriter

from diffpipe_jax.files import atomic_write


class MetricWriter:
  """Scalars to TensorBoard and, a line per write, to `metrics.jsonl` (machine-readable:
  {"step": N, "train/loss": ..., ...}, the TensorBoard names); written by process 0 only. A
  resumed run first drops what was logged past its checkpoint's step, so nothing repeats."""

  def __init__(self, run_dir: str, enabled: bool, resumed_at: int | None = None):
    self.enabled = enabled
    if not enabled:
      return
    path = os.path.join(run_dir, "metrics.jsonl")
    if resumed_at is not None and os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if json.loads(line)["step"] <= resumed_at]
      atomic_write(path, lambda f: f.write("".join(kept).encode()))
    self.board = SummaryWriter(run_dir, purge_step=None if resumed_at is None else resumed_at + 1)
    self.jsonl = open(path, "a")

  def write(self, step: int, scalars: dict, epoch: int | None = None):
    """Per-epoch scalars (`epoch` given) are plotted over epochs, as diffusion-pipe does."""
    if not self.enabled:
      return
    for name, value in scalars.items():
      self.board.add_scalar(name, float(value), step if epoch is None else epoch)
    line = dict(step=step, **({} if epoch is None else {"epoch": epoch}),
                **{k: float(v) for k, v in scalars.items()})
    self.jsonl.write(json.dumps(line) + "\n")
    self.jsonl.flush()

  def image(self, step: int, name: str, pixels):
    """An image [H, W, 3] uint8 to TensorBoard."""
    if self.enabled:
      self.board.add_image(name, pixels, step, dataformats="HWC")

  def close(self):
    if self.enabled:
      self.board.close()
      self.jsonl.close()
