"""The Flax Flux transformer against diffusers' FluxTransformer2DModel, from every on-disk layout."""
import copy
import json
import shutil

import numpy as np
import pytest
import torch

from diffpipe_jax import convert, models, tiny
from diffpipe_jax.convert import CheckpointError, table
from diffpipe_jax.models import flux

LAYOUTS = ("diffusers", "diffusers_sharded", "bfl", "bfl_prefixed")
DEV = flux.config_from_diffusers(tiny.TINY_FLUX)


def flux_inputs(batch, h, w, txt_len, guidance, seed=0):
  inputs = flux.random_inputs(DEV, batch, h, w, txt_len, seed)
  return inputs if guidance else {**inputs, "guidance": None}


def rel_err(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def torch_forward(model, inputs, dtype=torch.float32):
  with torch.no_grad():
    t = {k: None if v is None else torch.from_numpy(v).to(dtype) for k, v in inputs.items()}
    return model.to(dtype)(**t, return_dict=False)[0].float().numpy()


@pytest.fixture(scope="module")
def loaded(flux_checkpoints):
  return {(variant, layout): models.load("flux", ckpts[layout], progress=False)
          for variant, ckpts in flux_checkpoints.items() for layout in LAYOUTS}


@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("batch,h,w,txt_len", [(1, 4, 4, 8), (2, 3, 5, 7), (2, 6, 2, 1)])
def test_parity_with_diffusers(flux_checkpoints, loaded, variant, batch, h, w, txt_len):
  inputs = flux_inputs(batch, h, w, txt_len, guidance=variant == "dev", seed=batch * 100 + h)
  ref = torch_forward(flux_checkpoints[variant]["torch"], inputs)
  for layout in LAYOUTS:
    out = loaded[variant, layout](**inputs)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-5, (layout, rel_err(out, ref))


def test_config_from_both_layouts_agree(loaded):
  for variant in ("dev", "schnell"):
    configs = {layout: loaded[variant, layout].config for layout in LAYOUTS}
    assert len(set(configs.values())) == 1, configs
    assert configs["bfl"].guidance_embeds == (variant == "dev")
    assert configs["bfl"].axes_dims_rope == tiny.TINY_FLUX["axes_dims_rope"]


def test_single_file_table_round_trips(flux_checkpoints):
  """diffusers -> BFL -> diffusers through the table reproduces every tensor exactly."""
  model = flux_checkpoints["dev"]["torch"]
  sd = tiny.state_dict_numpy(model)
  single = table.to_single_file(sd, flux.SINGLE_FILE_TABLE)
  assert "double_blocks.0.img_attn.qkv.weight" in single and "single_blocks.2.linear1.weight" in single
  sources = table.single_file_sources(flux.SINGLE_FILE_TABLE, {k: v.shape for k, v in sd.items()})
  assert set(sources) == set(sd)
  for key, source in sources.items():
    np.testing.assert_array_equal(table.read_tensor(single, source), sd[key])


def test_guidance_input_is_checked(loaded):
  dev_inputs = flux_inputs(1, 2, 2, 3, guidance=True)
  with pytest.raises(ValueError, match="FLUX.1-schnell"):
    loaded["schnell", "bfl"](**dev_inputs)
  with pytest.raises(ValueError, match="pass `guidance`"):
    loaded["dev", "bfl"](**{**dev_inputs, "guidance": None})
  with pytest.raises(TypeError, match="missing"):
    loaded["dev", "bfl"](hidden_states=dev_inputs["hidden_states"])


def test_numpy_in_jax_out(loaded):
  import jax
  out = loaded["dev", "diffusers"](**flux_inputs(1, 2, 3, 2, guidance=True))
  assert isinstance(out, jax.Array) and out.dtype == np.float32


def test_bfloat16_params_and_compute(flux_checkpoints):
  """In bf16 we stay as close to the float32 reference as diffusers' own bf16 forward does."""
  import jax.numpy as jnp
  m = models.load("flux", flux_checkpoints["dev"]["bfl"], dtype=jnp.bfloat16, progress=False)
  assert m.params["transformer_blocks"]["attn"]["to_q"]["kernel"].dtype == jnp.bfloat16
  model = copy.deepcopy(flux_checkpoints["dev"]["torch"])
  for t in (0.001, 0.36, 0.9):
    inputs = {**flux_inputs(1, 4, 4, 5, guidance=True), "timestep": np.array([t], np.float32)}
    ref = torch_forward(model, inputs)
    torch_bf16_err = rel_err(torch_forward(copy.deepcopy(model), inputs, torch.bfloat16), ref)
    assert rel_err(m(**inputs).astype(jnp.float32), ref) <= 1.5 * torch_bf16_err


def test_loading_holds_the_stored_leaves_and_one_more(flux_checkpoints):
  """Leaves come largest first, and when each is handed on (to float8 storage, say) nothing else
  is in flight: its torch-layout copy is gone once it is transposed."""
  import jax
  fam = models.family("flux")
  config, files, rows = convert.open_checkpoint(fam, flux_checkpoints["dev"]["diffusers"])
  abstract = models.abstract_params(fam, fam.make_module(config), config)
  live = lambda: sum(a.nbytes for a in jax.live_arrays())
  before, stored = live(), []

  def finalize(path, value):
    assert live() - before == sum(stored) + value.nbytes, path
    stored.append(value.nbytes)
    return {path: value}
  convert.load_params(abstract, fam, files, rows, np.float32, finalize=finalize, progress=False)
  assert stored == sorted(stored, reverse=True) and len(stored) == len(table.flatten(abstract))


# ---- bad checkpoints ----------------------------------------------------------------------------


def test_wrong_model_folder(tmp_path):
  (tmp_path / "transformer").mkdir()
  (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "LTXVideoTransformer3DModel"}))
  with pytest.raises(CheckpointError, match="LTXVideoTransformer3DModel, not a FluxTransformer2DModel"):
    models.load("flux", str(tmp_path))


