"""What the two commands (main.py and `python -m diffpipe_jax.sample`) share: absl flag parsing
of a `--config` file with `--config.key=value` overrides."""
import re
import sys

from absl import app


def parse_flags(argv):
  """absl's parsing, but an override of a config key that does not exist (ml_collections raises
  a KeyError deep inside) is one line naming the flag, with its "did you mean"."""
  try:
    return app.parse_flags_with_usage(argv)
  except (KeyError, AttributeError) as e:
    missing = re.search(r"'(\w+)", str(e))
    if missing is None:
      raise
    missing, hint = missing.group(1), re.search(r'Did you mean "(\w+)"', str(e))
    flag = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                 and missing in a.split("=")[0].split(".")), "a --config override")
    sys.exit(f"error: {flag}: the config has no key {missing!r}"
             + (f'; did you mean "{hint.group(1)}"?' if hint else ""))
