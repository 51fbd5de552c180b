"""The keys every family shares, each declared once (`rules.Key`): its default, the values it
allows, what it does and, where diffusion-pipe's training TOML has it otherwise, how; the names
are diffusion-pipe's. A family adds its own `model` keys (`Family.model_keys`). From this one
table `configs/common.py` builds the config, `validate` checks it and `diffusion_pipe` reads a
TOML into it.

A name with `*` is a pattern, for keys no config has until one sets them: an eval set's, and
the rest of diffusion-pipe's dataset keys.

Speed and memory of the settings below, per family and GPU: BENCHMARKS.md.
"""
import os

import ml_collections
from ml_collections import config_dict

from diffpipe_jax import family as family_lib, flow, media, optim, runtime
from diffpipe_jax.errors import UserError
from diffpipe_jax.rules import (FLAG, PROBABILITY, TEXT, DiffusionPipe, Key, Rule, choice, integer,
                                number, numbers)

DTYPES = ("float32", "bfloat16", "float16")


def dataset_toml(value, key="dataset"):
  """A training TOML's dataset TOML, checked now for the hint on where relative paths resolve."""
  if not isinstance(value, str) or not os.path.isfile(value):
    raise UserError(f"{key}={value!r}: no such dataset TOML (relative paths resolve from the "
                    f"current directory, {os.getcwd()}, as in diffusion-pipe)")
  return value


def activation_checkpointing_from_toml(value):
  """diffusion-pipe's true, false and "unsloth" as ours (only a bool or a string is looked up:
  1 == True, and a list has no hash)."""
  ours = {True: "block", False: "none", "unsloth": "block_offload"}
  return ours.get(value, value) if isinstance(value, (bool, str)) else value


