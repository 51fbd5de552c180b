"""Crash-safe file writes, shared by checkpoints' neighbours: LoRA exports, caches, test models."""
import os
import uuid


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
