"""Locks between real processes (this file, run as a script, is the other process): a run
directory in use refuses a second trainer, naming it, until the holder ends, even killed; a lock
taken `waiting` says whom it waits for and proceeds once released; a released lock leaves no
file and still excludes; two runs caching one new dataset at once both succeed, encoding each
item once."""
import json
import os
import re
import select
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from diffpipe_jax import cache, locks
from diffpipe_jax.errors import UserError

HOST = socket.gethostname()
ITEMS = 4


@pytest.fixture
def start():
  """Starts this file as a process (`ROLES`), its stdout a pipe; kills what is left at the end."""
  started = []

  def run(*args):
    started.append(subprocess.Popen([sys.executable, __file__, *map(str, args)], text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    return started[-1]
  yield run
  for proc in started:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def first_line(proc):
  """The process's first line of output, failing rather than hanging if none comes."""
  assert select.select([proc.stdout], [], [], 30)[0], "no output from the child process"
  return proc.stdout.readline()


@pytest.mark.parametrize("end", ["exit", "kill -9"])
def test_a_run_dir_in_use_is_refused_until_its_holder_ends(tmp_path, start, end):
  from diffpipe_jax import checkpoint  # here: the child processes do not need jax and orbax
  run_dir = str(tmp_path / "run")
  holder = start("hold", f"{run_dir}/{checkpoint.LOCK_FILE}", tmp_path / "log")
  assert first_line(holder) == "held\n"
  with pytest.raises(UserError, match=re.escape(f"the run directory {run_dir} is in use by pid "
                     f"{holder.pid} on host {HOST}; wait for it to finish or stop it")):
    checkpoint.lock_run_dir(run_dir)
  if end == "exit":
    holder.stdin.close()
  else:
    holder.kill()
  holder.wait(timeout=30)
  with checkpoint.lock_run_dir(run_dir):
    assert checkpoint.complete_steps(run_dir) == checkpoint.incomplete_checkpoints(run_dir) == []
  assert os.listdir(run_dir) == []  # no empty .lock left behind


def test_waiting_names_the_holder_then_proceeds_once_it_releases(tmp_path, start):
  path, log = tmp_path / "cache.lock", tmp_path / "log"
  holder = start("hold", path, log)
  assert first_line(holder) == "held\n"
  waiter = start("wait", path, log)
  assert first_line(waiter) == (f"waiting for the dataset cache x: pid {holder.pid} on host "
                                f"{HOST} is writing it\n")
  holder.stdin.close()
  assert waiter.communicate(timeout=30)[0] == "acquired\n" and waiter.returncode == 0
  assert log.read_text().split() == ["released", "acquired"]


def test_a_released_lock_leaves_no_file_and_still_excludes(tmp_path, start):
  """The holder deletes the file as it releases the lock; a process that was waiting on it then
  locks the file at the path anew, so that a newcomer is still refused."""
  path, log = tmp_path / "x.lock", tmp_path / "log"
  holder = start("hold", path, log)
  assert first_line(holder) == "held\n"
  waiter = start("hold", path, log, "waiting")  # it opened the file its holder will delete
  assert first_line(waiter).startswith(f"waiting for x: pid {holder.pid}")
  holder.stdin.close()
  assert first_line(waiter) == "held\n"
  with pytest.raises(UserError, match=f"x is in use by pid {waiter.pid} "):
    locks.hold(path, what="x")
  waiter.stdin.close()
  assert waiter.wait(timeout=30) == 0 and not path.exists()


def test_two_runs_caching_one_new_dataset_at_once_encode_it_once(tmp_path, start):
  cache_dir, log = tmp_path / "data" / "cache" / "model", tmp_path / "encoded"
  runs = [start("cache", cache_dir, log) for _ in range(2)]
  outputs = [run.communicate(timeout=60)[0].splitlines() for run in runs]
  assert [run.returncode for run in runs] == [0, 0], outputs
  assert len(log.read_text().split()) == ITEMS
  assert sorted(len(out) for out in outputs) == [1, 2], outputs  # one waited: they overlapped
  assert outputs[0][-1] == outputs[1][-1]  # the same manifest (shards) and contents
  assert sorted(p.name for p in cache_dir.parent.iterdir()) == ["model"]


class SlowEncoders:
  """A family's encoders, as `cache` uses them, slow enough that two runs overlap; each media
  item encoded adds a line to `log`."""

  def __init__(self, log):
    self.log = log

  media_components = ("vae",)

  def identity(self):
    return "slow"

  def encode_fields(self, pixels):
    time.sleep(0.5)
    with open(self.log, "a") as f:
      f.write("item\n" * len(pixels))
    return dict(latents=pixels.mean(-1))

  def encode_text(self, captions, frames=1):
    return dict(text=np.array([[len(c), sum(map(ord, c))] for c in captions], np.float32))

  def latent_grid(self, frames, height, width):
    return frames, height, width

  def truncation_notes(self):
    return []

  def release(self, attrs=None):  # the VAE, between the media and the text pass
    pass


def hold(path, log, how="hold"):
  """Holds the lock (taken at once, or after waiting: `how` "waiting") until stdin closes, then
  logs `released` and releases it."""
  with getattr(locks, how)(path, what="x"):
    print("held", flush=True)
    sys.stdin.read()
    with open(log, "a") as f:
      f.write("released\n")


def wait(path, log):
  with locks.waiting(path, what="the dataset cache x"):
    with open(log, "a") as f:
      f.write("acquired\n")
    print("acquired")


def build(cache_dir, log):
  """Caches ITEMS items in two batches, then prints the manifest and every array as JSON."""
  items = [dict(key=f"img{i}", caption=f"thing {i}", bucket=(8, 8, 1),
                load_pixels=lambda i=i: np.full((1, 8, 8, 3), i / ITEMS, np.float32))
           for i in range(ITEMS)]
  c = cache.build_cache(cache_dir, items, SlowEncoders(log), batch_size=2)
  arrays = {k: v.tolist() for k, v in c.get((8, 8, 1), np.arange(ITEMS)).items()}
  empty = {k: v.tolist() for k, v in c.empty_text((8, 8, 1)).items()}
  print(json.dumps(dict(manifest=c.manifest, arrays=arrays, empty=empty)))


ROLES = dict(hold=hold, wait=wait, cache=build)

if __name__ == "__main__":
  ROLES[sys.argv[1]](*sys.argv[2:])
