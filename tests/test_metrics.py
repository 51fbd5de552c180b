"""What a run logs (`metrics.MetricWriter`): metrics.jsonl, TensorBoard's events (the step or the
examples seen on the x axis, a resume's purge) and Weights & Biases' offline run files, read back
from the files each writes."""
import functools
import glob
import json
import os
import struct
import sys
import time

import numpy as np
import pytest
from PIL import Image
from tensorboardX.proto.event_pb2 import Event

from diffpipe_jax.configs import common
from diffpipe_jax import metrics
from diffpipe_jax.errors import UserError

KEY = "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9"  # a W&B API key's form; offline, never checked


def run_config(**monitoring):
  config = common.base("flux")
  config.monitoring.update(monitoring)
  return config


def jsonl(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def board_events(run_dir):
  """Each TensorBoard event file's events (TFRecords of Event protos), file by file."""
  files = []
  for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    events, at = [], 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      events.append(Event.FromString(data[at + 12:at + 12 + length]))
      at += 12 + length + 4
    files.append(events)
  return files


def points(events, kind="simple_value"):
  """(tag, x, value) of each scalar (or image: `kind="image"`) event."""
  return [(v.tag, e.step, v.simple_value if kind == "simple_value" else None)
          for e in events for v in e.summary.value if v.HasField(kind)]


def purges(events):
  """The steps from which a reader drops what an earlier writer logged (a restart's SessionLog)."""
  return [e.step for e in events
          if e.HasField("session_log") and e.session_log.status == e.session_log.START]


def wandb_runs(run_dir):
  """Each offline W&B run under run_dir: (its folder, its `Record` protos). Its transaction log is
  a LevelDB log (32 KiB blocks of chunks with a 7-byte header: crc, length, type 1 full, 2 first,
  3 middle, 4 last) after W&B's own 7-byte header."""
  from wandb.proto.wandb_internal_pb2 import Record
  runs = []
  for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")):
    with open(path, "rb") as f:
      data = f.read()
    assert data.startswith(b":W&B")
    records, chunks, at = [], b"", 7
    while at + 7 <= len(data):
      if 32768 - at % 32768 < 7:  # a block's padding
        at += 32768 - at % 32768
        continue
      _, length, kind = struct.unpack("<IHB", data[at:at + 7])
      chunks, at = chunks + data[at + 7:at + 7 + length], at + 7 + length
      if kind in (1, 4):
        records.append(Record.FromString(chunks))
        chunks = b""
    runs.append((os.path.dirname(path), records))
  return runs


def wandb_history(records):
  """{step: {name: value}} of a W&B run's logged values (W&B's own `_...` keys left out)."""
  rows = {}
  for r in records:
    if r.HasField("history"):
      row = {}
      for item in r.history.item:  # an image is a dict: its keys nested under its name
        *names, last = [item.key] if item.key else item.nested_key
        node = functools.reduce(lambda node, name: node.setdefault(name, {}), names, row)
        node[last] = json.loads(item.value_json)
      rows.setdefault(row.pop("_step"), {}).update({k: v for k, v in row.items() if not k.startswith("_")})
  return rows


def next_second():
  """A resumed run starts in a later second: TensorBoard's event files are named, and so read in
  order, by the second their writer started."""
  time.sleep(1 - time.time() % 1)


def test_a_resumed_run_logs_each_step_once(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), True)
  for step in range(1, 6):  # steps 4 and 5 were logged after the checkpoint at step 3
    writer.write(step, {"train/loss": step})
  writer.close()
  next_second()
  writer = metrics.MetricWriter(str(tmp_path), True, resumed_at=3)
  writer.write(4, {"train/loss": 40.0})
  writer.close()
  assert [(m["step"], m["train/loss"]) for m in jsonl(str(tmp_path))] == [
      (1, 1), (2, 2), (3, 3), (4, 40)]
  first, resumed = board_events(str(tmp_path))
  assert points(first) == [("train/loss", s, s) for s in range(1, 6)] and purges(first) == []
  assert purges(resumed) == [4] and points(resumed) == [("train/loss", 4, 40)]  # TensorBoard drops 4, 5


def test_x_axis_examples_plots_over_the_examples_seen(tmp_path):
  run_dir, config = str(tmp_path), run_config()
  config.x_axis_examples = True
  batches = [2, 4, 4, 2, 6]  # a step's examples vary with its bucket's batch
  seen = np.cumsum(batches).tolist()
  pixels = np.zeros((4, 6, 3), np.uint8)
  writer = metrics.MetricWriter(run_dir, True, config=config)
  for step in range(1, 6):
    writer.write(step, {"train/loss": step}, examples=seen[step - 1])
  writer.write(5, {"train/epoch_loss": 3.0}, epoch=1, examples=seen[4])
  writer.image(5, "samples/00", pixels, examples=seen[4])
  with pytest.raises(ValueError, match="no examples count given at step 6"):
    writer.write(6, {"train/loss": 6})
  writer.close()
  next_second()
  writer = metrics.MetricWriter(run_dir, True, resumed_at=3, resumed_examples=seen[2], config=config)
  writer.write(4, {"train/loss": 40.0}, examples=seen[3])
  writer.close()
  first, resumed = board_events(run_dir)
  assert points(first) == [("train/loss", x, s) for s, x in enumerate(seen, 1)] + [("train/epoch_loss", 1, 3)]
  assert points(first, "image") == [("samples/00", seen[4], None)]
  assert purges(resumed) == [seen[2] + 1] and points(resumed) == [("train/loss", seen[3], 40)]
  assert jsonl(run_dir) == [{"step": s, "examples": seen[s - 1], "train/loss": s} for s in (1, 2, 3)] + [
      {"step": 4, "examples": seen[3], "train/loss": 40}]


