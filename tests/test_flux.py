"""FLUX.1: the Flax transformer against diffusers' FluxTransformer2DModel (dev and schnell, several
shapes, every format), its inputs' checks, bf16, its single-file table, and its cache's latents
and embeddings against FluxPipeline's."""
import copy
import os

import numpy as np
import pytest
import torch

import test_cache
import test_data
from conftest import load_encoders, transformers_log
from tolerances import assert_close, rel_err
from diffpipe_jax import cache, data, lora, media, models, tiny
from diffpipe_jax.convert import table
from diffpipe_jax.encoders import flux as flux_torch
from diffpipe_jax.models import flux

FORMATS = ("diffusers", "diffusers_sharded", "single_file", "single_file_prefixed")
DEV = flux.config_from_diffusers(flux_torch.TINY_FLUX)


def flux_inputs(batch, h, w, txt_len, guidance, seed=0):
  inputs = flux.random_inputs(DEV, batch, h, w, txt_len, seed)
  return inputs if guidance else {**inputs, "guidance": None}


def torch_forward(model, inputs, dtype=torch.float32):
  with torch.no_grad():
    t = {k: None if v is None else torch.from_numpy(v).to(dtype) for k, v in inputs.items()}
    return model.to(dtype)(**t, return_dict=False)[0].float().numpy()


@pytest.fixture(scope="module")
def loaded(flux_checkpoints):
  return {(variant, format): models.load("flux", ckpts[format], progress=False)
          for variant, ckpts in flux_checkpoints.items() for format in FORMATS}


@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("batch,h,w,txt_len", [(1, 4, 4, 8), (2, 3, 5, 7), (2, 6, 2, 1)])
def test_parity_with_diffusers(flux_checkpoints, loaded, variant, batch, h, w, txt_len):
  inputs = flux_inputs(batch, h, w, txt_len, guidance=variant == "dev", seed=batch * 100 + h)
  ref = torch_forward(flux_checkpoints[variant]["torch"], inputs)
  for format in FORMATS:
    out = loaded[variant, format](**inputs)
    assert out.shape == ref.shape
    assert_close(out, ref, what=format)
  assert loaded[variant, "single_file"].config == loaded[variant, "diffusers"].config
  assert loaded[variant, "single_file"].config.axes_dims_rope == flux_torch.TINY_FLUX["axes_dims_rope"]


def test_single_file_table_round_trips(flux_checkpoints):
  """diffusers -> BFL -> diffusers through the table reproduces every tensor exactly."""
  model = flux_checkpoints["dev"]["torch"]
  sd = tiny.state_dict_numpy(model)
  single = table.to_single_file(sd, flux.SINGLE_FILE_TABLE)
  assert "double_blocks.0.img_attn.qkv.weight" in single and "single_blocks.2.linear1.weight" in single
  sources = table.row_sources(flux.SINGLE_FILE_TABLE, {k: v.shape for k, v in sd.items()}, "single")
  assert set(sources) == set(sd)
  for key, source in sources.items():
    np.testing.assert_array_equal(table.read_tensor(single, source), sd[key])


def test_guidance_input_is_checked(loaded):
  dev_inputs = flux_inputs(1, 2, 2, 3, guidance=True)
  with pytest.raises(ValueError, match="FLUX.1-schnell"):
    loaded["schnell", "single_file"](**dev_inputs)
  with pytest.raises(ValueError, match="pass `guidance`"):
    loaded["dev", "single_file"](**{**dev_inputs, "guidance": None})
  with pytest.raises(TypeError, match="missing"):
    loaded["dev", "single_file"](hidden_states=dev_inputs["hidden_states"])


def test_numpy_in_jax_out(loaded):
  import jax
  out = loaded["dev", "diffusers"](**flux_inputs(1, 2, 3, 2, guidance=True))
  assert isinstance(out, jax.Array) and out.dtype == np.float32


def test_bfloat16_params_and_compute(flux_checkpoints):
  """In bf16 we stay as close to the float32 reference as diffusers' own bf16 forward does."""
  import jax.numpy as jnp
  m = models.load("flux", flux_checkpoints["dev"]["single_file"], dtype=jnp.bfloat16, progress=False)
  assert m.params["transformer_blocks"]["attn.to_q"]["kernel"].dtype == jnp.bfloat16
  model = copy.deepcopy(flux_checkpoints["dev"]["torch"])
  for t in (0.001, 0.36, 0.9):
    inputs = {**flux_inputs(1, 4, 4, 5, guidance=True), "timestep": np.array([t], np.float32)}
    ref = torch_forward(model, inputs)
    torch_bf16_err = rel_err(torch_forward(copy.deepcopy(model), inputs, torch.bfloat16), ref)
    assert rel_err(m(**inputs).astype(jnp.float32), ref) <= 1.5 * torch_bf16_err


