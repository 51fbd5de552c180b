"""LoRA adapters: targets as data, and an export that diffusers loads and applies exactly as we do."""
import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from diffpipe_jax import lora, models
from diffpipe_jax.convert import CheckpointError
from diffpipe_jax.models import flux

INPUTS = dict(batch=2, height=3, width=4, txt_len=5)


def rel_err(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def randomised(adapter, seed=0):
  """An adapter with non-zero B, standing in for a trained one."""
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def dev(flux_checkpoints):
  return flux_checkpoints["dev"]["torch"], models.load("flux", flux_checkpoints["dev"]["diffusers"], progress=False)


def test_default_targets_cover_every_block_linear(dev):
  _, model = dev
  targets = lora.select_targets(model.params, flux.LORA_TARGETS)
  assert "transformer_blocks.attn.to_out.0" in targets and "transformer_blocks.norm1_context.linear" in targets
  assert "single_transformer_blocks.proj_mlp" in targets and "single_transformer_blocks.norm.linear" in targets
  assert not any(t.startswith(("x_embedder", "proj_out", "norm_out", "time_text")) for t in targets)
  assert len(targets) == 14 + 6  # double: 2 mod + 6 qkv + 2 out + 4 ff; single: mod + qkv + mlp + out
  with pytest.raises(ValueError, match=r"\['transformer_blocks\\\\.attn\\\\.to_qq'\] match no Linear"):
    lora.select_targets(model.params, [r"transformer_blocks\.attn\.to_qq"])


def test_zero_b_leaves_the_model_unchanged(dev):
  _, model = dev
  adapter = lora.init(model.params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
  inputs = flux.random_inputs(model.config, **INPUTS)
  with_lora = model.module.apply({"params": model.params, "lora": adapter}, **inputs)
  assert rel_err(with_lora, np.asarray(model(**inputs))) < 1e-6


def test_export_loads_in_diffusers_and_matches(dev, tmp_path):
  torch_model, model = dev
  adapter = randomised(lora.init(model.params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0)))
  inputs = flux.random_inputs(model.config, **INPUTS)
  ours = np.asarray(model.module.apply({"params": model.params, "lora": adapter}, **inputs))
  path = lora.save(adapter, str(tmp_path / "epoch1"), flux.STACKED, flux.LORA_PREFIX, 4, np.float32)
  assert sorted(os.listdir(tmp_path)) == ["epoch1"]  # nothing temporary left behind
  config = json.load(open(tmp_path / "epoch1" / "adapter_config.json"))
  assert config["r"] == config["lora_alpha"] == 4 and config["peft_type"] == "LORA"

  from safetensors import safe_open
  with safe_open(path, "np") as f:
    keys = set(f.keys())
    assert f.metadata() == {"format": "pt"}
  assert "transformer.transformer_blocks.1.attn.to_out.0.lora_B.weight" in keys
  assert not any(k.endswith(".alpha") for k in keys)

  t = copy.deepcopy(torch_model)
  with torch.no_grad():
    before = t(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)[0].numpy()
  t.load_lora_adapter(path, prefix="transformer", adapter_name="ours")
  loaded = {n for n, m in t.named_modules() if hasattr(m, "lora_A") and "ours" in m.lora_A}
  assert {f"transformer.{n}" for n in loaded} == {k.rsplit(".lora_", 1)[0] for k in keys}
  with torch.no_grad():
    after = t(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)[0].numpy()
  assert rel_err(after, before) > 1e-2  # the adapter really changed the torch model
  assert rel_err(ours, after) < 1e-4

  # and our own import reads it back exactly
  back = lora.load(str(tmp_path / "epoch1"), adapter, flux.STACKED, flux.LORA_PREFIX)
  jax.tree.map(np.testing.assert_array_equal, back, adapter)


def test_import_rejects_a_mismatched_adapter(dev, tmp_path):
  _, model = dev
  a4 = lora.init(model.params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
  a8 = lora.init(model.params, flux.LORA_TARGETS, 8, jnp.float32, jax.random.key(0))
  lora.save(a4, str(tmp_path / "r4"), flux.STACKED, flux.LORA_PREFIX, 4, np.float32)
  with pytest.raises(CheckpointError, match="rank and targets must be the same"):
    lora.load(str(tmp_path / "r4"), a8, flux.STACKED, flux.LORA_PREFIX)
