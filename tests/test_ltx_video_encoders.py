"""LTX-Video's PyTorch side against diffusers: the cache's latents and text embeddings are
LTXPipeline's own, the VAE reads the same from Lightricks' single file as from the folder, and the
single files we write (our inversion of diffusers' renames) load back exactly in diffusers."""
import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTXVideo, LTXPipeline, LTXVideoTransformer3DModel
from diffusers.loaders import single_file_utils
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import family_config, load_encoders
from tolerances import assert_close
from diffpipe_jax.encoders import ltx_video
from diffpipe_jax.errors import UserError

FAMILY, PIPELINE = "ltx-video", LTXPipeline  # (the fixtures of conftest.py)
LONG = "a slow pan over a red and green pattern " * 8  # past the 128 tokens of the character T5


@pytest.fixture(scope="module")
def single_file(pipe, tmp_path_factory):
  """The pipeline's transformer and VAE in Lightricks' released format."""
  path = tmp_path_factory.mktemp("single") / "ltx-video-2b-v0.9.1.safetensors"
  return ltx_video.save_single_file(pipe.transformer, str(path), vae=pipe.vae)


def with_single_file(pipeline, path):
  """The encoders as the config gives them: model.diffusers_path and model.single_file_path."""
  model_config = family_config("ltx-video").model
  model_config.diffusers_path, model_config.single_file_path = pipeline, path
  return ltx_video.TORCH_SIDE.load_encoders(model_config, device="cpu")


def pipeline_latents(pipe, pixels):
  """LTXPipeline's latents of pixels [B, F, H, W, 3]: the posterior mean, normalised, packed. The
  video is laid out contiguous, as the encoder lays it out: a permuted view makes oneDNN's
  convolutions sum in another order, 1e-5 away on some CPUs."""
  video = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 4, 1, 2, 3)))
  with torch.no_grad():
    z = pipe.vae.encode(video).latent_dist.mean
  z = pipe._normalize_latents(z, pipe.vae.latents_mean, pipe.vae.latents_std,
                              pipe.vae.config.scaling_factor)
  packed = pipe._pack_latents(z, pipe.transformer_spatial_patch_size,
                              pipe.transformer_temporal_patch_size)
  return packed.numpy(), tuple(z.shape[2:])


def clips(frames, height=64, width=96, batch=2):
  rng = np.random.default_rng(frames)
  return rng.uniform(-1, 1, (batch, frames, height, width, 3)).astype(np.float32)


def test_the_vae_factors_come_from_its_config(encoders):
  assert (encoders.pixel_multiple, encoders.frames_per_latent, encoders.frame_rate) == (32, 8, 25)
  assert encoders.latent_grid(17, 64, 96) == (3, 2, 3)
  assert encoders.latent_grid(1, 32, 32) == (1, 1, 1)


@pytest.mark.parametrize("frames", [9, 1])
def test_latents_are_ltx_pipelines(encoders, pipe, frames):
  pixels = clips(frames)
  want, grid = pipeline_latents(pipe, pixels)
  got = encoders.encode_media(pixels)
  assert grid == encoders.latent_grid(frames, 64, 96)
  assert got.shape == (2, np.prod(grid), ltx_video.TINY_LTX["in_channels"]) == want.shape
  assert_close(got, want)


def test_frames_and_sides_the_pipeline_refuses_are_errors(encoders):
  with pytest.raises(ValueError, match="1 \\+ 8k frames with sides multiples of 32, got 8 frames"):
    encoders.encode_media(clips(8))
  with pytest.raises(ValueError, match="got 1 frames of 48x64"):
    encoders.encode_media(clips(1, width=48))


def test_text_is_ltx_pipelines_and_truncation_is_tallied(encoders, pipe):
  captions = ["a red pattern", LONG, ""]
  got = encoders.encode_text(captions)
  with torch.no_grad():
    embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                            max_sequence_length=128, device="cpu")
  assert_close(got["text"], embeds.numpy())
  np.testing.assert_array_equal(got["text_mask"], mask.float().numpy())
  assert got["text"].shape == (3, 128, 20) and got["text_mask"].dtype == np.float32
  assert got["text_mask"][1].all() and got["text_mask"][2].sum() == 1  # "" is just </s>
  [note] = encoders.truncation_notes()
  assert note.startswith("1 of 2 captions are longer than T5's 128 tokens")


