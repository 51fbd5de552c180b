"""A diffusion-pipe user's training TOML as is (diffpipe_jax/diffusion_pipe.py): each family's TOML
trains end to end on its tiny model, every refused key is one line that says what to do, the
keys diffusion-pipe names differently take effect, and its defaults hold where a TOML is silent.
The TOMLs are written here in the form of diffusion-pipe's example files (not copied from them)."""
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import xla_flags
from diffpipe_jax import diffusion_pipe, family as family_lib, lora, models, sampling, schema, tiny, validate
from diffpipe_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINING = """\
output_dir = 'out'
dataset = 'dataset.toml'
epochs = 2
micro_batch_size_per_gpu = 1
pipeline_stages = 1
gradient_accumulation_steps = 1
gradient_clipping = 1.0
warmup_steps = 0
eval_every_n_epochs = 1
eval_before_first_step = true
save_every_n_epochs = 1
checkpoint_every_n_minutes = 120
activation_checkpointing = true
partition_method = 'parameters'
save_dtype = 'float32'
caching_batch_size = 4
steps_per_print = 1
video_clip_mode = 'single_beginning'
{top}
[model]
type = '{type}'
diffusers_path = '{pipeline}'
dtype = 'float32'
{model}
[adapter]
type = 'lora'
rank = 4
dtype = '{adapter_dtype}'
{adapter}
[optimizer]
type = '{optimizer}'
lr = 1e-3
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8
"""


def write_training_toml(folder, model_type="flux", pipeline="pipeline", top="", model="", adapter="",
                        optimizer="adamw", adapter_dtype="float32", name="training.toml"):
  """TRAINING with `top`'s keys in place of the template's, and the sections' additions."""
  path = os.path.join(folder, name)
  keys = lambda text: {line.split("=")[0].strip() for line in text.splitlines() if "=" in line}
  head, rest = TRAINING.split("{top}")
  head = "".join(line for line in head.splitlines(True) if not keys(line) & keys(("\n" + top).split("\n[")[0]))
  with open(path, "w") as f:
    f.write((head + "{top}" + rest).format(type=model_type, pipeline=pipeline, top=top, model=model,
                                           adapter=adapter, optimizer=optimizer, adapter_dtype=adapter_dtype))
  return path


def write_dataset_toml(folder, media_folder, resolution, frame_buckets=(1,), name="dataset.toml", ar_buckets=True):
  path = os.path.join(folder, name)
  with open(path, "w") as f:
    f.write(f"resolutions = [{resolution}]\nenable_ar_bucket = {str(ar_buckets).lower()}\n"
            f"frame_buckets = {list(frame_buckets)}\n\n[[directory]]\npath = '{media_folder}'\n"
            "num_repeats = 1\n")
  return path


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
  """The current directory, where the TOMLs' relative paths resolve (as in diffusion-pipe)."""
  monkeypatch.chdir(tmp_path)
  write_dataset_toml(tmp_path, "media", 32)
  os.makedirs(tmp_path / "media")
  return tmp_path


def translated(folder, **toml):
  config, ignored = diffusion_pipe.config_from_toml(write_training_toml(folder, **toml))
  return config, ignored


def refusal(folder, **toml) -> str:
  with pytest.raises(UserError) as e:
    translated(folder, **toml)
  return str(e.value)


@pytest.mark.parametrize("toml, message", [
    (dict(top="compile = true"), "compile: the step is always compiled by XLA here; remove `compile`"),
    (dict(top="partition_method = 'uniform'"), "partition_method='uniform': only 'parameters'"),
    (dict(top="zero_optimization = 2"), "zero_optimization: DeepSpeed ZeRO does not apply"),
    (dict(top="[deepspeed]\nx = 1"), "deepspeed: DeepSpeed settings do not apply"),
    (dict(top="[lr_config]\nx = 1"), "unknown table [lr_config]"),
    (dict(top="eval_datasets = ['eval.toml']"), "eval_datasets must be a list of {name = '...', config"),
    (dict(top="eval_datasets = [{name = 'a', config = 'missing.toml'}]"),
     "eval_datasets 'a' config='missing.toml': no such dataset TOML (relative paths resolve from the current directory"),
    (dict(top="learning_rate = 1"), "learning_rate: unknown key for flux"),
    (dict(model="llm_path = 'x'"), "model.llm_path: unknown key for flux"),
    (dict(model="bypass_guidance_embedding = true"), "model.bypass_guidance_embedding: models without a guidance embedding"),
    (dict(adapter="alpha = 4"), "adapter.alpha: diffusion-pipe fixes alpha = rank"),
    (dict(adapter="fuse_adapters = true"), "adapter.fuse_adapters: merging LoRAs into the base is not supported"),
    (dict(model_type="sdxl"), "type='sdxl'; known types: "),
])
def test_a_refused_key_is_one_line_naming_it_and_what_to_do(in_tmp, toml, message):
  error = refusal(in_tmp, **toml)
  assert message in error and "\n" not in error, error


