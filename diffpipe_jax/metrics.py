"""What a run logs: scalars and images to TensorBoard, metrics.jsonl and, with
`monitoring.enable_wandb`, Weights & Biases (process 0 only)."""
import json
import os
import sys
import uuid

from tensorboardX import SummaryWriter

from diffpipe_jax.errors import UserError
from diffpipe_jax.files import atomic_write

WANDB_PROJECT = "diffpipe-jax"  # monitoring.wandb_tracker_name's default
WANDB_ID_FILE = "wandb_run_id.txt"  # in the run directory: a resume continues that W&B run
HIDDEN = "<hidden>"  # the API key, in whatever we write or upload


def check_wandb(config):
  """Raises `UserError` when the config enables W&B and wandb is not installed."""
  if not config.monitoring.enable_wandb:
    return
  try:
    import wandb  # noqa: F401
  except ImportError:
    raise UserError("monitoring.enable_wandb=True: wandb is not installed; pip install wandb "
                    "(or set monitoring.enable_wandb=False)") from None


def public_config(config):
  """A copy of the run's config to write or upload: monitoring.wandb_api_key hidden."""
  public = config.copy_and_resolve_references()
  if public.monitoring.wandb_api_key:
    public.monitoring.wandb_api_key = HIDDEN
  return public


def wandb_run_id(run_dir: str) -> str:
  """The run directory's W&B run id, made on its first start."""
  path = os.path.join(run_dir, WANDB_ID_FILE)
  if not os.path.exists(path):
    atomic_write(path, lambda f: f.write(uuid.uuid4().hex[:16].encode()))
  with open(path) as f:
    return f.read().strip()


def start_wandb(run_dir: str, config):
  """The W&B run of `run_dir` (resumed, if it was started before), its files under run_dir."""
  check_wandb(config)
  import wandb
  key = config.monitoring.wandb_api_key
  try:
    # W&B uploads the command line with the system metadata: not when it holds the key
    settings = wandb.Settings(api_key=key or None,
                              x_disable_meta=bool(key) and any(key in arg for arg in sys.argv))
    return wandb.init(project=config.monitoring.wandb_tracker_name or WANDB_PROJECT,
                      name=config.monitoring.wandb_run_name or os.path.basename(os.path.abspath(run_dir)),
                      dir=run_dir, config=public_config(config).to_dict(), id=wandb_run_id(run_dir),
                      resume="allow", settings=settings)
  except wandb.errors.Error as e:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise UserError(f"monitoring.enable_wandb=True: W&B did not start the run ({reason}); log in with "
                    "`wandb login` or monitoring.wandb_api_key, or set WANDB_MODE=offline") from None


def position(examples: int | None = None, epoch: int | None = None) -> dict:
  """The counters given beside a step, by name (metrics.jsonl's and W&B's)."""
  return {k: v for k, v in (("examples", examples), ("epoch", epoch)) if v is not None}


class MetricWriter:
  """Scalars to TensorBoard, W&B (`config.monitoring.enable_wandb`) and, a line per write, to
  `metrics.jsonl` (machine-readable: {"step": N, "examples": E, "train/loss": ..., ...}, the
  TensorBoard names); written by process 0 only (`enabled`).

  The x axis is the step, or with `config.x_axis_examples` the number of training examples seen
  (`examples`, which every write and image then passes); per-epoch scalars are plotted over
  epochs. A resumed run (`resumed_at`: the checkpoint's step, and `resumed_examples`: the
  examples seen by then) first drops what was logged past it from metrics.jsonl and TensorBoard,
  so nothing repeats; the W&B run continues, and W&B ignores the steps it already has (an exact
  resume logs them again with the same values).
  """

  def __init__(self, run_dir: str, enabled: bool, resumed_at: int | None = None, *,
               resumed_examples: int | None = None, config=None):
    self.enabled = enabled
    if not enabled:
      return
    self.x_axis_examples = config is not None and config.x_axis_examples
    wandb_on = config is not None and config.monitoring.enable_wandb
    self.wandb = start_wandb(run_dir, config) if wandb_on else None
    self.wandb_defined = set()  # the names whose x axis W&B was told
    path = os.path.join(run_dir, "metrics.jsonl")
    if resumed_at is not None and os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if json.loads(line)["step"] <= resumed_at]
      atomic_write(path, lambda f: f.write("".join(kept).encode()))
    purge = None if resumed_at is None else self.x(resumed_at, resumed_examples) + 1
    self.board = SummaryWriter(run_dir, purge_step=purge)
    self.jsonl = open(path, "a")

  def x(self, step: int, examples: int | None) -> int:
    """TensorBoard's x value of a step."""
    if not self.x_axis_examples:
      return step
    if examples is None:
      raise ValueError(f"x_axis_examples: no examples count given at step {step}")
    return examples

  def write(self, step: int, scalars: dict, epoch: int | None = None, examples: int | None = None):
    """`examples`: the training examples seen by `step`; per-epoch scalars (`epoch` given) are
    plotted over epochs, as diffusion-pipe does."""
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    x = self.x(step, examples) if epoch is None else epoch
    for name, value in scalars.items():
      self.board.add_scalar(name, value, x)
    counters = position(examples, epoch)
    self.jsonl.write(json.dumps({"step": step, **counters, **scalars}) + "\n")
    self.jsonl.flush()
    if self.wandb is not None:
      self.log_wandb(step, scalars, counters)

  def image(self, step: int, name: str, pixels, examples: int | None = None):
    """An image [H, W, 3] uint8 to TensorBoard and W&B."""
    if not self.enabled:
      return
    self.board.add_image(name, pixels, self.x(step, examples), dataformats="HWC")
    if self.wandb is not None:
      import wandb
      self.log_wandb(step, {name: wandb.Image(pixels)}, position(examples))

  def log_wandb(self, step: int, values: dict, counters: dict):
    """W&B's own step is the training step; as on TensorBoard, each name is plotted over the
    epoch (per-epoch values), the examples seen (x_axis_examples) or that step."""
    axis = "epoch" if "epoch" in counters else "examples" if self.x_axis_examples else None
    if axis:
      for name in values.keys() - self.wandb_defined:
        self.wandb.define_metric(name, step_metric=axis)
      self.wandb_defined |= values.keys()
    self.wandb.log({**values, **counters}, step=step)

  def close(self, failed: bool = False):
    """`failed`: the run ended in an error or was stopped; W&B then marks its run failed (a
    non-zero exit code)."""
    if self.enabled:
      self.board.close()
      self.jsonl.close()
      if self.wandb is not None:
        self.wandb.finish(exit_code=1 if failed else 0)
