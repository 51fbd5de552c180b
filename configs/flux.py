"""FLUX.1 LoRA training.

  python main.py --config configs/flux.py:tiny     # embedded tiny model and data, CPU, no downloads
  python main.py --config configs/flux.py:tiny --cache_only   # cache latents and text, then exit
  python main.py --config configs/flux.py --config.model.diffusers_path=/models/FLUX.1-dev \
      --config.dataset.path=/data/my_images

Variants (the part after ':'): "" (FLUX.1-dev, bf16, rank 32) and "tiny" (a random tiny Flux
generated on first use with a small synthetic captioned image set). Key names follow diffusion-pipe.
"""
import ml_collections


def get_config(arg=""):
  c = ml_collections.ConfigDict()
  c.output_dir = "runs/flux"
  c.seed = 0
  c.generate_tiny = False  # write a tiny random pipeline and image set to the paths if absent
  c.epochs = 100
  c.max_steps = 0  # stop after this many steps (0: run all epochs)
  c.micro_batch_size_per_gpu = 1
  c.pipeline_stages = 1  # data parallel over all devices (pipeline stages: not yet)
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
  # "none": fastest, most memory; "block": remat each block; "block_offload": "block" with each
  # block's input kept in host memory until the backward pass (less memory, slower)
  c.activation_checkpointing = "block"
  # False (one stage; any activation_checkpointing but "block_offload"): blocks unrolled, the
  # step run as programs per block, faster and leaner than the scan (Flux on an H200: no remat
  # 0.381 s, 53 GiB; "block" with blocks_to_swap=16 0.520 s, 23.8 GiB; under a minute to compile)
  c.scan_layers = True
  # Compiled programs (and XLA's GPU autotuning results) kept across runs, so that a relaunch, a
  # resume or another run of the same shapes skips compiling each bucket's step; "" turns it off
  # (JAX_COMPILATION_CACHE_DIR, when set, wins)
  c.compilation_cache_dir = "~/.cache/diffpipe-jax/xla"
  # N blocks' frozen weights (the single blocks first, spread evenly) stay in pinned host memory
  # and are copied to the GPU beside the compute, forward and again backward (one stage only;
  # scanned, their stack is rematerialised block by block; Flux, unrolled per-block remat with
  # 16 single blocks swapped: 23.8 GiB, 0.520 s)
  c.blocks_to_swap = 0

  c.model = ml_collections.ConfigDict()
  c.model.type = "flux"
  c.model.diffusers_path = ""  # a diffusers pipeline folder (holds transformer/)
  c.model.transformer_path = ""  # or a BFL single file (flux1-dev.safetensors); wins if set
  c.model.dtype = "bfloat16"  # compute and frozen-weight dtype
  # "float8": the blocks' frozen Linears in float8_e4m3fn, and their matmuls in float8
  c.model.transformer_dtype = ""
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

  c.dataset = ml_collections.ConfigDict()  # diffusion-pipe's dataset keys
  c.dataset.path = ""  # a directory of images (and same-stem .txt captions)
  c.dataset.toml_path = ""  # or a diffusion-pipe dataset.toml, as is
  c.dataset.resolutions = (1024,)  # areas: 1024 means 1024x1024 pixels worth
  c.dataset.enable_ar_bucket = True
  c.dataset.min_ar = 0.5
  c.dataset.max_ar = 2.0
  c.dataset.num_ar_buckets = 7
  c.dataset.num_repeats = 1
  c.dataset.caption_prefix = ""
  c.caching_batch_size = 1

  # Eval: name -> dict(path=...), the dataset's bucket settings; loss at fixed t quantiles.
  c.eval_datasets = ml_collections.ConfigDict()
  c.eval_every_n_steps = 0
  c.eval_every_n_epochs = 1
  c.eval_before_first_step = True

  if arg == "tiny":
    c.output_dir = "runs/flux_tiny"
    c.epochs = 4
    c.micro_batch_size_per_gpu = 2
    c.gradient_accumulation_steps = 2  # 12 images in 3 aspect buckets: 3 steps an epoch
    c.checkpoint_every_n_steps = 4
    c.save_dtype = "float32"
    c.generate_tiny = True
    c.model.diffusers_path = "runs/tiny/flux_pipeline"
    c.model.dtype = "float32"
    c.adapter.rank = 4
    c.optimizer.lr = 1e-3
    c.dataset.path = "runs/tiny/images"
    c.dataset.resolutions = (32,)
    c.caching_batch_size = 4
    c.eval_datasets.tiny_eval = dict(path="runs/tiny/eval_images")
  elif arg:
    raise ValueError(f"unknown configs/flux.py variant {arg!r}; known: '', 'tiny'")
  return c