def test_wans_files_map_to_their_keys(in_tmp):
  """A Wan TOML's Wan-AI folder and ComfyUI UMT5 file (diffusion-pipe's keys) are ours."""
  config, _ = translated(in_tmp, model_type="wan",
                         model="ckpt_path = 'Wan2.1-T2V-14B'\nllm_path = 'umt5_xxl_fp16.safetensors'")
  assert (config.model.ckpt_path, config.model.llm_path) == ("Wan2.1-T2V-14B", "umt5_xxl_fp16.safetensors")


def test_every_refusal_is_reported_at_once(in_tmp):
  error = refusal(in_tmp, top="compile = true\nzero_optimization = 2", adapter="alpha = 4")
  assert error.startswith("3 problems:") and len(error.splitlines()) == 4, error


def test_a_missing_dataset_or_model_type_says_where_paths_resolve(in_tmp):
  os.remove(in_tmp / "dataset.toml")
  assert f"from the current directory, {in_tmp}, as in diffusion-pipe" in refusal(in_tmp)
  with open(in_tmp / "t.toml", "w") as f:
    f.write("output_dir = 'out'\n")
  with pytest.raises(UserError, match="no \\[model\\] type; set it to one of flux"):
    diffusion_pipe.config_from_toml(str(in_tmp / "t.toml"))


def test_a_toml_syntax_error_is_one_line_naming_the_file_and_line(in_tmp):
  """In the training TOML, and in a dataset TOML that it names as its dataset or an eval set's."""
  with open(in_tmp / "broken.toml", "w") as f:
    f.write("resolutions = [32]\nnum_repeats 2\n")
  syntax = "broken.toml: not valid TOML: Expected '=' after a key in a key/value pair (at line 2, column 13)"
  with pytest.raises(UserError) as e:
    diffusion_pipe.config_from_toml("broken.toml")
  assert str(e.value) == f"--config {syntax}"
  config, _ = translated(in_tmp, top="dataset = 'broken.toml'\neval_datasets = [{name = 'e', config = 'broken.toml'}]")
  problems = validate.file_problems(config, family_lib.get("flux"))
  assert syntax in problems and f"eval_datasets.e.toml_path: {syntax}" in problems, problems


def test_values_are_checked_by_the_config_rules(in_tmp):
  """Wrong values pass the translation and fail validation with the key's rule, as our own
  config files do (the optimizer's name included)."""
  config, _ = translated(in_tmp, top="epochs = 1.5\nmicro_batch_size_per_gpu = [[512]]",
                         optimizer="automagic")
  problems = validate.value_problems(validate.flatten(config), schema.keys(family_lib.get("flux")))
  assert any(p.startswith("epochs=1.5: must be an integer >= 1") for p in problems), problems
  assert any(p.startswith("micro_batch_size_per_gpu=((512,),): must be") for p in problems), problems
  assert any(p.startswith("optimizer.type='automagic'") for p in problems), problems


def test_keys_are_taken_with_diffusion_pipes_meaning_and_defaults(in_tmp):
  config, ignored = translated(in_tmp, top="micro_batch_size_per_gpu = [[512, 4], [1024, 1]]\n"
                               "video_clip_mode = 'single_middle'\nactivation_checkpointing = 'unsloth'",
                               adapter="exclude_modules = 'proj_out'")
  assert config.micro_batch_size_per_gpu == ((512, 4), (1024, 1))
  assert config.dataset.video_clip_mode == "single_middle" and config.dataset.toml_path == "dataset.toml"
  assert config.activation_checkpointing == "block_offload" and config.adapter.exclude_modules == ("proj_out",)
  assert set(ignored) == {"steps_per_print", "partition_method"}
  assert translated(in_tmp)[0].activation_checkpointing == "block"  # `true` in the TOML
  assert sampling.size(config, 16) == (1, 32, 32)  # samples at the dataset TOML's first resolution
  # a TOML without them: diffusion-pipe's defaults, not ours
  with open(in_tmp / "bare.toml", "w") as f:
    f.write("output_dir = 'out'\ndataset = 'dataset.toml'\nepochs = 1\nmicro_batch_size_per_gpu = 1\n"
            "[model]\ntype = 'flux'\n[adapter]\ntype = 'lora'\nrank = 8\n[optimizer]\ntype = 'adamw'\nlr = 1e-4\n")
  bare, _ = diffusion_pipe.config_from_toml(str(in_tmp / "bare.toml"))
  assert (bare.activation_checkpointing, bare.save_every_n_epochs, bare.eval_every_n_epochs,
          bare.checkpoint_every_n_minutes) == ("none", 0, 0, 0)


