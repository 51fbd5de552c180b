"""LoRA adapters of every family: targets as data, and an export that diffusers loads and applies
exactly as we do."""
import copy
import errno
import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from safetensors.numpy import load_file, save_file

from diffpipe_jax import lora, models, training_step
from conftest import diffusers_modules, family_config, load_lora_in_diffusers
from tolerances import LORA_PARITY, assert_close, rel_err
from diffpipe_jax.convert import CheckpointError, table
from diffpipe_jax.errors import UserError

INPUTS = dict(batch=2, seed=5)


def randomised(adapter, seed=0):
  """An adapter with non-zero B, standing in for a trained one."""
  rng = np.random.default_rng(seed)  # numpy's: no program to compile per shape
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + 0.1 * rng.standard_normal(x.shape, np.float32)),
                      adapter)


@pytest.fixture
def loaded(tiny_model):
  """(family, its tiny torch model, ours loaded from its diffusers folder)."""
  fam = tiny_model["family"]
  return fam, tiny_model["torch"], models.load(fam.type, tiny_model["formats"]["diffusers"], progress=False)


def test_a_target_that_matches_nothing_is_an_error(loaded):
  _, _, model = loaded
  with pytest.raises(ValueError, match=r"\['nothing\\\\.to_qq'\] match no Linear"):
    lora.select_targets(model.params, [r"nothing\.to_qq"])


def test_zero_b_leaves_the_model_unchanged(loaded):
  fam, _, model = loaded
  adapter = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  inputs = fam.random_inputs(model.config, **INPUTS)
  with_lora = model.module.apply({"params": model.params, "lora": adapter}, **inputs)
  assert_close(with_lora, model(**inputs))


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
  assert_close(ours, after, bound=LORA_PARITY)

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


def modules(adapter):
  """The adapter's module names, without block indices."""
  return {".".join(path[:-1]) for path in table.flatten(adapter)}


def test_excluded_modules_get_no_lora_and_are_not_exported(flux, tmp_path):
  fam = flux.family
  config = family_config("flux")
  config.adapter.exclude_modules = ("proj_out", "attn.to_out.0", "ff.net.2")
  adapter = randomised(training_step.init_state(jax.random.key(0), layer_params=flux.params, config=config,
                                         tx=optax.sgd(1.0), family=fam)["lora"])
  every = set(lora.select_targets(flux.params, fam.lora_targets))
  excluded = {"single_transformer_blocks.proj_out", "transformer_blocks.attn.to_out.0",
              "transformer_blocks.ff.net.2"}  # not ff_context.net.2: a whole name's ending only
  assert excluded < every and modules(adapter) == every - excluded
  path = lora.save(adapter, str(tmp_path / "epoch1"), fam, 4, np.float32)
  exported = {k.removeprefix(fam.lora_prefix).rsplit(".lora_", 1)[0] for k in load_file(path)}
  index_free = {re.sub(r"^(transformer_blocks|single_transformer_blocks)\.\d+\.", r"\1.", m) for m in exported}
  assert index_free == every - excluded
  assert json.load(open(tmp_path / "epoch1" / "adapter_config.json"))["target_modules"] == sorted(exported)
  # read back as a run continues it, and as the sampler reads any LoRA
  jax.tree.map(np.testing.assert_array_equal, lora.load(str(tmp_path / "epoch1"), adapter, fam), adapter)
  jax.tree.map(np.testing.assert_array_equal, lora.read(path, flux.params, fam), adapter)


def test_an_exclusion_that_excludes_nothing_is_an_error(flux):
  init = lambda entry: lora.init(flux.params, flux.family.lora_targets, 4, jnp.float32, jax.random.key(0),
                                 exclude=("proj_mlp", entry))
  for entry in ("to_qq", "x_embedder", "attn.to_out"):  # a typo; a Linear without a LoRA; half a name
    with pytest.raises(UserError, match=rf"exclude_modules entry '{entry}' excludes no LoRA target; the "
                                        r"targets are named without block indices, like \['single_"):
      init(entry)
  with pytest.raises(UserError, match=r"entry 'transformer_blocks.3.attn.to_q' names one block's module, and "
                                      r"exclusion per block is not supported: name the module across "
                                      r"blocks, 'transformer_blocks.attn.to_q'"):
    init("transformer_blocks.3.attn.to_q")


