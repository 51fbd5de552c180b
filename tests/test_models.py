"""Every family (its tiny model, `conftest.tiny_model`): loading from each of its formats gives
diffusers' forward, one leaf at a time; bad checkpoints are one clear error; and the family
record is complete while generic code never names a family."""
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
import torch

from conftest import FAMILIES
from tolerances import assert_close
from diffpipe_jax import convert, family as family_lib, models
from diffpipe_jax.convert import CheckpointError, table
from diffpipe_jax.convert.tensorfile import TensorFiles, write_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERIC = ("main.py", "diffpipe_jax/train.py", "diffpipe_jax/data.py", "diffpipe_jax/cache.py",
           "diffpipe_jax/lora.py", "diffpipe_jax/checkpoint.py", "diffpipe_jax/sharding/__init__.py",
           "diffpipe_jax/axes.py",
           "diffpipe_jax/sharding/pipeline.py", "diffpipe_jax/stacks.py", "diffpipe_jax/runtime.py",
           "diffpipe_jax/programs.py",
           "diffpipe_jax/flow.py", "diffpipe_jax/optim.py", "diffpipe_jax/models/__init__.py",
           "diffpipe_jax/convert/loader.py", "diffpipe_jax/encoders/__init__.py",
           "diffpipe_jax/sample.py", "diffpipe_jax/sampling.py", "sample.py", "diffpipe_jax/loop.py",
           "diffpipe_jax/cli.py", "diffpipe_jax/configs/common.py", "diffpipe_jax/schema.py",
           "diffpipe_jax/validate.py", "diffpipe_jax/rules.py",
           "diffpipe_jax/__main__.py")


def torch_forward(model, inputs):
  with torch.no_grad():
    return model(**{k: None if v is None else torch.from_numpy(v) for k, v in inputs.items()},
                 return_dict=False)[0].numpy()


def test_every_format_loads_and_matches_diffusers(tiny_model):
  fam, formats = tiny_model["family"], tiny_model["formats"]
  assert "diffusers" in formats and (fam.single_file is None) == ("single_file" not in formats)
  sharded = os.path.join(formats["diffusers_sharded"], "transformer")
  assert any(f.endswith(".index.json") for f in os.listdir(sharded))  # the shards are tested
  configs = set()
  for format, path in formats.items():
    model = models.load(fam.type, path, progress=False)
    inputs = fam.random_inputs(model.config, batch=2, seed=3)
    ref = torch_forward(tiny_model["torch"], inputs)
    assert_close(model(**inputs), ref, what=format)
    configs.add(model.config)
  assert len(configs) == 1, configs  # every format tells the same sizes


def test_loading_holds_the_stored_leaves_and_one_more(tiny_model):
  """Leaves come largest first, and when each is handed on (to float8 storage, say) nothing else
  is in flight: its torch-order copy is gone once it is transposed."""
  fam = tiny_model["family"]
  checkpoint = convert.open_checkpoint(fam, tiny_model["formats"]["diffusers"])
  abstract = models.abstract_params(fam, fam.make_module(checkpoint.config), checkpoint.config)
  live = lambda: sum(a.nbytes for a in jax.live_arrays())
  before, stored = live(), []

  def finalize(path, value):
    assert live() - before == sum(stored) + value.nbytes, path
    stored.append(value.nbytes)
    return {path: value}
  convert.load_params(abstract, fam, checkpoint, np.float32, finalize=finalize, progress=False)
  assert stored == sorted(stored, reverse=True) and len(stored) == len(table.flatten(abstract))


# ---- bad checkpoints ----------------------------------------------------------------------------


def test_wrong_model_folder(tiny_model, tmp_path):
  fam = tiny_model["family"]
  (tmp_path / "transformer").mkdir()
  (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "SomeOtherModel"}))
  with pytest.raises(CheckpointError, match=f"SomeOtherModel, not a {fam.diffusers_class}"):
    models.load(fam.type, str(tmp_path))


def test_wrong_model_single_file(tiny_model, tmp_path):
  fam = tiny_model["family"]
  path = str(tmp_path / "vae.safetensors")
  write_safetensors({"encoder.conv_in.weight": np.zeros((4, 3, 3, 3), np.float32)}, path)
  want = f"not a {fam.diffusers_class} single file.*encoder.conv_in" if fam.single_file else "diffusers folder only"
  with pytest.raises(CheckpointError, match=want):
    models.load(fam.type, path)


def copied_folder(formats, root):
  """A copy of the diffusers folder at `root` to break, and its transformer's weights file."""
  shutil.copytree(formats["diffusers"], root)
  return root, root / "transformer" / "diffusion_pytorch_model.safetensors"


