"""What the two commands (main.py and `python -m diffpipe_jax.sample`) share: absl flag parsing
of a `--config` file (ours, or a diffusion-pipe training TOML) with `--config.key=value` overrides,
where every mistake is one line."""
import os
import re
import sys

from absl import flags

from diffpipe_jax import family as family_lib, schema, validate
from diffpipe_jax.errors import UserError, causes

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")  # shipped in the package
TOML_CONFIG = os.path.join(CONFIGS, "diffusion_pipe.py")


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


def config_file(argv):
  """The file of `--config FILE[:variant]` in `argv`, or None."""
  values = [a[len("--config="):] for a in argv if a.startswith("--config=")]
  values += [value for a, value in zip(argv, argv[1:]) if a == "--config"]
  return values[-1].split(":", 1)[0] if values else None


def missing_config_file(path: str) -> str:
  """What to pass instead of a `--config` file that does not exist."""
  # in a checkout, its configs/ (a link to the package's); elsewhere the installed package's
  folder = "configs" if os.path.isdir("configs") and os.path.samefile("configs", CONFIGS) else CONFIGS
  ours = [os.path.join(folder, f"{name.replace('-', '_')}.py") for name in family_lib.names()]
  return (f"--config {path}: no such file; use {', '.join(ours)} (each optionally :tiny) or a "
          "diffusion-pipe training TOML")


def first_user_error(e: BaseException):
  """The innermost UserError among the exceptions that led to `e` (config_flags and absl re-raise
  what a config file raised, twice), or None."""
  return next((c for c in reversed(list(causes(e))) if isinstance(c, UserError)), None)


def override_error(error: flags.Error, config) -> str | None:
  """For an override whose value does not parse as its key's type (`--config.epochs=1.5`):
  the line naming the key, the value and what the key takes (its rule's words), or None."""
  found = re.match(r"flag --config\.([\w.]+)=(.*?): ", str(error))
  if not isinstance(error, flags.IllegalFlagValueError) or found is None:
    return None
  key, value = found.groups()
  family = family_lib.get(config.model.type) if config.model.type in family_lib.names() else None
  rule = validate.rule_for(key, schema.keys(family) if family else schema.SHARED)
  return f"--config.{key}={value}: must be {rule.allowed}" if rule else None


def parse_flags(argv, flag_values=flags.FLAGS):
  """absl's parsing, but every mistake is one line: a missing config file or variant, a config
  file's own refusal, an override of a key that does not exist (ml_collections raises a KeyError
  deep inside; the line has its "did you mean") or that does not parse as the key's type."""
  argv = toml_as_config_file(argv)
  path = config_file(argv)
  if path is not None and not os.path.isfile(path):
    sys.exit(f"error: {missing_config_file(path)}")
  try:
    return flag_values(argv)
  except flags.Error as e:
    config = flag_values["config"].value  # parsed before its overrides
    sys.exit(f"error: {first_user_error(e) or override_error(e, config) or e}")
  except (KeyError, AttributeError) as e:
    missing = re.search(r"'(\w+)", str(e))
    if missing is None:
      raise
    missing, hint = missing.group(1), re.search(r'Did you mean "(\w+)"', str(e))
    flag = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                 and missing in a.split("=")[0].split(".")), "a --config override")
    sys.exit(f"error: {flag}: the config has no key {missing!r}"
             + (f'; did you mean "{hint.group(1)}"?' if hint else ""))
