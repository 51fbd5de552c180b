"""FLUX.1 with diffpipe-jax.

  python main.py --config configs/flux.py:tiny                  # embedded tiny model, CPU, no downloads
  python main.py --config configs/flux.py --config.model.diffusers_path=/models/FLUX.1-dev

Variants (the part after ':'): "" (FLUX.1-dev from `model.diffusers_path` or
`model.transformer_path`, bf16) and "tiny" (a random tiny Flux generated on first use).
Until LoRA training lands, the job loads the model and runs a timed forward pass on random
latents of `resolution` pixels and `text_tokens` text tokens.
"""
import ml_collections


def get_config(arg=""):
  c = ml_collections.ConfigDict()
  c.output_dir = "runs/flux"
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.type = "flux"
  c.model.diffusers_path = ""  # a diffusers pipeline folder (holds transformer/)
  c.model.transformer_path = ""  # or a BFL single file (flux1-dev.safetensors); wins if set
  c.model.dtype = "bfloat16"  # compute and weight dtype
  c.model.generate_tiny = False  # write a random tiny model to diffusers_path if none is there

  c.resolution = 1024
  c.text_tokens = 512

  if arg == "tiny":
    c.output_dir = "runs/flux_tiny"
    c.model.diffusers_path = "runs/flux_tiny/tiny_model"
    c.model.generate_tiny = True
    c.model.dtype = "float32"
    c.resolution = 128
    c.text_tokens = 16
  elif arg:
    raise ValueError(f"unknown configs/flux.py variant {arg!r}; known: '', 'tiny'")
  return c
