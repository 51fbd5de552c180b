"""The config is checked whole before anything runs: every key has a rule, every bad value is one
line naming the key, the value and what is allowed, and main.py stops on it without writing."""
import fnmatch
import os

import ml_collections
import pytest

from conftest import FAMILIES, family_config
from diffpipe_jax import family as family_lib, schema, train, validate
from diffpipe_jax.configs import common
from diffpipe_jax.errors import UserError
from diffpipe_jax.rules import Rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # relative paths (the tiny default's) resolve here


def problems(name, overrides):
  """`validate.check`'s lines for the family's tiny config with `overrides` applied."""
  # as a config file of the user's writes them: any type (overrides keep a key's type)
  config = ml_collections.ConfigDict(family_config(name).to_dict(), type_safe=False)
  for key, value in overrides.items():
    *sections, leaf = key.split(".")
    section = config
    for s in sections:
      section = section[s]
    section[leaf] = value
  try:
    validate.check(config, family_lib.get(name))
  except UserError as e:
    return str(e).splitlines()
  return []


@pytest.mark.parametrize("name", FAMILIES)
def test_the_schema_declares_every_key_of_every_config_once(name):
  """The config is built from the schema, key for key; every key of every variant is declared
  (a pattern's keys too: an eval set's, the dataset keys media.py checks) and passes its rule;
  and every declaration is of a key some config has."""
  keys = schema.keys(family_lib.get(name))
  assert set(validate.flatten(common.base(name))) == {k for k in keys if "*" not in k}
  flat = {}
  for variant in ("", "tiny"):
    config = family_config(name, variant)
    assert validate.value_problems(validate.flatten(config), keys) == []
    flat.update(validate.flatten(config))
  assert validate.combination_problems(config) == []  # the tiny variant's
  unused = [k for k in keys if not any(fnmatch.fnmatchcase(f, k) for f in flat)]
  assert unused == [], f"keys no config has: {unused}"


@pytest.mark.parametrize("name", FAMILIES)
def test_every_key_has_a_rule_and_a_doc(name):
  """... and diffusion-pipe's default, where it has its own, differs from ours and passes the
  rule."""
  for key_name, key in schema.keys(family_lib.get(name)).items():
    assert isinstance(key.rule, Rule) and key.doc.strip(), key_name
    theirs = key.diffusion_pipe and key.diffusion_pipe.default
    if theirs is not None:
      assert theirs != key.default and key.rule.ok(theirs), key_name


BAD = [  # (key, value, what the line says)
    ("save_dtype", "fp16", "save_dtype='fp16': must be one of 'float32', 'bfloat16', 'float16'"),
    ("checkpoints_to_keep", 0, "checkpoints_to_keep=0: must be an integer >= 1"),
    ("adapter.rank", 0, "adapter.rank=0: must be an integer >= 1"),
    ("adapter.rank", -2, "adapter.rank=-2: must be an integer >= 1"),
    ("adapter.rank", 4.5, "adapter.rank=4.5: must be an integer >= 1"),
    ("micro_batch_size_per_gpu", 0, "micro_batch_size_per_gpu=0: must be an integer >= 1"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0: must be an integer >= 1"),
    ("optimizer.lr", -1.0, "optimizer.lr=-1.0: must be a number > 0"),
    ("optimizer.lr", float("nan"), "optimizer.lr=nan: must be a number > 0"),
    ("optimizer.betas", (0.9, 1.5), "optimizer.betas=(0.9, 1.5): must be a list of 2 values, each a number >= 0 and < 1"),
    ("epochs", 0, "epochs=0: must be an integer >= 1"),
    ("lr_scheduler", "cosin", "lr_scheduler='cosin': must be one of 'constant', 'linear', 'cosine'"),
    ("model.dtype", "bf16", "model.dtype='bf16': must be one of 'float32', 'bfloat16', 'float16'"),
    ("model.transformer_dtype", "fp8", "model.transformer_dtype='fp8': must be one of '', 'float8'"),
    ("model.shift", 0.0, "model.shift=0.0: must be a number > 0"),
    ("adapter.dropout", 1.0, "adapter.dropout=1.0: must be a number >= 0 and < 1"),
    ("activation_checkpointing", "blok", "activation_checkpointing='blok': must be one of"),
    ("unrolled", "yes", "unrolled='yes': must be True, False or None"),
    ("dataset.resolutions", (512, 0), "dataset.resolutions=(512, 0): must be a list of values, each an integer >= 1"),
    ("optimizer.lrr", 1e-3, "optimizer.lrr: unknown key"),  # a typo in a config file
]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("key,value,line", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_bad_value_is_one_line_naming_key_value_and_what_is_allowed(name, key, value, line):
  (found,) = problems(name, {key: value})
  assert found.startswith(line), found


@pytest.mark.parametrize("name", FAMILIES)
def test_every_problem_is_reported_at_once(name):
  found = problems(name, {"epochs": 0, "adapter.rank": 0, "save_dtype": "fp16"})
  assert found[0] == "3 problems in the config:" and len(found) == 4, found


COMBINATIONS_AND_FILES = [
    ({"pipeline_stages": 2, "unrolled": True}, "set unrolled=False"),
    ({"pipeline_stages": 2, "blocks_to_swap": 2}, "blocks_to_swap"),
    ({"dataset.toml_path": "d.toml"}, "the TOML lists the directories; set only one"),
    # a mistyped path of the tiny variant is an error, not a place for synthetic images
    ({"dataset.path": "runs/tiny/imagez"}, "'runs/tiny/imagez' does not exist"),
    ({"eval_datasets.tiny_eval.path": "evalz"}, "eval_datasets.tiny_eval.path='evalz': no such directory"),
    ({"adapter.init_from_existing": "lora.safetensors"}, "adapter.init_from_existing='lora.safetensors': no such file"),
    ({"generate_tiny": False}, ": no such file or directory"),  # the model path, no longer generated
    ({"dataset.path": "", "dataset.toml_path": "dataset.toml"}, "dataset.toml: no such file"),
]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("overrides,line", COMBINATIONS_AND_FILES, ids=[str(o) for o, _ in COMBINATIONS_AND_FILES])
def test_combinations_and_paths_are_checked(name, overrides, line):
  found = problems(name, overrides)
  assert any(line in f for f in found), found


def test_an_output_dir_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
  """Before anything is cached or loaded (the run directory is made only after both)."""
  readonly, file = tmp_path / "readonly", tmp_path / "file"
  readonly.mkdir(mode=0o555)
  file.write_text("")
  if os.access(readonly, os.W_OK):  # root: only a read-only filesystem refuses it; be one
    monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) != str(readonly))
  assert problems(FAMILIES[0], {"output_dir": str(readonly / "runs")}) == [
      f"output_dir='{readonly}/runs': {readonly} is not writable (a read-only filesystem or folder); "
      "set output_dir to a folder you can write"]
  assert problems(FAMILIES[0], {"output_dir": "file/runs"}) == [
      f"output_dir='file/runs': {file} is a file; set output_dir to a folder you can write"]