def test_default_lora_targets_cover_every_block_linear(flux_checkpoints):
  model = models.load("flux", flux_checkpoints["dev"]["diffusers"], progress=False)
  targets = lora.select_targets(model.params, flux.LORA_TARGETS)
  assert "transformer_blocks.attn.to_out.0" in targets and "transformer_blocks.norm1_context.linear" in targets
  assert "single_transformer_blocks.proj_mlp" in targets and "single_transformer_blocks.norm.linear" in targets
  assert not any(t.startswith(("x_embedder", "proj_out", "norm_out", "time_text")) for t in targets)
  assert len(targets) == 14 + 6  # double: 2 mod + 6 qkv + 2 out + 4 ff; single: mod + qkv + mlp + out


# ---- the torch side: cached latents and embeddings -----------------------------------------------

FAMILY = "flux"  # (the fixtures of conftest.py: pipeline, encoders)


def test_cache_matches_flux_pipeline(pipeline, encoders, tmp_path):
  """Cached latents and embeddings are FluxPipeline's: the VAE's posterior mean, shifted,
  scaled and 2x2-packed; T5 and CLIP as `encode_prompt` gives them."""
  from diffusers import AutoencoderKL, FluxPipeline
  items = test_cache.make_items(5)
  c = cache.build_cache(str(tmp_path), items, encoders, batch_size=2)
  assert sorted(c.buckets()) == [((32, 32, 1), 3), ((64, 32, 1), 2)] and len(c) == 5

  vae = AutoencoderKL.from_pretrained(os.path.join(pipeline, "vae"))
  pipe = FluxPipeline.from_pretrained(pipeline)
  cfg = vae.config
  for bucket, _ in c.buckets():
    for index, key in enumerate(c.keys(bucket)):
      item = next(it for it in items if it["key"] == key)
      x = torch.from_numpy(item["load_pixels"]()).permute(0, 3, 1, 2)
      with torch.no_grad():
        z = (vae.encode(x).latent_dist.mean - cfg.shift_factor) * cfg.scaling_factor
        want = FluxPipeline._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3])[0].numpy()
        text, pooled, _ = pipe.encode_prompt(item["caption"], prompt_2=None,
                                             max_sequence_length=512)
      got = c.get(bucket, index)
      assert_close(got["latents"], want, what=f"{key}: latents")
      assert_close(got["text"], text[0].numpy(), what=f"{key}: text")
      assert_close(got["pooled"], pooled[0].numpy(), what=f"{key}: pooled")
      assert flux.image_ids(*c.grid(bucket)).shape[0] == got["latents"].shape[0]
  assert c.get((64, 32, 1), 0)["latents"].shape == (8 * 16, 16)

  with torch.no_grad():
    text, pooled, _ = pipe.encode_prompt("", prompt_2=None, max_sequence_length=512)
  empty = c.empty_text((64, 32, 1))
  assert_close(empty["text"], text[0].numpy(), what="empty text")
  assert_close(empty["pooled"], pooled[0].numpy(), what="empty pooled")


def test_identity_changes_with_settings(pipeline, encoders):
  other = load_encoders("flux", pipeline, max_sequence_length=64)
  assert other.identity() != encoders.identity()
  assert other.encode_text(["x"])["text"].shape == (1, 64, 24)
  other.release()


def test_cached_dataset_latents_equal_a_direct_vae_encode(tmp_path, encoders, pipeline):
  """Through the data path (resized and cropped to its bucket): the same as FluxPipeline packs."""
  from diffusers import AutoencoderKL, FluxPipeline
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=1, sizes=((40, 40),))
  (d,) = test_data.cached(folder, encoders)
  (bucket, _), = d.cache.buckets()
  vae = AutoencoderKL.from_pretrained(os.path.join(pipeline, "vae")).eval()
  (item,) = media.scan_directory(folder)
  frames = data.cache_items(media.DirectorySettings(path=folder, resolutions=(32,), enable_ar_bucket=True,
                                                    min_ar=0.5, max_ar=2.0, num_ar_buckets=7,
                                                    frame_buckets=(1,)), [item], encoders)[0][0]["load_pixels"]()
  with torch.no_grad():
    z = vae.encode(torch.from_numpy(frames[0]).permute(2, 0, 1)[None]).latent_dist.mean
  z = (z - vae.config.shift_factor) * vae.config.scaling_factor
  packed = FluxPipeline._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]).numpy()[0]
  assert_close(d.cache.get(bucket, 0)["latents"], packed)


def test_transformers_torchvision_fallback_is_not_shown(monkeypatch):
  """Importing diffusers' FluxPipeline (writing the tiny pipeline does) makes transformers warn
  that its image processors fall back to PIL without torchvision: no family uses one, and the
  torch side keeps the warning from the user."""
  import transformers
  from transformers.utils import logging as transformers_logging
  monkeypatch.delattr(transformers, "CLIPImageProcessor", raising=False)  # as if never imported
  transformers_logging.warning_once.cache_clear()
  with transformers_log() as records:
    transformers.CLIPImageProcessor  # what `from transformers import CLIPImageProcessor` does
  assert not [r.getMessage() for r in records if "torchvision" in r.getMessage()]
