"""The one exception type for a user's mistake (a config value, a path, a dataset, a checkpoint):
its message names the problem and the fix, and `main.py` prints it as one line, without a
traceback. Anything else that escapes is our bug, and keeps its traceback."""


class UserError(ValueError):
  """Bad input that the user can fix; the message says what is wrong and what to do."""