def test_truncated_file(tiny_model, tmp_path):
  """A cut download, in a diffusers folder or as a single file: one error that says so; a file
  of another format (a torch zip archive) is not called truncated."""
  fam, formats = tiny_model["family"], tiny_model["formats"]
  folder, weights = copied_folder(formats, tmp_path / "folder")
  cases = {str(folder): (weights, weights.read_bytes())}
  if "single_file" in formats:
    cases[str(tmp_path / "cut.safetensors")] = (tmp_path / "cut.safetensors",
                                                open(formats["single_file"], "rb").read())
  for path, (target, data) in cases.items():
    target.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
      models.load(fam.type, path)
    target.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="is truncated: its header claims"):
      models.load(fam.type, path)
    target.write_bytes(b"PK\x03\x04\x14\x00\x00\x08" + data[8:])
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
      models.load(fam.type, path)


def test_missing_unexpected_and_misshaped_keys(tiny_model, tmp_path):
  fam, formats = tiny_model["family"], tiny_model["formats"]
  root, weights = copied_folder(formats, tmp_path / "p")
  files = TensorFiles([str(weights)])
  tensors = {k: np.array(files[k]) for k in files.keys()}
  # a tensor of a stacked block (`<stack>.1.`), and a bias outside every block
  stacked = sorted(k for k in tensors if k.split(".")[1:2] == ["1"])[0]
  bias = sorted(k for k in tensors if k.endswith(".bias") and not re.search(r"\.\d+\.", k))[0]
  del tensors[stacked]
  tensors["lora_unet_something.weight"] = np.zeros(3, np.float32)
  want_bias = tensors[bias].shape
  tensors[bias] = np.zeros(5, np.float32)
  del files
  write_safetensors(tensors, str(weights))
  with pytest.raises(CheckpointError) as e:
    models.load(fam.type, str(root))
  msg = str(e.value)
  assert f"missing (1): {stacked}" in msg
  assert "unexpected (1): lora_unet_something.weight" in msg
  assert f"mis-shaped (1): {bias}: file (5,), model {want_bias}" in msg


def test_diffusers_config_that_does_not_match_weights(tiny_model, tmp_path):
  fam, formats = tiny_model["family"], tiny_model["formats"]
  root, _ = copied_folder(formats, tmp_path / "p")
  cfg_path = root / "transformer" / "config.json"
  cfg = json.loads(cfg_path.read_text())
  # one more block in the first stack: its config key is the one that holds its depth
  name, length, _ = fam.stacks(fam.config_from_diffusers(cfg))[0]
  depth_key = next(k for k, v in cfg.items() if v == length and re.fullmatch(r"num_\w*layers", k))
  cfg[depth_key] = length + 1
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=rf"missing \(\d+\): [\w.]*\.{length}\."):
    models.load(fam.type, str(root))


def test_missing_path_and_empty_folder(tmp_path):
  for name in FAMILIES:
    with pytest.raises(CheckpointError, match="not found"):
      models.load(name, str(tmp_path / "nope.safetensors"))
    with pytest.raises(CheckpointError, match="transformer/config.json"):
      models.load(name, str(tmp_path))
  with pytest.raises(ValueError, match="unknown model type 'fluxx'"):
    models.load("fluxx", str(tmp_path))


# ---- the family record --------------------------------------------------------------------------


def test_a_family_record_is_complete_or_fails_at_import(tiny_model):
  fam = tiny_model["family"]
  assert fam.type in family_lib.names() and family_lib.get(fam.type) is fam
  assert tuple(name for name, _, _ in fam.stacks(tiny_model_config(tiny_model))) == fam.stacked
  with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'torch_side'"):
    family_lib.Family(**{f: getattr(fam, f) for f in fam.__dataclass_fields__ if f != "torch_side"})
  side = family_lib.torch_side(fam)
  assert isinstance(side, family_lib.TorchSide)


def tiny_model_config(tiny_model):
  return models.checkpoint_config(tiny_model["family"].type, tiny_model["formats"]["diffusers"])


def test_generic_modules_name_no_family():
  """What differs per family is on its record: the generic modules never name one, nor a
  family's own field (Flux's pooled embedding, image ids, shift). (Guidance is every sampler's:
  `Family.sampling` says how it enters the family's model.)"""
  names = [n for fam in FAMILIES for n in (fam, fam.replace("-", "_"))] + [
      "ltx", "hunyuan", "pooled", "img_ids", "flux_shift"]
  pattern = re.compile("|".join(map(re.escape, names)), re.IGNORECASE)
  # a citation of a measurement (BENCHMARKS.md's anchors are per family) names none in code, nor
  # do the words that begin with Wan's name (want, wandb)
  cited = lambda line: re.sub(r"BENCHMARKS\.md#[\w-]+|wan[a-z]+", "", line, flags=re.IGNORECASE)
  found = [f"{path}:{n + 1}: {line.strip()}" for path in GENERIC
           for n, line in enumerate(open(os.path.join(ROOT, path))) if pattern.search(cited(line))]
  assert not found, "\n".join(found)
