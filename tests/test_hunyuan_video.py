"""HunyuanVideo: the transformer against diffusers' `HunyuanVideoTransformer3DModel` from every
format (diffusers folder, Tencent's `.pt` and its folder, ComfyUI's files, a float8 file), its
conversion table against diffusers' own, and the inputs it refuses."""
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import diffusers_hidden_size
from tolerances import assert_close, rel_err
from test_models import torch_forward
from diffpipe_jax import models, tiny
from diffpipe_jax.convert import CheckpointError
from diffpipe_jax.convert.tensorfile import write_safetensors
from diffpipe_jax.encoders import hunyuan_video as hv_torch
from diffpipe_jax.models import hunyuan_video as hv

FORMATS = ("diffusers", "official", "official_folder", "single_file", "single_file_prefixed")


@pytest.fixture(scope="module")
def checkpoint(tiny_models):
  return tiny_models("hunyuan-video")


@pytest.fixture(scope="module")
def loaded(checkpoint):
  formats = dict(checkpoint["formats"])
  formats["official_folder"] = os.path.dirname(os.path.dirname(formats["official"]))
  return {format: models.load("hunyuan-video", formats[format], progress=False) for format in FORMATS}


@pytest.mark.parametrize("batch,grid,txt_len", [(1, (1, 2, 2), 5), (2, (3, 1, 3), 7),
                                                 (2, (2, 3, 1), 1)])
def test_parity_with_diffusers(checkpoint, loaded, batch, grid, txt_len):
  """Several latent grids (one frame, odd sides), padded prompts, from every format."""
  inputs = hv.random_inputs(loaded["diffusers"].config, batch, *grid, txt_len=txt_len,
                            seed=batch * 10 + txt_len)
  ref = torch_forward(checkpoint["torch"], inputs)
  for format, model in loaded.items():
    out = model(**inputs)
    assert out.shape == ref.shape
    assert_close(out, ref, what=format)
  assert len({m.config for m in loaded.values()}) == 1


def test_the_padding_mask_matters(checkpoint, loaded):
  inputs = hv.random_inputs(loaded["diffusers"].config, 2, 1, 2, 2, txt_len=6, seed=1)
  inputs["encoder_attention_mask"][:, 3:] = 0
  ref = torch_forward(checkpoint["torch"], inputs)
  assert_close(loaded["diffusers"](**inputs), ref)
  unmasked = dict(inputs, encoder_attention_mask=np.ones_like(inputs["encoder_attention_mask"]))
  assert rel_err(loaded["diffusers"](**unmasked), ref) > 1e-3


def test_rope_axes_of_an_official_file_default_or_are_passed(tmp_path):
  """Tencent's file holds no config: its RoPE axes are the released proportions unless passed."""
  model = hv_torch.build_tiny(seed=3, rope_axes_dim=(8, 12, 12))
  path = hv_torch.save_official_transformer(model, str(tmp_path))
  inputs = hv.random_inputs(hv.config_from_diffusers(dict(model.config)), 1, 2, 2, 2, seed=2)
  ref = torch_forward(model, inputs)
  passed = models.load("hunyuan-video", path, axes_dims_rope=(8, 12, 12), progress=False)
  assert passed.config.rope_axes_dim == (8, 12, 12)
  assert_close(passed(**inputs), ref)
  default = models.load("hunyuan-video", path, progress=False)
  assert default.config.rope_axes_dim == (4, 14, 14) and rel_err(default(**inputs), ref) > 1e-3
  odd = hv_torch.build_tiny(seed=3, attention_head_dim=12, rope_axes_dim=(4, 4, 4))
  with pytest.raises(ValueError, match="cannot derive the RoPE axes for head_dim=12; pass axes_dims_rope"):
    models.load("hunyuan-video", hv_torch.save_official_transformer(odd, str(tmp_path / "odd")))


