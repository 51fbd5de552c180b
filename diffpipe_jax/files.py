"""Crash-safe file writes, shared by checkpoints' neighbours: LoRA exports, caches, test models;
and the reading of the TOMLs users write."""
import os
import tomllib
import uuid

from diffpipe_jax.errors import UserError


def atomic_write(path, write):
  """Calls `write(file)` on a temporary name, syncs, then renames: `path` is absent or complete."""
  tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
  try:
    with open(tmp, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def read_toml(path: str, given_as: str = "") -> dict:
  """A TOML file's contents; a missing file or a syntax error (tomllib names its line and
  column) is a UserError naming the file as `given_as` says it (default: the path)."""
  given_as = given_as or path
  if not os.path.isfile(path):
    raise UserError(f"{given_as}: no such file")
  try:
    with open(path, "rb") as f:
      return tomllib.load(f)
  except tomllib.TOMLDecodeError as e:
    raise UserError(f"{given_as}: not valid TOML: {e}") from None
