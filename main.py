"""The checkout's shortcut to `python -m diffpipe_jax` (diffpipe_jax/__main__.py), the training
command:

  python main.py --config configs/<family>.py:tiny    # the embedded default: tiny model and data
  python main.py --config configs/<family>.py:tiny --resume_from_checkpoint          # newest run
  python main.py --config configs/<family>.py:tiny --cache_only [--regenerate_cache]
"""
from diffpipe_jax.__main__ import run

if __name__ == "__main__":
  run()
