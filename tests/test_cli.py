"""The commands' flags (diffpipe_jax/cli.py): each mistake in them is one line naming the flag and
what it takes, before anything loads."""
import os
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from diffpipe_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_error(monkeypatch, *args) -> str:
  """What `cli.parse_flags` exits with for main.py's `--config` flag and `args`, parsed in ROOT."""
  argv = ["main.py", *args]
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", lock_config=True, flag_values=flag_values)
  with pytest.raises(SystemExit) as exit:
    cli.parse_flags(argv, flag_values)
  return str(exit.value.code)


MISTAKES = [  # (arguments, the line)
    (["--config", "configs/flux.py:tinyy"],
     "--config configs/flux.py:tinyy: no such variant; use configs/flux.py or configs/flux.py:tiny"),
    (["--config", "configs/flx.py"],
     "--config configs/flx.py: no such file; use configs/flux.py, configs/hunyuan_video.py, "
     "configs/ltx_video.py, configs/wan.py (each optionally :tiny) or a diffusion-pipe training TOML"),
    (["--config=configs/diffusion_pipe.py"],
     "configs/diffusion_pipe.py needs a TOML: --config configs/diffusion_pipe.py:FILE.toml"),
    (["--config", "missing.toml"], "--config missing.toml: no such file"),
]


@pytest.mark.parametrize("args,line", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_config_file_or_variant_that_does_not_exist_is_one_line(monkeypatch, args, line):
  assert parse_error(monkeypatch, *args) == f"error: {line}"


def test_outside_a_checkout_a_missing_config_file_names_the_packages(monkeypatch, tmp_path):
  """From another directory (an installed package) the configs to use are the package's own."""
  monkeypatch.chdir(tmp_path)
  ours = ", ".join(os.path.join(cli.CONFIGS, f) for f in ("flux.py", "hunyuan_video.py", "ltx_video.py", "wan.py"))
  assert cli.missing_config_file("flx.py") == (
      f"--config flx.py: no such file; use {ours} (each optionally :tiny) or a diffusion-pipe training TOML")
  assert all(os.path.isfile(os.path.join(cli.CONFIGS, f)) for f in ("flux.py", "common.py", "diffusion_pipe.py"))


def test_an_override_of_a_key_that_does_not_exist_is_one_line_with_the_nearest_key(monkeypatch):
  assert parse_error(monkeypatch, "--config", "configs/flux.py:tiny", "--config.optimizer.lrr=1e-3") == (
      'error: --config.optimizer.lrr: the config has no key \'lrr\'; did you mean "lr"?')


WRONG_TYPES = [  # (overrides, the line): the key, the value and what the key takes
    (["--config.adapter.rank=abc"], "--config.adapter.rank=abc: must be an integer >= 1"),
    (["--config.seed=3", "--config.epochs=1.5"], "--config.epochs=1.5: must be an integer >= 1"),
    (["--config.model.flux_shift=3"], "--config.model.flux_shift=3: must be True or False"),  # a family's key
]


@pytest.mark.parametrize("overrides,line", WRONG_TYPES, ids=[" ".join(o) for o, _ in WRONG_TYPES])
def test_an_override_of_the_wrong_type_is_one_line_naming_it_and_its_type(monkeypatch, overrides, line):
  assert parse_error(monkeypatch, "--config", "configs/flux.py:tiny", *overrides) == f"error: {line}"
