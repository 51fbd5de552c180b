"""The one exception type for a user's mistake (a config value, a path, a dataset, a checkpoint):
its message names the problem and the fix, and `main.py` prints it as one line, without a
traceback. Anything else that escapes is our bug, and keeps its traceback; `full_disk` and
`out_of_memory` recognise the environment's failures that callers turn into a UserError."""
import errno


class UserError(ValueError):
  """Bad input that the user can fix; the message says what is wrong and what to do."""


def causes(error: BaseException):
  """`error` and the exceptions it was raised from or while handling."""
  while error is not None:
    yield error
    error = error.__cause__ or error.__context__


def full_disk(error: BaseException) -> bool:
  """Whether `error` comes from a full disk (orbax and others wrap the OSError)."""
  return any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
             for e in causes(error))


def out_of_memory(error: BaseException) -> bool:
  """Whether `error` is a device running out of memory (XLA's RESOURCE_EXHAUSTED, or CUDA's in
  PyTorch while caching)."""
  return any("RESOURCE_EXHAUSTED" in str(e) or "CUDA out of memory" in str(e) for e in causes(error))