def run_toml(folder, toml, *overrides, devices=1):
  """`python -m diffpipe_jax --config TOML` in `folder`, with nothing of the checkout on the path
  but the installed package: the package is the whole product (its configs included)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([sys.executable, "-m", "diffpipe_jax", "--config", toml, *overrides],
                        env=dict(env, XLA_FLAGS=xla_flags(devices)), cwd=folder,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_flux_training_toml_runs_as_is(tmp_path, tiny_pipelines):
  """Eval datasets in TOMLs of their own, evals and exports every 8 examples (the x axis), a
  checkpoint each epoch, per-resolution micro batches evaluated in micro-batches of one, caption
  dropout."""
  images, eval_images = tiny.write_image_dataset(str(tmp_path / "images")), tiny.write_image_dataset(
      str(tmp_path / "eval_images"), sizes=((40, 40),), num_images=4)
  tiny.write_video_dataset(images, clips=tiny.VIDEO_CLIPS[:1], image_sizes=())
  write_dataset_toml(tmp_path, images, 32, frame_buckets=(1, 33))  # as diffusion-pipe's example
  write_dataset_toml(tmp_path, eval_images, 32, name="eval.toml", ar_buckets=False)
  toml = write_training_toml(tmp_path, pipeline=tiny_pipelines("flux"), top="""
eval_datasets = [{name = 'held_out', config = 'eval.toml'}]
micro_batch_size_per_gpu = [[32, 2], [64, 1]]
gradient_accumulation_steps = 2
eval_every_n_examples = 8
eval_micro_batch_size_per_gpu = 1
eval_gradient_accumulation_steps = 2
save_every_n_examples = 8
checkpoint_every_n_epochs = 1
uncond_fraction = 0.5
x_axis_examples = true
""")
  done = run_toml(tmp_path, toml, "--config.eval_every_n_epochs=0", "--config.save_every_n_epochs=0")
  assert done.returncode == 0, done.stdout
  assert done.stdout.count("keys with no effect here: partition_method") == 1, done.stdout
  assert "global batches [4]; 3 steps an epoch" in done.stdout  # 12 images: 3 buckets of 4
  assert (f"dataset {images}: 1 of 13 files skipped, videos, and this model takes images only: "
          "clip000.mp4") in done.stdout, done.stdout  # Flux trains on the images
  (run,) = glob.glob(str(tmp_path / "out" / "*"))
  with open(os.path.join(run, "config.json")) as f:  # the dataset TOML's settings, not ours
    dataset = json.load(f)["dataset"]
  assert (dataset["resolutions"], dataset["frame_buckets"]) == ([32], [1, 33]), dataset
  assert sorted(n for n in os.listdir(run) if not n.startswith((".", "events."))) == [
      "config.json", "global_step3", "global_step6", "metrics.jsonl", "step2", "step4", "step6"]
  assert [(m["step"], m["examples"]) for m in metrics(run) if "held_out/loss" in m] == [
      (0, 0), (2, 8), (4, 16), (6, 24)]


def diffusion_pipe_run_folder(folder, model_type, pipeline, exclude):
  """A diffusion-pipe run folder holding a random LoRA of the family (rank 4, `exclude` left
  out) as its newest save, in diffusion-pipe's file name and `diffusion_model.` keys; the LoRA."""
  fam = family_lib.get(model_type)
  model = models.load(model_type, pipeline, progress=False)
  abstract = models.abstract_params(fam, model.module, model.config)
  adapter = lora.init(abstract, fam.lora_targets, 4, jnp.float32, jax.random.key(0), exclude=exclude)
  adapter = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(1), a.shape) * 0.1, adapter)
  ours = lora.save(adapter, str(folder / "ours"), fam, 4, np.float32)
  tensors = {"diffusion_model." + k[len(fam.lora_prefix):]: v for k, v in load_file(ours).items()}
  for name in ("epoch2", "epoch10"):  # epoch10, the newest, holds the LoRA
    os.makedirs(folder / "dp_run" / name)
    save_file(tensors if name == "epoch10" else {k: v * 0 for k, v in tensors.items()},
              str(folder / "dp_run" / name / "adapter_model.safetensors"))
  return tensors