def test_the_vae_from_the_single_file_gives_the_folders_latents(pipeline, encoders, single_file):
  from_file = with_single_file(pipeline, single_file)
  assert from_file.vae_file == single_file
  assert from_file.identity() != encoders.identity()  # the file is part of the fingerprint
  pixels = clips(9, batch=1)
  np.testing.assert_array_equal(from_file.encode_media(pixels), encoders.encode_media(pixels))


def test_a_single_file_without_a_vae_leaves_the_vae_to_the_folder(pipeline, encoders, pipe,
                                                                   tmp_path):
  path = ltx_video.save_single_file(pipe.transformer, str(tmp_path / "transformer.safetensors"))
  from_file = with_single_file(pipeline, path)
  assert from_file.vae_file == "" and from_file.identity() == encoders.identity()


def test_missing_folders_and_files_name_the_key_to_set(pipeline, tmp_path):
  with pytest.raises(UserError, match=f"{tmp_path} lacks the encoder folder.*model.diffusers_path"):
    load_encoders("ltx-video", str(tmp_path))
  with pytest.raises(UserError, match="caching needs model.diffusers_path"):
    load_encoders("ltx-video", "")
  with pytest.raises(UserError, match="model.single_file_path .*nope.safetensors does not exist"):
    with_single_file(pipeline, str(tmp_path / "nope.safetensors"))


def assert_same_tensors(got, want):
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert torch.equal(got[key], value), key


@pytest.mark.parametrize("format", ["single_file", "single_file_prefixed"])
def test_our_single_files_load_back_exactly_in_diffusers(tiny_models, format):
  """The Lightricks names we write are diffusers' renames inverted: its own conversion (as
  `from_single_file` runs it) gives back every tensor, unprefixed or prefixed with the VAE."""
  model = tiny_models("ltx-video")
  path, folder = model["formats"][format], model["formats"]["diffusers"]
  want = model["torch"].state_dict()
  assert_same_tensors(single_file_utils.convert_ltx_transformer_checkpoint_to_diffusers(
      load_file(path)), want)
  loaded = LTXVideoTransformer3DModel.from_single_file(path, config=folder, subfolder="transformer")
  assert_same_tensors(loaded.state_dict(), want)


def test_the_vae_in_the_single_file_loads_back_exactly_as_0_9_1(pipeline, pipe, single_file):
  checkpoint = load_file(single_file)
  assert single_file_utils.infer_diffusers_model_type(checkpoint) == "ltx-video-0.9.1"
  want = pipe.vae.state_dict()
  assert_same_tensors(single_file_utils.convert_ltx_vae_checkpoint_to_diffusers(checkpoint), want)
  vae = AutoencoderKLLTXVideo.from_single_file(single_file, config=pipeline, subfolder="vae")
  assert_same_tensors(vae.state_dict(), want)
  with safe_open(single_file, "np") as f:
    config = json.loads(f.metadata()["config"])
  assert config["transformer"]["num_layers"] == ltx_video.TINY_LTX["num_layers"]
  assert config["vae"]["latent_channels"] == ltx_video.TINY_VAE["latent_channels"]
  assert len(config["vae"]["decoder_blocks"]) == 7  # up_blocks.0-6 of the file


def test_a_decode_is_the_same_every_time_and_leaves_torchs_generator_as_it_was(encoders):
  """The decoder's blocks add noise (`decoder_inject_noise`) from torch's global generator: drawn
  from a fixed seed, a sample decodes the same in every run (it differed from run to run)."""
  import torch
  grid = encoders.latent_grid(9, 64, 64)
  latents = np.random.default_rng(0).standard_normal(
      (1, int(np.prod(grid)), encoders.vae.config.latent_channels)).astype(np.float32)
  assert any(encoders.vae.config.decoder_inject_noise)  # else the test shows nothing
  first = encoders.decode(latents, grid)
  torch.manual_seed(1234)
  state = torch.random.get_rng_state()
  np.testing.assert_array_equal(encoders.decode(latents, grid), first)
  assert torch.equal(torch.random.get_rng_state(), state)
