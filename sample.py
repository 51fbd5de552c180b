"""The checkout's shortcut to `python -m diffpipe_jax.sample`, the sampling command (as `main.py`
is the training command's):

  python sample.py --config configs/<family>.py:tiny --lora runs/.../epoch4 --prompt "a red pattern"
"""
from diffpipe_jax.sample import run_command

if __name__ == "__main__":
  run_command()