def test_hunyuan_video_training_toml_continues_a_diffusion_pipe_lora(tmp_path, tiny_pipelines):
  """init_from_existing from a diffusion-pipe run folder (its newest save), exclude_modules, a
  constant learning rate beside a warm-up, the smooth L1 loss and a timestep range: at a rate of
  1e-12 the export is the LoRA it started from, without the excluded modules."""
  pipeline = tiny_pipelines("hunyuan-video")
  exclude = ("linear2", "img_mod.linear")
  started = diffusion_pipe_run_folder(tmp_path, "hunyuan-video", pipeline, exclude)
  clips = tiny.write_video_dataset(str(tmp_path / "clips"))
  write_dataset_toml(tmp_path, clips, 64, frame_buckets=(1, 5, 17))
  toml = write_training_toml(
      tmp_path, "hunyuan-video", pipeline, top="epochs = 1\nwarmup_steps = 10\nforce_constant_lr = 1e-12\n"
      "smooth_l1_beta = 0.1\nmicro_batch_size_per_gpu = 2\ngradient_accumulation_steps = 2",
      model="min_t = 0.1\nmax_t = 0.9", adapter=f"exclude_modules = {list(exclude)}\n"
      f"init_from_existing = 'dp_run'")
  done = run_toml(tmp_path, toml)
  assert done.returncode == 0, done.stdout
  assert "dp_run: taking its newest LoRA, epoch10/" in done.stdout, done.stdout
  (run,) = glob.glob(str(tmp_path / "out" / "*"))
  assert {m["train/lr"] for m in metrics(run) if "train/lr" in m} == {1e-12}
  exported = load_file(os.path.join(run, "epoch1", lora.WEIGHTS_NAME))
  assert not any(f".{m}." in k for k in exported for m in exclude)
  ours = {"diffusion_model." + k[len("transformer."):]: v for k, v in exported.items()}
  assert set(ours) == set(started)
  for k, v in started.items():
    np.testing.assert_allclose(ours[k], v, rtol=0, atol=1e-8, err_msg=k)


def test_ltx_video_training_toml_runs_on_a_manual_pipeline_split(tmp_path, tiny_pipelines):
  """Two pipeline stages split where partition_split says, images in micro-batches of their own
  size, bfloat16 LoRA weights with Kahan-summed AdamW, the Huber loss."""
  pipeline = tiny_pipelines("ltx-video")
  clips = tiny.write_video_dataset(str(tmp_path / "clips"))
  write_dataset_toml(tmp_path, clips, 64, frame_buckets=(1, 9, 17))
  toml = write_training_toml(
      tmp_path, "ltx-video", pipeline, optimizer="adamw_optimi", adapter_dtype="bfloat16",
      top="epochs = 1\npipeline_stages = 2\npartition_split = [2]\nmicro_batch_size_per_gpu = 2\n"
      "image_micro_batch_size_per_gpu = 4\nhuber_delta = 0.5\ngradient_accumulation_steps = 1")
  done = run_toml(tmp_path, toml, devices=2)
  assert done.returncode == 0, done.stdout
  # 4 clips in each of two video buckets, 4 images: 2 + 2 steps of 2 clips, 1 of 4 images
  assert "global batches [2, 4]; 5 steps an epoch" in done.stdout, done.stdout
  assert "stage 0: transformer_blocks 0" in done.stdout, done.stdout
  assert "without partition_split the stages are balanced" in done.stdout, done.stdout
  (run,) = glob.glob(str(tmp_path / "out" / "*"))
  exported = load_file(os.path.join(run, "epoch1", lora.WEIGHTS_NAME))
  assert all(v.dtype == np.float32 for v in exported.values())  # save_dtype
  assert len(metrics(run)) > 5


def test_both_commands_take_a_training_toml_as_their_config():
  from diffpipe_jax import cli
  toml_config = f"--config={cli.TOML_CONFIG}:a.toml"
  assert cli.toml_as_config_file(["main.py", "--config", "a.toml", "--config.epochs=3"]) == [
      "main.py", toml_config, "--config.epochs=3"]
  assert cli.toml_as_config_file(["sample", "--config=a.toml"]) == ["sample", toml_config]
  assert cli.toml_as_config_file(["main.py", "--config", "configs/flux.py:tiny"]) == [
      "main.py", "--config", "configs/flux.py:tiny"]
