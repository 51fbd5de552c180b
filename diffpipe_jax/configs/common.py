"""The keys every family shares (run, optimizer, dataset, checkpoints, memory), with
diffusion-pipe's names; a family's config adds its `model` section and its variants.

Speed and memory of the settings below, per family and GPU: BENCHMARKS.md.
"""
import os

import ml_collections
from ml_collections import config_dict

from diffpipe_jax import tiny as tiny_defaults
from diffpipe_jax.errors import UserError

VARIANTS = ("", "tiny")  # every family's: the released model's defaults, and `tiny`


def check_variant(config_file: str, variant: str):
  """Refuses `--config configs/<family>.py:<variant>` for a variant other than `VARIANTS`."""
  if variant not in VARIANTS:
    name = f"configs/{os.path.basename(config_file)}"
    raise UserError(f"--config {name}:{variant}: no such variant; use "
                    + " or ".join(f"{name}:{v}" if v else name for v in VARIANTS))


def base(model_type: str) -> ml_collections.ConfigDict:
  """Every key but the family's own `model` keys, which `model(model_type)` starts."""
  c = ml_collections.ConfigDict()
  c.output_dir = f"runs/{model_type.replace('-', '_')}"
  c.seed = 0
  c.generate_tiny = False  # write the tiny pipeline and images to their default paths if absent
  c.epochs = 100
  c.max_steps = 0  # stop after this many steps (0: run all epochs)
  # or ((resolution, batch), ...): per resolution, an area as in dataset.resolutions (a bucket
  # takes the batch of the listed resolution nearest its own)
  c.micro_batch_size_per_gpu = config_dict.FieldReference(1, field_type=object)
  c.image_micro_batch_size_per_gpu = 0  # video families: the micro batch of images (0: as videos')
  c.eval_micro_batch_size_per_gpu = 0  # 0: as micro_batch_size_per_gpu
  c.eval_gradient_accumulation_steps = 1
  c.pipeline_stages = 1  # devices per pipeline; data parallel over the rest
  # devices over which every block's tokens are split (attention all-to-all over the heads, as
  # Ulysses), for sequences too long for one device; composes with data and pipeline parallelism
  c.sequence_parallel = 1
  # (): each block stack spread evenly over the stages; or the first layer of stages 1, 2, ...
  # in diffusion-pipe's numbering of the model's layers (layer 0 its input embedding); every
  # stage then stores as many layers of a stack as its fullest stage (README)
  c.partition_split = ()
  c.gradient_accumulation_steps = 1
  c.gradient_clipping = 1.0  # global norm; 0 disables
  c.warmup_steps = 0
  c.lr_scheduler = "constant"  # constant | linear | cosine (after warm-up)
  c.force_constant_lr = 0.0  # > 0: this learning rate throughout, resumed runs too (no warm-up)
  c.save_every_n_epochs = 1  # LoRA exports to epochN/
  c.save_every_n_steps = 0  # ... and stepN/ (0: off)
  c.save_every_n_examples = 0  # ... and whenever this many more training examples were seen
  c.save_dtype = "bfloat16"
  c.checkpoint_every_n_minutes = 120  # resumable training state to global_stepN/ (0: off)
  c.checkpoint_every_n_steps = 0
  c.checkpoint_every_n_epochs = 0
  c.checkpoints_to_keep = 3
  # "none": fastest, most memory; "block": remat each block; "block_save_dots": keep each
  # block's matmul outputs; "block_offload": "block" with each block's input kept in host
  # memory until the backward pass (less memory, slower)
  c.activation_checkpointing = "block"
  # True (one stage; any activation_checkpointing but "block_offload"): the blocks unrolled and
  # the step run as programs per block; False: scanned, one program. None: the faster of the
  # two for the run (stacks.unrolled_or_default): unrolled without remat or with blocks_to_swap,
  # scanned otherwise
  c.unrolled = config_dict.placeholder(bool)
  # Compiled programs (and XLA's GPU autotuning results) kept across runs, so that a relaunch, a
  # resume or another run of the same shapes skips compiling each bucket's step; "" turns it off
  # (JAX_COMPILATION_CACHE_DIR, when set, wins)
  c.compilation_cache_dir = "~/.cache/diffpipe-jax/xla"
  # N blocks' frozen weights (the last stack's first, spread evenly) stay in pinned host memory
  # and are copied to the GPU beside the compute, forward and again backward (one stage only;
  # scanned, their stack is rematerialised block by block)
  c.blocks_to_swap = 0
  # Each GPU's memory both frameworks may use (JAX's pool and PyTorch's VAE and text encoders),
  # as on a smaller card: 24 on an 80 GB GPU trains as a 24 GB card would; 0: the whole card
  # (diffpipe_jax/device_memory.py says how the two share it)
  c.max_device_memory_gib = 0.0
  c.disable_block_swap_for_eval = False  # evals with every weight on the device (faster, more memory)
  # The loss: mean squared error of the velocity, or (one of these > 0) Huber with this delta or
  # smooth L1 with this beta (torch's definitions)
  c.huber_delta = 0.0
  c.smooth_l1_beta = 0.0
  c.uncond_fraction = 0.0  # the fraction of samples trained on the empty caption (caption dropout)
  c.x_axis_examples = False  # TensorBoard's (and W&B's) x axis: examples seen instead of steps

  c.model = model(model_type)

  c.adapter = ml_collections.ConfigDict()
  c.adapter.type = "lora"
  c.adapter.rank = 32
  c.adapter.dtype = "float32"
  c.adapter.dropout = 0.0
  c.adapter.init_from_existing = ""  # a LoRA to continue: ours, or a diffusion-pipe epoch/run folder
  # Linear layers left without a LoRA: module names without block indices ("proj_out",
  # "attn.to_q": the name or its ending), as PEFT's exclude_modules list
  c.adapter.exclude_modules = ()

  c.optimizer = ml_collections.ConfigDict()
  # adamw; adamw_optimi (with adapter.dtype bfloat16: Kahan summation, following float32
  # weights); adamw8bit (moments in 8 bits); prodigy (estimates the lr: set lr 1.0); any case
  c.optimizer.type = "adamw"
  c.optimizer.lr = 2e-5
  c.optimizer.betas = (0.9, 0.99)
  c.optimizer.weight_decay = 0.01
  c.optimizer.eps = 1e-8

  c.monitoring = ml_collections.ConfigDict()  # Weights & Biases beside TensorBoard (pip install wandb)
  c.monitoring.enable_wandb = False
  c.monitoring.wandb_api_key = ""  # "" : wandb's own login, or WANDB_MODE=offline
  c.monitoring.wandb_tracker_name = ""  # the W&B project ("": diffpipe-jax)
  c.monitoring.wandb_run_name = ""  # "": the run directory's name

  c.dataset = ml_collections.ConfigDict()  # diffusion-pipe's dataset keys
  c.dataset.path = ""  # a directory of images (and same-stem .txt captions)
  c.dataset.toml_path = ""  # or a diffusion-pipe dataset.toml, as is
  c.dataset.resolutions = (1024,)  # areas: 1024 means 1024x1024 pixels worth
  c.dataset.enable_ar_bucket = True
  c.dataset.min_ar = 0.5
  c.dataset.max_ar = 2.0
  c.dataset.num_ar_buckets = 7
  c.dataset.frame_buckets = (1,)  # clip lengths in frames (1: images; a video takes the longest <= its own)
  c.dataset.video_clip_mode = "single_beginning"  # or single_middle, multiple_overlapping
  c.dataset.num_repeats = 1
  c.dataset.caption_prefix = ""
  c.caching_batch_size = 1

  # Eval: name -> dict(path=...) (a folder, with the dataset's bucket settings) or
  # dict(toml_path=...) (a dataset TOML); loss at fixed t quantiles.
  c.eval_datasets = ml_collections.ConfigDict()
  c.eval_every_n_steps = 0
  c.eval_every_n_epochs = 1
  c.eval_every_n_examples = 0
  c.eval_before_first_step = True

  # Samples (diffpipe_jax.sampling): each prompt drawn with the LoRA being trained, prompt i from
  # noise of seed sample_seed + i every time, to <run>/samples/step<N>/ and TensorBoard. Off
  # until prompts and an interval are set.
  c.sample_prompts = ()  # prompts; an entry naming a .txt file stands for its lines
  c.sample_every_n_epochs = 0
  c.sample_every_n_steps = 0
  c.sample_steps = 0  # 0: the family's diffusers pipeline's default (its `Family.sampling`)
  c.sample_guidance = -1.0  # < 0: likewise
  c.sample_height = 0  # pixels; 0: the first of dataset.resolutions
  c.sample_width = 0
  c.sample_frames = 1  # video families: 1 + k times the VAE's temporal factor
  c.sample_seed = 0
  c.sample_before_first_step = True  # step 0's samples are the base model's (the LoRA starts at 0)
  return c


