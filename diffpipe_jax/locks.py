"""Exclusive locks between processes, so that two runs never write the same directory at once.

A lock is `fcntl.flock` on a lock file. The kernel drops it when the holder's file closes, which
a dying process does even under kill -9, so a lock is never stale. The holder writes its pid and
host into the file, so that a process refused or kept waiting can name it, and deletes the file
as it releases the lock, so that no empty lock file stays behind. Deleting a lock file races with
a process that opened it just before: that one may then lock the deleted file while a newcomer
creates and locks a new one, and both would hold "the" lock. So the holder deletes the file while
it still holds the lock, and a process that has locked a file checks that it is still the one at
the path, else opens and locks the one there now. A file stays only where its holder was killed;
the next holder takes it over. flock excludes the processes of one host; between hosts it holds
on filesystems that pass it on to the server (NFS v4, Lustre mounted with `flock`).
"""
import contextlib
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
    self.path = path
    while True:
      self.file = open(path, "a+b", buffering=0)  # never truncated on open: the holder's line stays
      try:
        self._lock(what, wait)
        if self._still_at_path():
          break
      except BaseException:
        self.file.close()
        raise
      self.file.close()  # its holder deleted it as it released it: lock the one at the path now
    try:
      self.file.truncate(0)
      self.file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
    except BaseException:
      self.release()
      raise

  def _lock(self, what, wait):
    if self._try_lock():
      return
    holder = os.pread(self.file.fileno(), 256, 0).decode(errors="replace").strip()
    holder = holder or "another process"  # it has not written its line yet
    if not wait:
      raise UserError(f"{what} is in use by {holder}; wait for it to finish or stop it")
    print(f"waiting for {what}: {holder} is writing it", flush=True)
    fcntl.flock(self.file, fcntl.LOCK_EX)

  def _try_lock(self) -> bool:
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except BlockingIOError:
      return False

  def _still_at_path(self) -> bool:
    """Whether the file locked is the one at the path (not one its holder deleted)."""
    try:
      at_path = os.stat(self.path)
    except FileNotFoundError:
      return False
    locked = os.fstat(self.file.fileno())
    return (locked.st_dev, locked.st_ino) == (at_path.st_dev, at_path.st_ino)

  def release(self):
    """Deletes the file, then frees the lock (closing the file does): see the module's doc."""
    if not self.file.closed:
      with contextlib.suppress(FileNotFoundError):  # its directory was removed (a failed start)
        os.remove(self.path)
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