def test_wrong_model_single_file(tmp_path):
  path = str(tmp_path / "vae.safetensors")
  from diffpipe_jax.convert.tensorfile import write_safetensors
  write_safetensors({"encoder.conv_in.weight": np.zeros((4, 3, 3, 3), np.float32)}, path)
  with pytest.raises(CheckpointError, match="not a FluxTransformer2DModel single file.*encoder.conv_in"):
    models.load("flux", path)


def test_truncated_file(flux_checkpoints, tmp_path):
  path = tmp_path / "cut.safetensors"
  data = open(flux_checkpoints["dev"]["bfl"], "rb").read()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match="truncated"):
    models.load("flux", str(path))
  path.write_bytes(data[:100])
  with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
    models.load("flux", str(path))


def test_missing_unexpected_and_misshaped_keys(flux_checkpoints, tmp_path):
  from diffpipe_jax.convert.tensorfile import TensorFiles, write_safetensors
  files = TensorFiles([flux_checkpoints["dev"]["bfl"]])
  tensors = {k: np.array(files[k]) for k in files.keys()}
  del tensors["single_blocks.1.linear2.weight"]
  tensors["lora_unet_something.weight"] = np.zeros(3, np.float32)
  tensors["txt_in.bias"] = np.zeros(5, np.float32)
  path = str(tmp_path / "broken.safetensors")
  write_safetensors(tensors, path)
  with pytest.raises(CheckpointError) as e:
    models.load("flux", path)
  msg = str(e.value)
  assert "missing (1): single_blocks.1.linear2.weight" in msg
  assert "unexpected (1): lora_unet_something.weight" in msg
  assert "mis-shaped (1): txt_in.bias: file (5,), model (64,)" in msg


def test_diffusers_config_that_does_not_match_weights(flux_checkpoints, tmp_path):
  root = tmp_path / "p"
  shutil.copytree(flux_checkpoints["dev"]["diffusers"], root)
  cfg_path = root / "transformer" / "config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg["num_layers"] = 3
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="missing .*transformer_blocks.2"):
    models.load("flux", str(root))


def test_missing_path_and_empty_folder(tmp_path):
  with pytest.raises(CheckpointError, match="not found"):
    models.load("flux", str(tmp_path / "nope.safetensors"))
  with pytest.raises(CheckpointError, match="transformer/config.json"):
    models.load("flux", str(tmp_path))
  with pytest.raises(ValueError, match="unknown model type 'fluxx'"):
    models.load("fluxx", str(tmp_path))