def model(model_type: str) -> ml_collections.ConfigDict:
  """The `model` keys every family has; its config file adds its paths and its own keys."""
  m = ml_collections.ConfigDict()
  m.type = model_type  # diffusion-pipe's model.type: which family (diffpipe_jax.family)
  m.dtype = "bfloat16"  # compute and frozen-weight dtype
  # "float8": the blocks' frozen Linears in float8_e4m3fn, and their matmuls in float8
  m.transformer_dtype = ""
  m.timestep_sample_method = "logit_normal"  # or uniform
  m.sigmoid_scale = 1.0
  m.shift = 1.0  # t' = s t / (1 + (s - 1) t); 1 is no shift
  m.min_t = 0.0  # a drawn timestep t in [0, 1] becomes min_t + (max_t - min_t) t, before the shift
  m.max_t = 1.0
  return m


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `:tiny` variant's shared settings: a random tiny pipeline and a small synthetic
  captioned image set written under runs/tiny/ on first use, float32, a few steps (CPU, no
  downloads)."""
  c.output_dir += "_tiny"
  c.epochs = 4
  c.micro_batch_size_per_gpu = 2
  c.gradient_accumulation_steps = 2  # 12 items in 3 buckets: 3 steps an epoch
  c.checkpoint_every_n_steps = 4
  c.save_dtype = "float32"
  c.unrolled = False  # on the CPU the scan compiles faster than the programs per block
  c.generate_tiny = True
  c.model.diffusers_path = tiny_defaults.pipeline_dir(c.model.type)
  c.model.dtype = "float32"
  c.adapter.rank = 4
  c.optimizer.lr = 1e-3
  c.dataset.path = tiny_defaults.IMAGES
  c.dataset.resolutions = (32,)
  c.caching_batch_size = 4
  c.eval_datasets.tiny_eval = dict(path=tiny_defaults.EVAL_IMAGES, toml_path="")  # a folder, not a TOML
  c.sample_prompts = ("a red pattern", "a blue pattern")
  c.sample_every_n_epochs = 2
  c.sample_steps = 4
  return c
