"""diffpipe-jax's training command: LoRA training of diffusion transformers. Flags only; the job
is `train.run`. From any directory, with the package installed:

  python -m diffpipe_jax --config <family>.py[:variant]      # a config file, or a diffusion-pipe TOML
  python -m diffpipe_jax --config .../configs/<family>.py:tiny   # the embedded default: tiny model, data
  python -m diffpipe_jax --config ... --resume_from_checkpoint          # the newest run
  python -m diffpipe_jax --config ... --resume_from_checkpoint=20261130_18-00-00
  python -m diffpipe_jax --config ... --cache_only [--regenerate_cache]

The family configs ship in the package (diffpipe_jax/configs/, `configs/` in a checkout); a
config file of your own can build on them (`from diffpipe_jax.configs import <family>`).
"""
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from diffpipe_jax import train
from diffpipe_jax.cli import parse_flags
from diffpipe_jax.errors import UserError

config_flags.DEFINE_config_file("config", None, "configs/<family>.py file, optionally :variant",
                                lock_config=True)
flags.DEFINE_string("resume_from_checkpoint", None,
                    "continue a run: a run directory name under output_dir, or no value (or "
                    "'latest') for the newest")
flags.DEFINE_bool("cache_only", False, "cache latents and text embeddings, then exit")
flags.DEFINE_bool("regenerate_cache", False, "rebuild the caches from scratch")
flags.DEFINE_bool("multihost", False, "several hosts: jax.distributed.initialize() from the "
                  "cluster's environment (SLURM, Open MPI, ...) or the three flags below")
flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0")
flags.DEFINE_integer("num_processes", None, "multi-host: number of processes (one per host)")
flags.DEFINE_integer("process_id", None, "multi-host: this process's index")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.config is None:
    raise app.UsageError("pass --config configs/<family>.py[:variant]")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if FLAGS.multihost or FLAGS.coordinator_address:
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  try:
    train.run(FLAGS.config, resume=FLAGS.resume_from_checkpoint, cache_only=FLAGS.cache_only,
              regenerate_cache=FLAGS.regenerate_cache)
  except UserError as e:  # a user's mistake: one line; anything else is our bug, with its traceback
    sys.exit(f"error: {e}")


def bare_resume_means_latest(argv):
  """`--resume_from_checkpoint` given without a value (as in diffusion-pipe) means the newest run."""
  flag = "--resume_from_checkpoint"
  return [f"{flag}=latest" if a == flag else a for a in argv]


def run():
  app.run(main, argv=bare_resume_means_latest(sys.argv), flags_parser=parse_flags)


if __name__ == "__main__":
  run()
