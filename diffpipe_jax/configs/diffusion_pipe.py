"""A diffusion-pipe training TOML as our config (diffpipe_jax/diffusion_pipe.py says how each key
is taken). `python main.py --config their_training.toml` comes here; so does

  python main.py --config configs/diffusion_pipe.py:path/to/their_training.toml
"""
from diffpipe_jax import diffusion_pipe
from diffpipe_jax.errors import UserError


def get_config(toml_path=""):
  if not toml_path:
    raise UserError("configs/diffusion_pipe.py needs a TOML: --config configs/diffusion_pipe.py:FILE.toml")
  config, ignored = diffusion_pipe.config_from_toml(toml_path)
  if ignored:
    print(f"{toml_path}: keys with no effect here: " + "; ".join(f"{k} ({why})" for k, why in ignored.items()))
  return config
