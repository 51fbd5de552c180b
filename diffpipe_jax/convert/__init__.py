"""Checkpoint conversion: PyTorch formats <-> our Flax parameter trees (see `table`)."""
from diffpipe_jax.convert.loader import Checkpoint, load_params, open_checkpoint
from diffpipe_jax.convert.tensorfile import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "load_params", "open_checkpoint"]
