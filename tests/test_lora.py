"""LoRA adapters of every family: targets as data, and an export that diffusers loads and applies
exactly as we do."""
import copy
import errno
import json
import os
import re

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from diffpipe_jax import family as family_lib, lora, models
from conftest import diffusers_modules, load_lora_in_diffusers
from diffpipe_jax.convert import CheckpointError

INPUTS = dict(batch=2, seed=5)


def rel_err(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def randomised(adapter, seed=0):
  """An adapter with non-zero B, standing in for a trained one."""
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.fixture
def loaded(tiny_model):
  """(family, its tiny torch model, ours loaded from its diffusers layout)."""
  fam = tiny_model["family"]
  return fam, tiny_model["torch"], models.load(fam.type, tiny_model["layouts"]["diffusers"], progress=False)


def test_a_target_that_matches_nothing_is_an_error(loaded):
  _, _, model = loaded
  with pytest.raises(ValueError, match=r"\['nothing\\\\.to_qq'\] match no Linear"):
    lora.select_targets(model.params, [r"nothing\.to_qq"])


def test_zero_b_leaves_the_model_unchanged(loaded):
  fam, _, model = loaded
  adapter = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  inputs = fam.random_inputs(model.config, **INPUTS)
  with_lora = model.module.apply({"params": model.params, "lora": adapter}, **inputs)
  assert rel_err(with_lora, np.asarray(model(**inputs))) < 1e-6


def test_export_loads_in_diffusers_and_matches(loaded, tmp_path):
  fam, torch_model, model = loaded
  adapter = randomised(lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0)))
  inputs = fam.random_inputs(model.config, **INPUTS)
  ours = np.asarray(model.module.apply({"params": model.params, "lora": adapter}, **inputs))
  path = lora.save(adapter, str(tmp_path / "epoch1"), fam, 4, np.float32)
  assert sorted(os.listdir(tmp_path)) == ["epoch1"]  # nothing temporary left behind
  config = json.load(open(tmp_path / "epoch1" / "adapter_config.json"))
  assert config["r"] == config["lora_alpha"] == 4 and config["peft_type"] == "LORA"

  from safetensors import safe_open
  with safe_open(path, "np") as f:
    keys = set(f.keys())
    assert f.metadata() == {"format": "pt"}
  assert all(k.startswith(fam.lora_prefix) for k in keys)
  assert not any(k.endswith(".alpha") for k in keys)

  t = copy.deepcopy(torch_model)
  torch_inputs = {k: None if v is None else torch.from_numpy(v) for k, v in inputs.items()}
  with torch.no_grad():
    before = t(**torch_inputs, return_dict=False)[0].numpy()
  # loaded as a user does, by the pipeline (its key conversions included)
  adapted = load_lora_in_diffusers(fam, t, path, "ours")
  assert adapted == diffusers_modules(fam, {k[len(fam.lora_prefix):].rsplit(".lora_", 1)[0] for k in keys})
  with torch.no_grad():
    after = t(**torch_inputs, return_dict=False)[0].numpy()
  assert rel_err(after, before) > 1e-2  # the adapter really changed the torch model
  assert rel_err(ours, after) < 1e-4

  # and our own import reads it back exactly
  back = lora.load(str(tmp_path / "epoch1"), adapter, fam)
  jax.tree.map(np.testing.assert_array_equal, back, adapter)


def test_import_rejects_a_mismatched_adapter(loaded, tmp_path):
  fam, _, model = loaded
  a4 = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  a8 = lora.init(model.params, fam.lora_targets, 8, jnp.float32, jax.random.key(0))
  lora.save(a4, str(tmp_path / "r4"), fam, 4, np.float32)
  with pytest.raises(CheckpointError, match=r"has rank 4, this adapter rank 8: set adapter.rank=4"):
    lora.load(str(tmp_path / "r4"), a8, fam)
  one_module = re.escape(lora.select_targets(model.params, fam.lora_targets)[0])
  fewer = lora.init(model.params, [one_module], 4, jnp.float32, jax.random.key(0))
  with pytest.raises(CheckpointError, match=r"does not match this adapter's targets \(\d+ differences: unexpected "):
    lora.load(str(tmp_path / "r4"), fewer, fam)


def test_a_failed_export_leaves_nothing_half_written(loaded, tmp_path, monkeypatch):
  fam, _, model = loaded
  adapter = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  lora.save(adapter, str(tmp_path / "epoch1"), fam, 4, np.float32)

  def full_disk(tensors, path, metadata=None):
    open(path, "wb").write(b"half")
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(lora, "write_safetensors", full_disk)
  with pytest.raises(OSError):
    lora.save(adapter, str(tmp_path / "epoch2"), fam, 4, np.float32)
  assert sorted(os.listdir(tmp_path)) == ["epoch1"]  # no epoch2.tmp/
