"""What the two commands (main.py and `python -m diffpipe_jax.sample`) share: absl flag parsing
of a `--config` file (ours, or a diffusion-pipe training TOML) with `--config.key=value` overrides."""
import os
import re
import sys

from absl import app, flags

from diffpipe_jax.errors import UserError

TOML_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                           "diffusion_pipe.py")


def toml_as_config_file(argv):
  """`--config FILE.toml` (a diffusion-pipe training TOML) -> configs/diffusion_pipe.py:FILE.toml."""
  out, i = [], 0
  while i < len(argv):
    a = argv[i]
    if a == "--config" and i + 1 < len(argv) and argv[i + 1].endswith(".toml"):
      a, i = f"--config={argv[i + 1]}", i + 1
    if a.startswith("--config=") and a.endswith(".toml"):
      a = f"--config={TOML_CONFIG}:{a[len('--config='):]}"
    out.append(a)
    i += 1
  return out


def first_user_error(e: BaseException):
  """The innermost UserError among the exceptions that led to `e` (config_flags and absl re-raise
  what a config file raised, twice), or None."""
  found = None
  while e is not None:
    found = e if isinstance(e, UserError) else found
    e = e.__cause__ or e.__context__
  return found


def parse_flags(argv):
  """absl's parsing, but an override of a config key that does not exist (ml_collections raises
  a KeyError deep inside) is one line naming the flag, with its "did you mean"."""
  argv = toml_as_config_file(argv)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    user_error = first_user_error(e)  # a config file's get_config refused the config
    if user_error is not None:
      sys.exit(f"error: {user_error}")
    return app.parse_flags_with_usage(argv)  # absl's usage message
  except (KeyError, AttributeError) as e:
    missing = re.search(r"'(\w+)", str(e))
    if missing is None:
      raise
    missing, hint = missing.group(1), re.search(r'Did you mean "(\w+)"', str(e))
    flag = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                 and missing in a.split("=")[0].split(".")), "a --config override")
    sys.exit(f"error: {flag}: the config has no key {missing!r}"
             + (f'; did you mean "{hint.group(1)}"?' if hint else ""))