SHARED = {
    "output_dir": Key(lambda model_type: f"runs/{model_type.replace('-', '_')}",
                      Rule("a non-empty path", lambda v: isinstance(v, str) and bool(v)),
                      "the run's folder: checkpoints, LoRA exports, samples, metrics"),
    "seed": Key(0, integer(0), "seeds the LoRA's initialisation, the data order and the noise"),
    "generate_tiny": Key(False, FLAG,
                         "write the tiny pipeline and images to their default paths if absent"),
    "epochs": Key(100, integer(1), "passes over the dataset"),
    "max_steps": Key(0, integer(0), "stop after this many steps (0: run all epochs)"),
    "micro_batch_size_per_gpu": Key(
        1, Rule("an integer >= 1, or a list of [resolution, batch] pairs of integers >= 1",
                lambda v: integer(1).ok(v) or numbers(numbers(integer(1), length=2)).ok(v)),
        "examples per device and micro-batch; or ((resolution, batch), ...): per resolution, an "
        "area as in dataset.resolutions (a bucket takes the batch of the listed resolution "
        "nearest its own)", field_type=object),
    "image_micro_batch_size_per_gpu": Key(
        0, integer(0), "video families: the micro batch of images (0: as videos')"),
    "eval_micro_batch_size_per_gpu": Key(
        0, integer(0), "the eval micro batch (0: as micro_batch_size_per_gpu)"),
    "eval_gradient_accumulation_steps": Key(1, integer(1), "micro-batches per eval batch"),
    "pipeline_stages": Key(1, integer(1), "devices per pipeline; data parallel over the rest"),
    "sequence_parallel": Key(
        1, integer(1),
        "devices over which every block's tokens are split (attention all-to-all over the heads, "
        "as Ulysses), for sequences too long for one device; composes with data and pipeline "
        "parallelism"),
    "partition_split": Key(
        (), Rule("a list of increasing layer indices >= 1 (or empty)",
                 lambda v: isinstance(v, (tuple, list)) and all(map(integer(1).ok, v))
                 and list(v) == sorted(set(v))),
        "(): each block stack spread evenly over the stages; or the first layer of stages 1, 2, "
        "... in diffusion-pipe's numbering of the model's layers (layer 0 its input embedding); "
        "every stage then stores as many layers of a stack as its fullest stage (README)"),
    "gradient_accumulation_steps": Key(1, integer(1), "micro-batches per optimizer step"),
    "gradient_clipping": Key(1.0, number(0), "global norm; 0 disables"),
    "warmup_steps": Key(0, integer(0), "steps of linear warm-up from 0 to optimizer.lr"),
    "lr_scheduler": Key("constant", choice(*optim.SCHEDULES), "the learning rate after warm-up"),
    "force_constant_lr": Key(
        0.0, number(0), "> 0: this learning rate throughout, resumed runs too (no warm-up)"),
    "save_every_n_epochs": Key(
        1, integer(0), "a LoRA export to epochN/ every this many epochs (0: off)",
        diffusion_pipe=DiffusionPipe(default=0)),
    "save_every_n_steps": Key(
        0, integer(0), "a LoRA export to stepN/ every this many steps (0: off)"),
    "save_every_n_examples": Key(
        0, integer(0), "a LoRA export whenever this many more examples were seen (0: off)"),
    "save_dtype": Key("bfloat16", choice(*DTYPES), "the exported LoRAs' dtype"),
    "checkpoint_every_n_minutes": Key(
        120, number(0), "a resumable checkpoint (global_stepN/) every this many minutes (0: off)",
        diffusion_pipe=DiffusionPipe(default=0)),
    "checkpoint_every_n_steps": Key(0, integer(0), "a checkpoint every this many steps (0: off)"),
    "checkpoint_every_n_epochs": Key(0, integer(0), "a checkpoint every this many epochs (0: off)"),
    "checkpoints_to_keep": Key(3, integer(1), "the newest checkpoints kept; older ones deleted"),
    "activation_checkpointing": Key(
        "block", choice(*runtime.REMAT_POLICIES),
        '"none": fastest, most memory; "block": remat each block; "block_save_dots": keep each '
        'block\'s matmul outputs; "block_save_attention": keep only its attention outputs (GPU: '
        'the backward pass recomputes the Linears, not attention); "block_offload": "block" '
        "with each block's input kept in host memory until the backward pass (less memory, "
        "slower)",
        diffusion_pipe=DiffusionPipe(default="none", value=activation_checkpointing_from_toml)),
    "unrolled": Key(
        None, Rule("True, False or None (True where it can be)",
                   lambda v: v is None or isinstance(v, bool)),
        "True (one stage): the blocks unrolled and the step run as programs per block; False: "
        "scanned, one program. None: the faster of the two for the run "
        "(runtime.unrolled_or_default): unrolled without remat or with blocks_to_swap, scanned "
        "otherwise", field_type=bool),
    "compilation_cache_dir": Key(
        "~/.cache/diffpipe-jax/xla", TEXT,
        "compiled programs (and XLA's GPU autotuning results) kept across runs, so that a "
        "relaunch, a resume or another run of the same shapes skips compiling each bucket's "
        'step; "" turns it off (JAX_COMPILATION_CACHE_DIR, when set, wins)'),
    "blocks_to_swap": Key(
        0, integer(0),
        "N blocks' frozen weights (the last stack's first, spread evenly) stay in pinned host "
        "memory and are copied to the GPU beside the compute, forward and again backward (one "
        "stage only; scanned, their stack is rematerialised block by block)"),
    "max_device_memory_gib": Key(
        0.0, number(0),
        "each GPU's memory both frameworks may use (JAX's pool and PyTorch's VAE and text "
        "encoders), as on a smaller card: 24 on an 80 GB GPU trains as a 24 GB card would; 0: the "
        "whole card (diffpipe_jax/device_memory.py says how the two share it)"),
    "disable_block_swap_for_eval": Key(
        False, FLAG, "evals with every weight on the device (faster, more memory)"),
    "huber_delta": Key(
        0.0, number(0),
        "the loss: mean squared error of the velocity, or (> 0) Huber with this delta (torch's "
        "definition)"),
    "smooth_l1_beta": Key(0.0, number(0), "> 0: the loss is smooth L1 with this beta (torch's "
                          "definition) instead"),
    "uncond_fraction": Key(
        0.0, PROBABILITY, "the fraction of samples trained on the empty caption (caption dropout)"),
    "x_axis_examples": Key(
        False, FLAG, "TensorBoard's (and W&B's) x axis: examples seen instead of steps"),

    "model.type": Key(lambda model_type: model_type, choice(*family_lib.names()),
                      "diffusion-pipe's model.type: which family (diffpipe_jax.family)"),
    "model.dtype": Key("bfloat16", choice(*DTYPES), "compute and frozen-weight dtype"),
    "model.transformer_dtype": Key(
        "", choice("", "float8"),
        '"float8": the blocks\' frozen Linears in float8_e4m3fn, and their matmuls in float8'),
    "model.timestep_sample_method": Key(
        "logit_normal", choice(*flow.TIMESTEP_METHODS), "how training timesteps are drawn"),
    "model.sigmoid_scale": Key(1.0, number(0, above=True), "logit_normal's scale"),
    "model.shift": Key(1.0, number(0, above=True), "t' = s t / (1 + (s - 1) t); 1 is no shift"),
    "model.min_t": Key(
        0.0, PROBABILITY,
        "a drawn timestep t in [0, 1] becomes min_t + (max_t - min_t) t, before the shift"),
    "model.max_t": Key(1.0, PROBABILITY, "the drawn timesteps' upper end (see min_t)"),

    "adapter.type": Key("lora", choice("lora"), "the adapter trained"),
    "adapter.rank": Key(32, integer(1), "the LoRA's rank (alpha = rank, as diffusion-pipe)"),
    "adapter.dtype": Key("float32", choice("float32", "bfloat16"), "the LoRA weights' dtype"),
    "adapter.dropout": Key(0.0, number(0, below=1), "dropout on the LoRA's input in training"),
    "adapter.init_from_existing": Key(
        "", TEXT, "a LoRA to continue: ours, or a diffusion-pipe epoch/run folder"),
    "adapter.exclude_modules": Key(
        (), Rule("a list of module names", lambda v: isinstance(v, (tuple, list))
                 and all(isinstance(m, str) and m for m in v)),
        'Linear layers left without a LoRA: module names without block indices ("proj_out", '
        '"attn.to_q": the name or its ending), as PEFT\'s exclude_modules list',
        diffusion_pipe=DiffusionPipe(value=lambda v: [v] if isinstance(v, str) else v)),

    "optimizer.type": Key(
        "adamw", Rule(f"one of {', '.join(map(repr, optim.OPTIMIZERS))}, in any case (automagic: "
                      "no maintained JAX library implements it)",
                      lambda v: isinstance(v, str) and v.lower() in optim.OPTIMIZERS),
        "adamw; adamw_optimi (with adapter.dtype bfloat16: Kahan summation, following float32 "
        "weights); adamw8bit (moments in 8 bits); prodigy (estimates the lr: set lr 1.0); any "
        "case"),
    "optimizer.lr": Key(2e-5, number(0, above=True), "the learning rate"),
    "optimizer.betas": Key((0.9, 0.99), numbers(number(0, below=1), length=2), "Adam's betas"),
    "optimizer.weight_decay": Key(0.01, number(0), "decoupled weight decay"),
    "optimizer.eps": Key(1e-8, number(0, above=True), "Adam's epsilon"),

    "monitoring.enable_wandb": Key(
        False, FLAG, "Weights & Biases beside TensorBoard (pip install wandb)"),
    "monitoring.wandb_api_key": Key("", TEXT, '"": wandb\'s own login, or WANDB_MODE=offline'),
    "monitoring.wandb_tracker_name": Key("", TEXT, 'the W&B project ("": diffpipe-jax)'),
    "monitoring.wandb_run_name": Key("", TEXT, '"": the run directory\'s name'),

    "dataset.path": Key("", TEXT, "a directory of images (and same-stem .txt captions)"),
    "dataset.toml_path": Key("", TEXT, "or a diffusion-pipe dataset.toml, as is, instead of path",
                             diffusion_pipe=DiffusionPipe(name="dataset", value=dataset_toml)),
    "dataset.resolutions": Key(
        (1024,), numbers(integer(1)), "areas: 1024 means 1024x1024 pixels worth"),
    "dataset.enable_ar_bucket": Key(True, FLAG, "buckets by aspect ratio (False: square only)"),
    "dataset.min_ar": Key(0.5, number(0, above=True), "the narrowest bucket's width / height"),
    "dataset.max_ar": Key(2.0, number(0, above=True), "the widest bucket's width / height"),
    "dataset.num_ar_buckets": Key(
        7, integer(1), "aspect ratio buckets, geometrically from min_ar to max_ar"),
    "dataset.frame_buckets": Key(
        (1,), numbers(integer(1)),
        "clip lengths in frames (1: images; a video takes the longest <= its own)"),
    "dataset.video_clip_mode": Key(
        "single_beginning", choice(*media.CLIP_MODES), "where a video's clip is taken from",
        diffusion_pipe=DiffusionPipe(name="video_clip_mode")),
    "dataset.num_repeats": Key(1, integer(1), "times each item is seen an epoch"),
    "dataset.caption_prefix": Key("", TEXT, "put before every caption"),
    "dataset.*": Key(None, Rule("any value (media.py checks it)", lambda v: True),
                     "diffusion-pipe's other dataset keys (directories, ar_buckets, ...): media.py "
                     "checks them with the dataset"),
    "caching_batch_size": Key(1, integer(1), "items per batch when caching latents and text"),

    "eval_datasets.*.path": Key(
        "", TEXT, "an eval set name -> a folder (with the dataset's bucket settings); the loss at "
                  "fixed t quantiles"),
    "eval_datasets.*.toml_path": Key("", TEXT, "an eval set name -> a dataset TOML"),
    "eval_every_n_steps": Key(0, integer(0), "an eval every this many steps (0: off)"),
    "eval_every_n_epochs": Key(1, integer(0), "an eval every this many epochs (0: off)",
                               diffusion_pipe=DiffusionPipe(default=0)),
    "eval_every_n_examples": Key(
        0, integer(0), "an eval whenever this many more training examples were seen (0: off)"),
    "eval_before_first_step": Key(True, FLAG, "an eval before training starts"),

    "sample_prompts": Key(
        (), Rule("a list of prompts (or .txt files of a prompt a line)",
                 lambda v: isinstance(v, (tuple, list)) and all(isinstance(p, str) for p in v)),
        "samples (diffpipe_jax.sampling), off until prompts and an interval are set: each prompt "
        "drawn with the LoRA being trained, to <run>/samples/step<N>/ and TensorBoard; an entry "
        "naming a .txt file stands for its lines"),
    "sample_images": Key(
        (), Rule("a list of image files", lambda v: isinstance(v, (tuple, list)) and all(
            isinstance(p, str) for p in v)),
        "an image-to-video model's samples: each prompt's first frame, an image a prompt in "
        "their order, resized and centre-cropped to the sample size (a model that also draws "
        "from text alone takes them or none)"),
    "sample_negative_prompt": Key(
        "", TEXT, "a family with classifier-free guidance: what its samples are guided away from "
        "(\"\": the empty prompt, the diffusers pipelines' default)"),
    "sample_every_n_epochs": Key(0, integer(0), "samples every this many epochs (0: off)"),
    "sample_every_n_steps": Key(0, integer(0), "samples every this many steps (0: off)"),
    "sample_steps": Key(
        0, integer(0), "0: the family's diffusers pipeline's default (its `Family.sampling`)"),
    "sample_guidance": Key(-1.0, number(-1), "< 0: the family's diffusers pipeline's default"),
    "sample_guidance_2": Key(
        -1.0, number(-1), "a checkpoint of two experts sampled with both: the second's guidance "
        "(the pipeline's guidance_scale_2); < 0: sample_guidance's, as the pipeline defaults"),
    "sample_height": Key(0, integer(0), "pixels; 0: the first of dataset.resolutions (to the VAE's multiple)"),
    "sample_width": Key(0, integer(0), "pixels; 0: the first of dataset.resolutions (to the VAE's multiple)"),
    "sample_frames": Key(1, integer(1), "video families: 1 + k times the VAE's temporal factor"),
    "sample_seed": Key(0, integer(0), "prompt i is drawn from noise of seed sample_seed + i"),
    "sample_before_first_step": Key(
        True, FLAG, "step 0's samples are the base model's (the LoRA starts at 0)"),
}


def keys(family) -> dict:
  """Every key of `family`'s config: the shared ones and its own `model` keys."""
  return {**SHARED, **{f"model.{name}": key for name, key in family.model_keys.items()}}


def config(family) -> ml_collections.ConfigDict:
  """`family`'s config with every key at its default."""
  c = ml_collections.ConfigDict()
  for name, key in keys(family).items():
    # a pattern ("eval_datasets.*.path") makes its section, empty
    *sections, leaf = name.partition("*")[0].split(".")
    parent = c
    for section in sections:
      if section not in parent:
        parent[section] = ml_collections.ConfigDict()
      parent = parent[section]
    if leaf:
      value = key.default(family.type) if callable(key.default) else key.default
      parent[leaf] = (config_dict.FieldReference(value, field_type=key.field_type)
                      if key.field_type else value)
  return c
