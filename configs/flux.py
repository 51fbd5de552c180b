"""FLUX.1 LoRA training.

  python main.py --config configs/flux.py:tiny     # embedded tiny model and data, CPU, no downloads
  python main.py --config configs/flux.py --config.model.diffusers_path=/models/FLUX.1-dev \
      --config.dataset.path=/data/my_images

Variants (the part after ':'): "" (FLUX.1-dev, bf16, rank 32) and "tiny" (a random tiny Flux
generated on first use, trained on a synthetic cached dataset). Key names follow diffusion-pipe.
"""
import ml_collections


def get_config(arg=""):
  c = ml_collections.ConfigDict()
  c.output_dir = "runs/flux"
  c.seed = 0
  c.epochs = 100
  c.max_steps = 0  # stop after this many steps (0: run all epochs)
  c.micro_batch_size_per_gpu = 1
  c.gradient_accumulation_steps = 1
  c.gradient_clipping = 1.0  # global norm; 0 disables
  c.warmup_steps = 0
  c.lr_scheduler = "constant"  # constant | linear | cosine (after warm-up)
  c.save_every_n_epochs = 1  # LoRA exports to epochN/
  c.save_every_n_steps = 0  # ... and stepN/ (0: off)
  c.save_dtype = "bfloat16"
  c.checkpoint_every_n_minutes = 120  # resumable training state to global_stepN/
  c.checkpoint_every_n_steps = 0
  c.checkpoints_to_keep = 3
  c.activation_checkpointing = "block"  # "none": fastest, most memory; "block": remat each block

  c.model = ml_collections.ConfigDict()
  c.model.type = "flux"
  c.model.diffusers_path = ""  # a diffusers pipeline folder (holds transformer/)
  c.model.transformer_path = ""  # or a BFL single file (flux1-dev.safetensors); wins if set
  c.model.generate_tiny = False  # write a random tiny model to diffusers_path if none is there
  c.model.dtype = "bfloat16"  # compute and frozen-weight dtype
  c.model.transformer_dtype = ""  # "float8": the blocks' frozen Linears in float8_e4m3fn
  c.model.timestep_sample_method = "logit_normal"  # or uniform
  c.model.sigmoid_scale = 1.0
  c.model.shift = 1.0  # t' = s t / (1 + (s - 1) t); 1 is no shift
  c.model.flux_shift = False  # resolution-dependent shift instead
  c.model.guidance = 1.0

  c.adapter = ml_collections.ConfigDict()
  c.adapter.type = "lora"
  c.adapter.rank = 32
  c.adapter.dtype = "float32"
  c.adapter.dropout = 0.0
  c.adapter.init_from_existing = ""  # a LoRA of ours (directory or .safetensors) to continue

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.type = "adamw"
  c.optimizer.lr = 2e-5
  c.optimizer.betas = (0.9, 0.99)
  c.optimizer.weight_decay = 0.01
  c.optimizer.eps = 1e-8

  c.dataset = ml_collections.ConfigDict()
  c.dataset.path = ""  # a directory of images/videos with same-stem .txt captions
  c.dataset.synthetic_samples = 0  # >0: a synthetic cached dataset instead (tests, tiny runs)
  c.dataset.synthetic_resolution = 128
  c.dataset.synthetic_text_tokens = 16

  if arg == "tiny":
    c.output_dir = "runs/flux_tiny"
    c.epochs = 4
    c.micro_batch_size_per_gpu = 2
    c.gradient_accumulation_steps = 2
    c.checkpoint_every_n_steps = 4
    c.save_dtype = "float32"
    c.model.diffusers_path = "runs/tiny_models/flux"
    c.model.generate_tiny = True
    c.model.dtype = "float32"
    c.adapter.rank = 4
    c.optimizer.lr = 1e-3
    c.dataset.synthetic_samples = 8
  elif arg:
    raise ValueError(f"unknown configs/flux.py variant {arg!r}; known: '', 'tiny'")
  return c