def wandb_here(monkeypatch, tmp_path, mode="offline"):
  """W&B in `mode`, quiet, its files (its own settings and caches too) under tmp_path."""
  for name, value in dict(WANDB_MODE=mode, WANDB_SILENT="true", WANDB_DIR=tmp_path,
                          WANDB_CONFIG_DIR=tmp_path / "config", WANDB_CACHE_DIR=tmp_path / "cache",
                          WANDB_DATA_DIR=tmp_path / "data").items():
    monkeypatch.setenv(name, str(value))


def test_wandb_logs_each_value_and_a_resume_continues_its_run(tmp_path, monkeypatch):
  import wandb
  wandb_here(monkeypatch, tmp_path)
  # a key given on the command line, which W&B would otherwise upload with the system metadata
  monkeypatch.setattr(sys, "argv", ["main.py", f"--config.monitoring.wandb_api_key={KEY}"])
  run_dir = str(tmp_path / "20250101_00-00-00")
  os.makedirs(run_dir)
  config = run_config(enable_wandb=True, wandb_api_key=KEY)
  config.x_axis_examples = True
  pixels = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
  writer = metrics.MetricWriter(run_dir, True, config=config)
  for step in (1, 2, 3):
    writer.write(step, {"train/loss": step / 4}, examples=2 * step)
  writer.write(3, {"train/epoch_loss": 0.5}, epoch=1, examples=6)
  writer.image(3, "samples/00", pixels, examples=6)
  writer.close()
  writer = metrics.MetricWriter(run_dir, True, resumed_at=2, resumed_examples=4, config=config)
  writer.write(4, {"train/loss": 1.5}, examples=8)
  writer.close()
  wandb.teardown()  # W&B's files are written by its own process: this waits for it to finish

  (folder, first), (_, resumed) = sorted(wandb_runs(run_dir), key=lambda run: min(wandb_history(run[1])))
  with open(os.path.join(run_dir, metrics.WANDB_ID_FILE)) as f:
    run_id = f.read()
  for records in (first, resumed):
    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.run_id, run.project, run.display_name) == (run_id, "diffpipe-jax", "20250101_00-00-00")
    logged_config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert logged_config["monitoring"]["wandb_api_key"] == metrics.HIDDEN
    assert logged_config["optimizer"]["lr"] == config.optimizer.lr
    axes = {r.metric.name: r.metric.step_metric for r in records if r.HasField("metric")}
    assert axes == ({"train/loss": "examples", "train/epoch_loss": "epoch", "samples/00": "examples"}
                    if records is first else {"train/loss": "examples"})
  history = wandb_history(first)
  image = history[3].pop("samples/00")
  assert image["_type"] == "image-file"
  with Image.open(os.path.join(folder, "files", image["path"])) as png:
    np.testing.assert_array_equal(np.asarray(png), pixels)
  assert history == {1: {"train/loss": 0.25, "examples": 2}, 2: {"train/loss": 0.5, "examples": 4},
                     3: {"train/loss": 0.75, "examples": 6, "train/epoch_loss": 0.5, "epoch": 1}}
  assert wandb_history(resumed) == {4: {"train/loss": 1.5, "examples": 8}}
  for path in glob.glob(os.path.join(tmp_path, "**"), recursive=True):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        assert KEY.encode() not in f.read(), path


def test_wandb_enabled_but_not_installed_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
  metrics.check_wandb(run_config())  # not enabled: no need
  config = run_config(enable_wandb=True)
  for refused in (lambda: metrics.check_wandb(config),
                  lambda: metrics.MetricWriter(str(tmp_path), True, config=config)):
    with pytest.raises(UserError, match=r"^monitoring.enable_wandb=True: wandb is not installed; "
                       r"pip install wandb "):
      refused()
  assert os.listdir(tmp_path) == []


def test_wandb_failing_to_start_is_one_line(tmp_path, monkeypatch):
  wandb_here(monkeypatch, tmp_path, mode="online")
  key = "not a key!"  # refused by wandb before it goes online
  with pytest.raises(UserError) as refused:
    metrics.MetricWriter(str(tmp_path), True, config=run_config(enable_wandb=True, wandb_api_key=key))
  message = str(refused.value)
  assert message.startswith("monitoring.enable_wandb=True: W&B did not start the run (")
  assert "\n" not in message
  assert message.endswith("or set WANDB_MODE=offline") and key not in message, message