def test_table_is_diffusers_conversion(checkpoint):
  """diffusers -> Tencent through our table, then diffusers' own conversion back (its hard-coded
  width patched, `diffusers_hidden_size`), reproduces every tensor."""
  sd = tiny.state_dict_numpy(checkpoint["torch"])
  tencent = hv.tencent_tensors(sd)
  assert {"double_blocks.1.img_attn_qkv.weight", "single_blocks.2.linear1.bias",
          "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight",
          "final_layer.adaLN_modulation.1.weight", "img_in.proj.weight"} <= set(tencent)
  from diffusers.loaders import single_file_utils
  with diffusers_hidden_size(checkpoint["torch"].config.num_attention_heads
                             * checkpoint["torch"].config.attention_head_dim):
    back = single_file_utils.convert_hunyuan_video_transformer_to_diffusers(
        {k: torch.from_numpy(v) for k, v in tencent.items()})
  assert set(back) == set(sd)
  for key, value in back.items():
    np.testing.assert_array_equal(value.numpy(), sd[key])


def test_a_float8_file_loads_as_the_float8_base(checkpoint, tmp_path):
  """ComfyUI's fp8_e4m3fn file: the blocks' Linears keep the file's float8 values (scale 1),
  with no high-precision copy; the rest is bf16 in the file and float32 here."""
  tencent = hv.tencent_tensors(tiny.state_dict_numpy(checkpoint["torch"]))
  is_block_linear = lambda k: k.startswith(("double_blocks.", "single_blocks.")) and k.endswith(
      ".weight") and tencent[k].ndim == 2
  stored = {k: v.astype(ml_dtypes.float8_e4m3fn if is_block_linear(k) else ml_dtypes.bfloat16)
            for k, v in tencent.items()}
  path = str(tmp_path / "hunyuan_video_fp8_e4m3fn.safetensors")
  write_safetensors(stored, path)
  model = models.load("hunyuan-video", path, transformer_dtype="float8", progress=False)
  qkv = model.params["double_blocks"]["img_attn_qkv"]
  assert qkv["kernel"].dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(qkv["kernel"][1]).T.view(np.uint8),
                                stored["double_blocks.1.img_attn_qkv.weight"].view(np.uint8))
  np.testing.assert_array_equal(qkv["kernel_scale"], 1.0)
  # against diffusers on the file's own weights (float8 upcast): float8 activations cost percent
  ref_model = hv_torch.build_tiny()
  ref_model.load_state_dict(checkpoint["torch"].state_dict())
  back = {k: v.astype(np.float32) for k, v in stored.items()}
  with diffusers_hidden_size(ref_model.config.num_attention_heads * ref_model.config.attention_head_dim):
    from diffusers.loaders import single_file_utils
    ref_model.load_state_dict(single_file_utils.convert_hunyuan_video_transformer_to_diffusers(
        {k: torch.from_numpy(v) for k, v in back.items()}))
  inputs = hv.random_inputs(model.config, 1, 2, 2, 2, seed=4)
  assert rel_err(model(**inputs), torch_forward(ref_model.eval(), inputs)) < 0.1
  # without float8 storage the file is upcast to the compute dtype
  upcast = models.load("hunyuan-video", path, progress=False)
  assert upcast.params["double_blocks"]["img_attn_qkv"]["kernel"].dtype == jnp.float32


def test_inputs_are_checked(loaded):
  model = loaded["diffusers"]
  inputs = hv.random_inputs(model.config, 2, 1, 2, 2, txt_len=4, seed=0)
  left_padded = dict(inputs, encoder_attention_mask=np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.float32))
  with pytest.raises(ValueError, match="right padding"):
    model(**left_padded)
  with pytest.raises(ValueError, match="pass `guidance`"):
    model(**dict(inputs, guidance=None))
  with pytest.raises(ValueError, match="multiples of the patch"):
    model(**dict(inputs, hidden_states=inputs["hidden_states"][..., :3]))
  with pytest.raises(TypeError, match="missing \\['pooled_projections'\\]"):
    model(**{k: v for k, v in inputs.items() if k != "pooled_projections"})


def test_a_truncated_official_file_is_one_error(checkpoint, tmp_path):
  data = open(checkpoint["formats"]["official"], "rb").read()
  path = tmp_path / "mp_rank_00_model_states.pt"
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match="is not a readable torch checkpoint"):
    models.load("hunyuan-video", str(path))
