"""Exclusive locks between processes, so that two runs never write the same directory at once.

A lock is `fcntl.flock` on a lock file. The kernel drops it when the holder's file closes, which
a dying process does even under kill -9, so a lock is never stale and the file is never deleted
(deleting it would let a waiter lock the old file while a newcomer locks a new one). The holder
writes its pid and host into the file, so that a process refused or kept waiting can name it.
flock excludes the processes of one host; between hosts it holds on filesystems that pass it on
to the server (NFS v4, Lustre mounted with `flock`).
"""
import fcntl
import os
import socket

from diffpipe_jax.errors import UserError


class Lock:
  """A held lock on `path`: `release()` or the end of a `with` block frees it, as does exit.
  If another process holds it, waits (saying so in one line) when `wait`, else raises
  `UserError`; `what` names the locked thing in those messages."""

  def __init__(self, path, what, wait):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.file = open(path, "a+b", buffering=0)  # never truncated on open: the holder's line stays
    try:
      if not self._try_lock():
        holder = os.pread(self.file.fileno(), 256, 0).decode(errors="replace").strip()
        holder = holder or "another process"  # it has not written its line yet
        if not wait:
          raise UserError(f"{what} is in use by {holder}; wait for it to finish or stop it")
        print(f"waiting for {what}: {holder} is writing it", flush=True)
        fcntl.flock(self.file, fcntl.LOCK_EX)
      self.file.truncate(0)
      self.file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
    except BaseException:
      self.file.close()
      raise

  def _try_lock(self) -> bool:
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except BlockingIOError:
      return False

  def release(self):
    """Frees the lock (closing the file does), leaving the file empty for the next holder."""
    if not self.file.closed:
      self.file.truncate(0)
      self.file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def hold(path, what) -> Lock:
  """The lock on `path` at once, or `UserError` naming its holder."""
  return Lock(path, what, wait=False)


def waiting(path, what) -> Lock:
  """The lock on `path`, after waiting for its holder to release it if need be."""
  return Lock(path, what, wait=True)