def test_a_rank_above_a_targets_smaller_side_is_refused_before_the_weights_load(tiny_models):
  """From the checkpoint's config alone (`train.check_adapter`, before caching and loading), the
  line names the target that bounds the rank, its shape and the largest rank."""
  from diffpipe_jax import train
  tiny, config = tiny_models("flux"), family_config("flux")
  check = lambda: train.check_adapter(config, tiny["family"], tiny["formats"]["diffusers"])
  config.adapter.rank = 100000
  with pytest.raises(UserError, match=r"^adapter.rank=100000: at most 64 for this model, the smaller side "
                                      r"of the LoRA target single_transformer_blocks.attn.to_k \(64 x 64\)$"):
    check()
  config.adapter.rank = 64
  check()


FLUX_PREFIX = "transformer."  # our Flux exports' (diffusers')


def rewritten(path, folder, prefix, extra=()):
  """Our export at `path` as diffusion-pipe writes it: `folder/adapter_model.safetensors`, its
  keys behind `prefix` (+ `extra` tensors), beside the adapter_config.json."""
  os.makedirs(folder)
  tensors = {prefix + k.removeprefix(FLUX_PREFIX): v for k, v in load_file(path).items()}
  save_file({**tensors, **dict(extra)}, os.path.join(folder, "adapter_model.safetensors"),
            metadata={"format": "pt"})
  shutil.copy(os.path.join(os.path.dirname(path), "adapter_config.json"), folder)


def test_a_diffusion_pipe_run_folder_continues_from_its_newest_lora(flux, tmp_path, capsys):
  fam = flux.family
  assert fam.lora_prefix == FLUX_PREFIX
  newest, older = (randomised(lora.init(flux.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0)), seed)
                   for seed in (1, 2))
  for name, adapter in (("epoch12", newest), ("epoch9", older)):  # the newest by number, not by name
    ours = lora.save(adapter, str(tmp_path / "ours" / name), fam, 4, np.float32)
    rewritten(ours, tmp_path / "run" / name, "diffusion_model.")
  (tmp_path / "run" / "global_step40").mkdir()  # not a LoRA
  jax.tree.map(np.testing.assert_array_equal, lora.load(str(tmp_path / "run"), newest, fam), newest)
  assert f"{tmp_path / 'run'}: taking its newest LoRA, epoch12/" in capsys.readouterr().out


def test_a_loras_alpha_is_folded_into_b(flux, tmp_path):
  """A `.alpha` tensor (ComfyUI's) scales its module by alpha / rank, adapter_config.json's
  lora_alpha the others, as PEFT and ComfyUI apply them."""
  fam = flux.family
  adapter = randomised(lora.init(flux.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0)))
  path = lora.save(adapter, str(tmp_path / "ours"), fam, 4, np.float32)
  config = json.load(open(tmp_path / "ours" / "adapter_config.json"))
  json.dump(dict(config, lora_alpha=2), open(tmp_path / "ours" / "adapter_config.json", "w"))
  rewritten(path, tmp_path / "peft", "base_model.model.",
            {"base_model.model.transformer_blocks.1.attn.to_q.alpha": np.array(8.0, np.float32)})
  want = lora.scaled(adapter, 0.5)
  to_q = want["transformer_blocks"]["attn.to_q"]
  to_q["lora_B"] = to_q["lora_B"].at[1].mul(4)  # block 1's: alpha 8, rank 4
  for loaded in (lora.load(str(tmp_path / "peft"), adapter, fam),  # continued, or sampled with
                 lora.read(str(tmp_path / "peft"), flux.params, fam)):
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), loaded, want)
  rank8 = jax.eval_shape(lambda: lora.init(flux.params, fam.lora_targets, 8, jnp.float32, jax.random.key(0)))
  with pytest.raises(CheckpointError, match=r"has rank 4, this adapter rank 8: set adapter.rank=4"):
    lora.load(str(tmp_path / "peft"), rank8, fam)


def test_a_run_folder_must_name_one_lora(tmp_path):
  for folder in ("epoch2", "epoch3", "global_step9"):  # epoch3 holds no LoRA
    (tmp_path / folder).mkdir()
  (tmp_path / "epoch2" / "adapter_model.safetensors").touch()
  assert lora.weights_file(str(tmp_path)) == str(tmp_path / "epoch2" / "adapter_model.safetensors")
  (tmp_path / "step30").mkdir()
  (tmp_path / "step30" / lora.WEIGHTS_NAME).touch()
  with pytest.raises(CheckpointError, match=r"holds LoRAs by epoch and by step \(the newest: epoch2 and "
                                            r"step30\): name the folder to continue from"):
    lora.weights_file(str(tmp_path))
  with pytest.raises(CheckpointError, match=r"holds no LoRA: no pytorch_lora_weights.safetensors or "
                                            r"adapter_model.safetensors, nor epochN/ or stepN/ folders"):
    lora.weights_file(str(tmp_path / "epoch3"))