def test_a_run_stops_on_a_bad_value_before_writing_anything(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = family_config(FAMILIES[0])
  config.update_from_flattened_dict({"adapter.rank": 0, "dataset.path": "imagez"})
  with pytest.raises(UserError, match=r"^adapter.rank=0: must be an integer >= 1$"):
    train.run(config)
  assert os.listdir(tmp_path) == []  # no tiny model, no images (imagez is not a tiny default)


def test_unrolled_by_default_where_it_is_faster():
  """`unrolled` unset (the released configs): the blocks unrolled on one stage without remat or
  with swapped blocks, scanned with per-block remat and for a pipeline;
  set, as set (refused where it cannot be)."""
  from diffpipe_jax import runtime
  assert family_config("flux", "").unrolled is None
  assert runtime.unrolled_or_default(None, "none", pipelined=False, swapped=False)
  assert runtime.unrolled_or_default(None, "block", pipelined=False, swapped=True)
  assert not runtime.unrolled_or_default(None, "block", pipelined=False, swapped=False)
  assert not runtime.unrolled_or_default(None, "block_save_dots", pipelined=False, swapped=False)
  assert not runtime.unrolled_or_default(None, "none", pipelined=True, swapped=False)
  assert runtime.unrolled_or_default(None, "block_offload", pipelined=False, swapped=True)
  assert not runtime.unrolled_or_default(None, "block_offload", pipelined=False, swapped=False)
  assert runtime.unrolled_or_default(True, "block", pipelined=False, swapped=False)
  assert not runtime.unrolled_or_default(False, "none", pipelined=False, swapped=False)
  for overrides, unrolled in ((dict(pipeline_stages=2), False), (dict(blocks_to_swap=2), True),
                              (dict(activation_checkpointing="block_offload"), False),
                              (dict(activation_checkpointing="none"), True)):
    config = family_config("flux", "")
    config.update_from_flattened_dict({"dataset.path": "images", **overrides})
    assert runtime.unrolled_for(config) == unrolled  # what a run of this config does
    assert validate.combination_problems(config) == []
  config.update_from_flattened_dict({"unrolled": True, "pipeline_stages": 2})
  with pytest.raises(UserError, match="set unrolled=False"):
    runtime.unrolled_for(config)
  config.update_from_flattened_dict({"unrolled": False, "pipeline_stages": 1, "blocks_to_swap": 2,
                                     "activation_checkpointing": "block_offload"})
  with pytest.raises(UserError, match="set unrolled=True or leave it unset"):
    runtime.unrolled_for(config)
