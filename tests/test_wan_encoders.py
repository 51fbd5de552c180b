"""Wan's PyTorch side against diffusers: the cache's latents and text embeddings are WanPipeline's
own (its VAE and latent normalisation; `encode_prompt` with its prompt cleaning, truncation and
zeros after each prompt), the tiny pipeline runs in WanPipeline, and every format we write
(diffusers, Wan-AI's original folder, ComfyUI's files: our inversion of diffusers' converter)
reads back to the diffusers model through diffusers' own `convert_wan_transformer_to_diffusers`."""
import copy
import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers.loaders import single_file_utils

from conftest import load_encoders
from tolerances import assert_close
from diffpipe_jax import sampling, tiny
from diffpipe_jax.convert.tensorfile import open_tensor_file
from diffpipe_jax.encoders import wan
from diffpipe_jax.encoders.wan import WanEncoders
from diffpipe_jax.errors import UserError
from diffpipe_jax.models import wan as wan_model

FAMILY, PIPELINE = "wan", WanPipeline  # (the fixtures of conftest.py)
LONG = "a slow pan over a red and green pattern " * 14  # past 512 tokens of the character T5


def clips(frames, height=32, width=48, batch=2):
  rng = np.random.default_rng(frames)
  return rng.uniform(-1, 1, (batch, frames, height, width, 3)).astype(np.float32)


def pipeline_stats(vae, like):
  """WanPipeline's latents_mean and latents_std, which is 1 / the config's std."""
  shape = (1, vae.config.z_dim, 1, 1, 1)
  mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
  std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
  return mean, std


def pipeline_latents(vae, pixels):
  """WanImageToVideoPipeline's condition latents: the posterior's mode, (z - mean) * std. The
  input is laid out contiguous, as the encoder lays it out (oneDNN sums a permuted view in
  another order)."""
  x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 4, 1, 2, 3)))
  with torch.no_grad():
    z = vae.encode(x).latent_dist.mode()
  mean, std = pipeline_stats(vae, z)
  return ((z - mean) * std).numpy()


def pipeline_decode(vae, latents):
  """WanPipeline's decoding: latents / std + mean through the VAE, as [B, F, H, W, 3]."""
  z = torch.from_numpy(latents)
  mean, std = pipeline_stats(vae, z)
  with torch.no_grad():
    return vae.decode(z / std + mean, return_dict=False)[0].numpy().transpose(0, 2, 3, 4, 1)


def test_the_vae_factors_come_from_the_configs(encoders):
  assert (encoders.pixel_multiple, encoders.frames_per_latent, encoders.frame_rate) == (16, 4, 16)
  assert encoders.latent_grid(17, 64, 96) == (5, 8, 12)
  assert encoders.latent_grid(1, 16, 32) == (1, 2, 4)
  # the 2.2 TI2V's VAE: 16x spatial, so 32-pixel multiples with the transformer's 2x2 patches
  vae_config = wan.build_tiny_vae(wan22=True).config
  wan22 = WanEncoders("", "cpu", torch.float32, {}, 24, vae_config,
                      wan_model.WanConfig(in_channels=48, out_channels=48), {})
  assert (wan22.pixel_multiple, wan22.frames_per_latent) == (32, 4)
  assert wan22.latent_grid(9, 64, 96) == (3, 4, 6)


@pytest.mark.parametrize("frames", [5, 1])
def test_latents_are_the_pipelines_and_decode_as_it_decodes(encoders, pipe, frames):
  pixels = clips(frames)
  got = encoders.encode_media(pixels)
  assert got.shape == (2, wan.TINY_Z, *encoders.latent_grid(frames, 32, 48))
  assert got.dtype == np.float32
  assert_close(got, pipeline_latents(pipe.vae, pixels))
  decoded = encoders.decode_media(got, encoders.latent_grid(frames, 32, 48))
  assert decoded.shape == pixels.shape
  assert_close(decoded, pipeline_decode(pipe.vae, got))


def test_frames_and_sides_the_pipeline_refuses_are_errors(encoders):
  with pytest.raises(ValueError, match="1 \\+ 4k frames with sides multiples of 16, got 8 frames"):
    encoders.encode_media(clips(8))
  with pytest.raises(ValueError, match="got 1 frames of 40x32"):
    encoders.encode_media(clips(1, width=40))


def test_text_is_the_pipelines_and_truncation_is_tallied(encoders, pipe):
  """512 tokens, each prompt's embeddings kept to its own tokens and zeros after them; the
  prompt cleaned first (HTML entities, runs of whitespace); a prompt cut at the limit."""
  fits = "x" * 510  # Metaspace's leading "▁" and "</s>" make 512
  captions = ["a red pattern", LONG, "", fits, fits + "y", "  a &amp;amp; red\n\n pattern "]
  got = encoders.encode_text(captions)
  with torch.no_grad():
    embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                   max_sequence_length=512, device="cpu")
  np.testing.assert_array_equal(got["text"], embeds.numpy())
  assert list(got) == ["text"] and got["text"].shape == (6, 512, 20)
  assert got["text"].dtype == np.float32
  # the character T5's tokens: "▁" + characters (spaces are "▁") + "</s>", at most 512
  lengths = [15, 512, 1, 512, 512, 17]
  for row, n in zip(got["text"], lengths):
    assert (row[n:] == 0).all() and (np.abs(row[:n]).sum(-1) > 0).all()
  [note] = encoders.truncation_notes()
  assert note.startswith("2 of 5 captions are longer than UMT5's 512 tokens")
  # cleaned as "a & red pattern", as the pipeline cleans it
  cleaned = encoders.encode_text(["a & red pattern"])["text"][0]
  np.testing.assert_array_equal(got["text"][5], cleaned)


def test_missing_folders_name_the_key_to_set(pipeline, tmp_path):
  with pytest.raises(UserError, match="caching needs model.diffusers_path"):
    WanEncoders.load("")
  with pytest.raises(UserError, match="model.diffusers_path .*nope does not exist: set it to a "
                     "diffusers Wan pipeline folder"):
    WanEncoders.load(str(tmp_path / "nope"))
  os.symlink(f"{pipeline}/vae", tmp_path / "vae")
  with pytest.raises(UserError, match=f"{tmp_path} lacks the encoder folder\\(s\\) \\['tokenizer', "
                     "'text_encoder'\\]: model.diffusers_path must be a diffusers Wan pipeline"):
    WanEncoders.load(str(tmp_path))
  for sub in ("tokenizer", "text_encoder"):
    os.symlink(f"{pipeline}/{sub}", tmp_path / sub)
  os.remove(tmp_path / "vae")
  os.mkdir(tmp_path / "vae")  # a download that lacks its config
  with pytest.raises(UserError, match="vae has no config.json: model.diffusers_path must be"):
    WanEncoders.load(str(tmp_path))


def test_the_tiny_pipeline_runs_in_wan_pipeline(pipe):
  """Its scheduler is the released one (UniPC over flow sigmas at shift 3), which our sampler reads."""
  assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
  assert pipe.scheduler.config.flow_shift == 3.0 and pipe.scheduler.config.use_flow_sigmas
  video = pipe("a red pattern", num_inference_steps=1, height=16, width=32, num_frames=5,
               output_type="np").frames
  assert video.shape == (1, 5, 16, 32, 3) and np.isfinite(video).all()


def test_every_tiny_weight_is_random(pipe):
  """No parameter is left at a constant init (norms included), so a conversion that drops or
  swaps one shows."""
  for name, model in (("transformer", pipe.transformer), ("vae", pipe.vae),
                      ("text_encoder", pipe.text_encoder)):
    constant = [k for k, v in model.named_parameters() if v.numel() > 1 and v.std() == 0]
    assert not constant, (name, constant)


def test_the_i2v_and_wan22_overrides_build_working_models():
  """I2V: image features through the added key/value projections (diffusers splits them from a
  text of exactly 512 tokens); the 2.2 VAE: 48 channels, 16x spatial, for a TI2V transformer."""
  model = wan.build_tiny(**wan.TINY_I2V)
  assert model.condition_embedder.image_embedder is not None
  with torch.no_grad():
    out = model(torch.randn(1, wan.TINY_I2V["in_channels"], 2, 4, 6), torch.tensor([500.0]),
                torch.randn(1, 512, 20), encoder_hidden_states_image=torch.randn(1, 5, 24)).sample
  assert out.shape == (1, wan.TINY_Z, 2, 4, 6)
  vae = wan.build_tiny_vae(wan22=True)
  with torch.no_grad():
    z = vae.encode(torch.randn(1, 3, 5, 32, 64)).latent_dist.mode()
  assert z.shape == (1, wan.TINY_TI2V["in_channels"], 2, 2, 4)
  assert wan.original_model_type(wan.build_tiny(**wan.TINY_TI2V).config) == "ti2v"


@pytest.fixture(scope="module")
def i2v_pipeline(tmp_path_factory):
  return wan.write_tiny_pipeline(str(tmp_path_factory.mktemp("wan_i2v")), kind="i2v")


@pytest.fixture(scope="module")
def ti2v_pipeline(tmp_path_factory):
  return wan.write_tiny_pipeline(str(tmp_path_factory.mktemp("wan_ti2v")), kind="ti2v")


@pytest.mark.parametrize("frames", [9, 1])
def test_i2v_fields_are_what_the_i2v_pipeline_gives_its_transformer(i2v_pipeline, frames):
  """An I2V transformer's cache: the condition channels (our mask beside the first frame's
  latents, black frames after it) equal WanImageToVideoPipeline's `prepare_latents` for that
  frame, the CLIP states its `encode_image` of the frame as an 8-bit image; an image's
  condition is its own latents. The fingerprint tells it from a T2V cache."""
  from diffusers import WanImageToVideoPipeline
  from PIL import Image
  pipe = WanImageToVideoPipeline.from_pretrained(i2v_pipeline)
  encoders = WanEncoders.load(i2v_pipeline)
  cfg = wan_model.config_from_diffusers(dict(pipe.transformer.config))
  assert encoders.first_frame == "channels" and encoders.takes_first_frame
  eight_bit = np.round((clips(frames, batch=1) + 1) * 127.5)
  pixels = (eight_bit / 127.5 - 1).astype(np.float32)
  fields = encoders.encode_fields(pixels)
  assert sorted(fields) == ["condition", "image", "latents"]
  with torch.no_grad():
    _, condition = pipe.prepare_latents(torch.from_numpy(pixels[:, 0].transpose(0, 3, 1, 2)), 1,
                                        wan.TINY_Z, 32, 48, frames, torch.float32, "cpu")
    image = pipe.encode_image(Image.fromarray(eight_bit[0, 0].astype(np.uint8)), "cpu")
  ours = np.concatenate([np.asarray(wan_model.first_frame_mask(cfg, fields["latents"])),
                         fields["condition"]], axis=1)
  assert ours.shape == condition.shape
  assert_close(ours, condition.numpy())
  assert_close(fields["image"], image.numpy())
  if frames == 1:
    np.testing.assert_array_equal(fields["condition"], fields["latents"])
  assert "first_frame" in encoders.identity() and "image_encoder=CLIPVisionModel" in encoders.identity()
  encoders.release()


def test_an_i2v_folder_without_its_image_encoder_names_it(i2v_pipeline, tmp_path):
  for sub in os.listdir(i2v_pipeline):
    if sub != "image_encoder":
      os.symlink(f"{i2v_pipeline}/{sub}", tmp_path / sub)
  with pytest.raises(UserError, match="lacks the encoder folder\\(s\\) \\['image_encoder'\\]: "
                     "model.diffusers_path must be a diffusers Wan I2V pipeline folder"):
    WanEncoders.load(str(tmp_path))


def test_the_ti2v_pipeline_runs_in_wan_pipeline(ti2v_pipeline):
  """The tiny 2.2 TI2V 5B: the 2.2 VAE's 48 channels, per-token timesteps (`expand_timesteps`);
  its cache holds latents and text only, its first frame being its clip's first latent frame."""
  root = ti2v_pipeline
  pipe = WanPipeline.from_pretrained(root)
  assert pipe.config.expand_timesteps and pipe.vae.config.z_dim == 48
  video = pipe("a red pattern", num_inference_steps=1, height=32, width=64, num_frames=5,
               output_type="np").frames
  assert video.shape == (1, 5, 32, 64, 3) and np.isfinite(video).all()
  encoders = WanEncoders.load(root)
  assert encoders.first_frame == "clean" and not encoders.needs_first_frame
  assert (encoders.frame_rate, WanEncoders.load(root, frame_rate=30).frame_rate) == (24, 30)
  pixels = clips(5, 32, 64, batch=1)
  fields = encoders.encode_fields(pixels)
  assert list(fields) == ["latents"]
  # the VAE is causal: a clip's first latent frame is its first frame's, the pipeline's condition
  assert_close(fields["latents"][:, :, :1], encoders.encode_media(pixels[:, :1]))


def diffusers_names(tensors):
  """A file's tensors (numpy) through diffusers' own converter, as float32 numpy."""
  back = single_file_utils.convert_wan_transformer_to_diffusers(
      {k: torch.from_numpy(v.astype(np.float32)) for k, v in tensors.items()})
  return {k: v.numpy() for k, v in back.items()}


def load_file(path):
  """A safetensors file's tensors as numpy (float8 as ml_dtypes', which numpy lacks)."""
  tensors = open_tensor_file(path)
  return {k: np.array(tensors[k]) for k in tensors.keys()}


def assert_same_tensors(got, want):
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_every_format_reads_back_to_the_diffusers_model(variant, tmp_path):
  """Each file we write gives back every tensor: diffusers' folders through `from_pretrained`,
  Wan's original names through diffusers' converter (so our table inverts it), ComfyUI's float8
  file within float8 (its blocks' Linear weights) and bf16 (the rest) rounding."""
  model = wan.build_tiny(seed=3, **(wan.TINY_I2V if variant == "i2v" else {}))
  want = tiny.state_dict_numpy(model)
  formats = wan.save_tiny(model, str(tmp_path))
  assert sorted(formats) == ["diffusers", "diffusers_sharded", "original", "single_file",
                             "single_file_prefixed"]
  for name in ("diffusers", "diffusers_sharded"):
    loaded = WanTransformer3DModel.from_pretrained(formats[name], subfolder="transformer")
    assert_same_tensors(tiny.state_dict_numpy(loaded), want)
  assert os.path.isfile(f"{formats['diffusers_sharded']}/transformer/"
                        "diffusion_pytorch_model.safetensors.index.json")

  folder = formats["original"]
  with open(f"{folder}/diffusion_pytorch_model.safetensors.index.json") as f:
    weight_map = json.load(f)["weight_map"]
  shards = sorted(set(weight_map.values()))
  assert shards == [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
  original = {k: v for shard in shards for k, v in load_file(f"{folder}/{shard}").items()}
  assert sorted(original) == sorted(weight_map)
  assert {"patch_embedding.weight", "text_embedding.2.bias", "time_projection.1.weight",
          "blocks.2.self_attn.norm_q.weight", "blocks.0.cross_attn.o.bias", "blocks.1.norm3.weight",
          "blocks.0.ffn.2.weight", "blocks.2.modulation", "head.head.weight",
          "head.modulation"} <= set(original)
  assert ({"blocks.0.cross_attn.k_img.weight", "blocks.0.cross_attn.norm_k_img.weight",
           "img_emb.proj.0.weight", "img_emb.proj.4.bias"} <= set(original)) == (variant == "i2v")
  assert_same_tensors(diffusers_names(original), want)
  with open(f"{folder}/config.json") as f:
    config = json.load(f)
  in_dim = wan.TINY_I2V["in_channels"] if variant == "i2v" else wan.TINY_Z
  assert config == {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": 42,
                    "eps": 1e-6, "ffn_dim": 64, "freq_dim": 16, "in_dim": in_dim,
                    "model_type": variant, "num_heads": 3, "num_layers": 3, "out_dim": wan.TINY_Z,
                    "text_len": 512}

  comfyui, prefixed = load_file(formats["single_file"]), load_file(formats["single_file_prefixed"])
  assert_same_tensors(comfyui, original)
  assert_same_tensors(prefixed, {wan.PREFIX + k: v for k, v in original.items()})
  assert_same_tensors(diffusers_names(prefixed), want)
  for name in ("single_file", "single_file_prefixed"):  # as a user loads it, the folder's config given
    loaded = WanTransformer3DModel.from_single_file(formats[name], config=formats["diffusers"],
                                                    subfolder="transformer")
    assert_same_tensors(tiny.state_dict_numpy(loaded), want)

  fp8 = load_file(wan.save_comfyui(model, str(tmp_path / "fp8_e4m3fn.safetensors"), float8=True))
  float8 = {k for k, v in fp8.items() if v.dtype == ml_dtypes.float8_e4m3fn}
  assert float8 == {k for k, v in original.items()
                    if k.startswith("blocks.") and k.endswith(".weight") and v.ndim == 2}
  assert {fp8[k].dtype for k in set(fp8) - float8} == {np.dtype(ml_dtypes.bfloat16)}
  rounded = {k: v.astype(ml_dtypes.float8_e4m3fn if k in float8 else ml_dtypes.bfloat16)
             for k, v in original.items()}
  assert_same_tensors(diffusers_names(fp8), diffusers_names(rounded))
  assert_close(diffusers_names(fp8), want, bound=0.05)  # e4m3's 3 mantissa bits: 2^-4 at most


def sampling_setup(pipeline, folder, height, width):
  """Two pattern images of height x width in `folder`, and the pipeline folder's model config,
  family, model and encoders."""
  from PIL import Image
  from conftest import family_config
  from diffpipe_jax import family as family_lib, models
  paths = []
  for i in range(2):
    paths.append(str(folder / f"{i}.png"))
    Image.fromarray(tiny.pattern(i, width, height)).save(paths[-1])
  model_config = family_config("wan").model
  model_config.diffusers_path = pipeline
  fam = family_lib.get("wan")
  model = models.load("wan", fam.checkpoint_path(model_config), progress=False)
  return paths, model_config, fam, model, WanEncoders.load(pipeline)


def test_i2v_samples_are_the_i2v_pipelines(i2v_pipeline, tmp_path):
  """Samples of an I2V model from first frames (`sample_images`) equal WanImageToVideoPipeline's
  latents from the same images, noise and prompts, with classifier-free guidance (its negative
  rows take the same frame); a T2V model refuses first frames, an I2V model wants one a prompt."""
  import jax
  from PIL import Image
  from diffusers import WanImageToVideoPipeline
  frames, height, width, steps, guidance = 5, 32, 48, 3, 4.5
  paths, model_config, fam, model, encoders = sampling_setup(i2v_pipeline, tmp_path, height, width)
  prompts = sampling.encode_prompts(fam, encoders, ["a red pattern", "blue"], frames, height, width,
                                    images=paths)
  noise = np.random.default_rng(0).standard_normal((2, wan.TINY_Z, *prompts.grid)).astype(np.float32)
  ours = sampling.denoise(model, model.params, None, model_config, prompts.conditioning, noise,
                          prompts.grid, steps, guidance, uncond=prompts.uncond)
  pipe = WanImageToVideoPipeline.from_pretrained(i2v_pipeline)
  for i, path in enumerate(paths):  # the pipeline takes one image a call
    with torch.no_grad():
      want = pipe(image=Image.open(path), prompt_embeds=torch.from_numpy(prompts.conditioning["text"][i:i + 1]),
                  negative_prompt_embeds=torch.from_numpy(prompts.uncond["text"]),
                  latents=torch.from_numpy(noise[i:i + 1]), height=height, width=width,
                  num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                  output_type="latent", return_dict=False)[0]
    assert_close(np.asarray(jax.device_get(ours))[i:i + 1], want.numpy())
  with pytest.raises(UserError, match="give one image per prompt \\(2\\), not 1"):
    sampling.encode_prompts(fam, encoders, ["a", "b"], frames, height, width, images=paths[:1])
  with pytest.raises(UserError, match="^sample_images: an image-to-video model's samples start"):
    sampling.check_first_frames(encoders, 1, ())
  with pytest.raises(UserError, match="this model takes no first frame"):
    sampling.check_first_frames(WanEncoders.load(wan.write_tiny_pipeline(str(tmp_path / "t2v"))), 1, paths[:1])


def test_ti2v_samples_from_first_frames_are_the_i2v_pipelines(ti2v_pipeline, tmp_path):
  """The TI2V 5B's samples from first frames equal WanImageToVideoPipeline's with
  `expand_timesteps` (the frame's latents in place of the first latent frame, its tokens at t =
  0, and in the result); from text alone, WanPipeline's. It takes a first frame a prompt or
  none."""
  import jax
  from PIL import Image
  from diffusers import WanImageToVideoPipeline
  frames, height, width, steps, guidance = 5, 32, 64, 3, 4.5
  paths, model_config, fam, model, encoders = sampling_setup(ti2v_pipeline, tmp_path, height, width)
  assert encoders.takes_first_frame and not encoders.needs_first_frame
  texts = ["a red pattern", "blue"]
  text_pipe = WanPipeline.from_pretrained(ti2v_pipeline)
  image_pipe = WanImageToVideoPipeline(**text_pipe.components, expand_timesteps=True)
  for images in (paths, ()):
    prompts = sampling.encode_prompts(fam, encoders, texts, frames, height, width, images=images)
    assert ("first_frame" in prompts.conditioning) == bool(images)
    noise = np.random.default_rng(0).standard_normal((2, wan_model.WAN22_Z, *prompts.grid)).astype(np.float32)
    ours = np.asarray(jax.device_get(sampling.denoise(
        model, model.params, None, model_config, prompts.conditioning, noise, prompts.grid, steps,
        guidance, uncond=prompts.uncond)))
    for i in range(len(texts)):  # the pipelines take one image a call
      pipe, image = (image_pipe, dict(image=Image.open(paths[i]))) if images else (text_pipe, {})
      with torch.no_grad():
        want = pipe(**image, prompt_embeds=torch.from_numpy(prompts.conditioning["text"][i:i + 1]),
                    negative_prompt_embeds=torch.from_numpy(prompts.uncond["text"]),
                    latents=torch.from_numpy(noise[i:i + 1]), height=height, width=width,
                    num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                    output_type="latent", return_dict=False)[0]
      assert_close(ours[i:i + 1], want.numpy(), what=f"images {bool(images)}, prompt {i}")
    if images:  # the given frame, as the pipeline returns it
      np.testing.assert_array_equal(ours[:, :, :1], prompts.conditioning["first_frame"])
  with pytest.raises(UserError, match="give one first frame per prompt \\(2\\), or none"):
    sampling.check_first_frames(encoders, 2, paths[:1])


# ---- Wan-AI's folder and ComfyUI's UMT5 file ------------------------------------------------------


@pytest.fixture(scope="module")
def original(pipeline, tmp_path_factory):
  """Wan-AI's folder of the tiny T2V pipeline's weights, and its encoders. A tiny VAE's 9
  channels have no released statistics: the pipeline's stand in for them while they load."""
  folder = wan.write_tiny_original(pipeline, str(tmp_path_factory.mktemp("Wan2.1-T2V-tiny")))
  stats = {k: wan.read_vae_config(f"{pipeline}/vae")[k] for k in ("latents_mean", "latents_std")}
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(wan.LATENT_STATISTICS, wan.TINY_Z, stats)
    encoders = load_encoders(FAMILY, "", model=dict(ckpt_path=folder))
  yield folder, encoders
  encoders.release()


CAPTIONS = ["a red pattern", LONG, "", "  a &amp;amp; red\n\n pattern "]


def test_wan_ai_names_are_wans_own(original, pipe):
  """The files hold Wan's names (Wan2.1 `wan/modules/t5.py` and `vae.py`), so a table that
  merely round-trips fails here; the VAE's agree with diffusers' own converter where it applies
  (the released stage multipliers: it places one shortcut only)."""
  folder, _ = original
  t5 = torch.load(f"{folder}/{wan.ORIGINAL_T5}", weights_only=True)
  assert {"token_embedding.weight", "blocks.0.norm1.weight", "blocks.0.attn.q.weight",
          "blocks.2.attn.o.weight", "blocks.1.pos_embedding.embedding.weight",
          "blocks.0.norm2.weight", "blocks.0.ffn.gate.0.weight", "blocks.0.ffn.fc1.weight",
          "blocks.2.ffn.fc2.weight", "norm.weight"} <= set(t5)
  assert len(t5) == len(pipe.text_encoder.state_dict()) - 1  # the tied embedding once
  np.testing.assert_array_equal(t5["blocks.0.ffn.gate.0.weight"].numpy(),
                                pipe.text_encoder.encoder.block[0].layer[1].DenseReluDense.wi_0.weight.detach().numpy())
  vae = torch.load(f"{folder}/Wan2.1_VAE.pth", weights_only=True)
  assert {"conv1.weight", "conv2.bias", "encoder.conv1.weight", "encoder.downsamples.0.residual.0.gamma",
          "encoder.downsamples.2.resample.1.weight", "encoder.downsamples.5.time_conv.weight",
          "encoder.middle.1.to_qkv.weight", "encoder.head.2.weight", "decoder.middle.2.residual.6.bias",
          "decoder.upsamples.3.resample.1.weight", "decoder.upsamples.3.time_conv.weight",
          "decoder.upsamples.4.shortcut.weight", "decoder.head.0.gamma"} <= set(vae)
  from diffusers import AutoencoderKLWan
  released_stages = tiny.build(AutoencoderKLWan, 0, **dict(wan.TINY_VAE, dim_mult=[1, 2, 4, 4]))
  theirs = single_file_utils.convert_wan_vae_to_diffusers(
      {k: torch.from_numpy(v) for k, v in wan.original_vae(released_stages).items()})
  assert_same_tensors({k: v.numpy() for k, v in theirs.items()}, tiny.state_dict_numpy(released_stages))


def test_wan_ai_folder_encodes_as_the_diffusers_folder(original, encoders):
  folder, ours = original
  assert ours.sources == {"vae": f"{folder}/Wan2.1_VAE.pth", "tokenizer": f"{folder}/google/umt5-xxl",
                          "text_encoder": f"{folder}/{wan.ORIGINAL_T5}"}
  np.testing.assert_array_equal(ours.encode_text(CAPTIONS)["text"], encoders.encode_text(CAPTIONS)["text"])
  pixels = clips(5)
  got, want = ours.encode_fields(pixels), encoders.encode_fields(pixels)
  assert list(got) == ["latents"]
  assert_close(got["latents"], want["latents"])
  assert ours.identity() != encoders.identity()  # the files read are its fingerprint


def test_wan22_folder_reads_the_22_vae(ti2v_pipeline, tmp_path):
  """The TI2V 5B's folder: Wan2.2_VAE.pth (residual stages, 2x2 pixel patches, 48 channels with
  the released statistics), chosen by the transformer's 48 channels."""
  folder = wan.write_tiny_original(ti2v_pipeline, str(tmp_path / "Wan2.2-TI2V-tiny"))
  vae = torch.load(f"{folder}/Wan2.2_VAE.pth", weights_only=True)
  assert {"encoder.downsamples.0.downsamples.1.residual.3.gamma",
          "encoder.downsamples.0.downsamples.2.resample.1.weight",
          "encoder.downsamples.1.downsamples.2.time_conv.weight",
          "decoder.upsamples.0.upsamples.3.resample.1.weight",
          "decoder.upsamples.0.upsamples.3.time_conv.weight",
          "decoder.upsamples.3.upsamples.2.residual.6.weight"} <= set(vae)
  ours, theirs = WanEncoders.load(ckpt_path=folder), WanEncoders.load(ti2v_pipeline)
  assert ours.vae_config == {k: v for k, v in theirs.vae_config.items() if not k.startswith("_")}
  pixels = clips(5, 32, 64, batch=1)
  assert_close(ours.encode_fields(pixels)["latents"], theirs.encode_fields(pixels)["latents"])
  np.testing.assert_array_equal(ours.encode_text(CAPTIONS[:2])["text"], theirs.encode_text(CAPTIONS[:2])["text"])


def rounded(tensors, float8):
  """A UMT5's tensors as ComfyUI's file keeps them, back in float32: float16, or float8 times
  the per-tensor scale for the blocks' Linear weights (`save_comfyui_umt5`)."""
  out = {}
  for key, value in tensors.items():
    if float8 and key.startswith("encoder.block.") and value.ndim == 2 and "relative" not in key:
      scale = np.float32(np.abs(value).max() / 448.0)
      out[key] = (value / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    else:
      out[key] = value.astype(np.float16).astype(np.float32)
  return out


@pytest.mark.parametrize("float8, prefix", [(False, "encoder."), (False, ""), (True, "encoder.")])
def test_llm_path_is_comfyuis_umt5_file(pipeline, encoders, pipe, tmp_path, float8, prefix):
  """model.llm_path wins over the folders' text encoder: its tensors (the `encoder.` prefix
  left out or not) are the weights rounded as stored, float8 ones times their scale, and its
  embeddings are those of the diffusers UMT5 given those weights. Against the unrounded
  weights' embeddings, the rounding through the tiny random model's three layers measures
  2e-3 for float16 (2^-11 a weight) and 0.18 for e4m3 (3 mantissa bits: up to 2^-4 a weight)."""
  path = wan.save_comfyui_umt5(pipe.text_encoder, str(tmp_path / "umt5_xxl.safetensors"), float8, prefix)
  weights = rounded(tiny.state_dict_numpy(pipe.text_encoder), float8)
  assert_same_tensors({k: v.float().numpy() for k, v in wan.umt5_tensors(path).items()}, weights)
  ours = load_encoders(FAMILY, pipeline, model=dict(llm_path=path))
  assert ours.sources["text_encoder"] == path and ours.sources["tokenizer"] == f"{pipeline}/tokenizer"
  reference = load_encoders(FAMILY, pipeline)
  reference.tokenizer, reference.umt5 = encoders.tokenizer, copy.deepcopy(pipe.text_encoder)
  reference.umt5.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
  got = ours.encode_text(CAPTIONS)["text"]
  assert_close(got, reference.encode_text(CAPTIONS)["text"])
  assert_close(got, encoders.encode_text(CAPTIONS)["text"], bound=0.3 if float8 else 5e-3)
  assert ours.identity() != encoders.identity()


def folder_without(folder, left_out, copy):
  """A folder of links to `folder`'s files but `left_out`."""
  copy.mkdir()
  for name in os.listdir(folder):
    if name != left_out:
      os.symlink(f"{folder}/{name}", copy / name)
  return copy


def refusal(**keys):
  """The one-line UserError of loading the encoders from `keys`."""
  with pytest.raises(UserError) as e:
    WanEncoders.load(**keys)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_missing_wan_ai_files_are_one_line_errors(original, tmp_path):
  folder, _ = original
  assert refusal(ckpt_path=str(tmp_path / "nope")).startswith(
      f"model.ckpt_path {tmp_path}/nope does not exist: set it to Wan-AI's folder")
  partial = folder_without(folder, wan.ORIGINAL_T5, tmp_path / "partial")
  assert refusal(ckpt_path=str(partial)).startswith(
      f"{partial} lacks ['{wan.ORIGINAL_T5}']: model.ckpt_path must be Wan-AI's folder")
  assert refusal(ckpt_path=str(partial), llm_path=str(tmp_path / "x.safetensors")).startswith(
      "model.llm_path")
  assert refusal(llm_path=f"{folder}/{wan.ORIGINAL_T5}").startswith("caching needs model.diffusers_path")
  # the tiny VAE's 9 channels: no released Wan VAE has their statistics
  assert "a VAE of 9 latent channels, whose latent statistics no released Wan VAE has" in refusal(
      ckpt_path=folder)


# ---- Wan-AI's I2V folder: its CLIP file -------------------------------------------------------


def tiny_clip_loads(patch, pipeline):
  """What the tiny I2V folder's files load with: its VAE's statistics (the pipeline's, as no
  released VAE has 9 channels) and its CLIP's head size (8, not the released 80)."""
  stats = {k: wan.read_vae_config(f"{pipeline}/vae")[k] for k in ("latents_mean", "latents_std")}
  patch.setitem(wan.LATENT_STATISTICS, wan.TINY_Z, stats)
  heads = wan.TINY_CLIP["num_attention_heads"]
  patch.setattr(wan, "CLIP_HEAD_DIM", wan.TINY_CLIP["hidden_size"] // heads)


@pytest.fixture(scope="module")
def original_i2v(i2v_pipeline, tmp_path_factory):
  """Wan-AI's folder of the tiny I2V pipeline's weights (its CLIP .pth included), and its encoders."""
  folder = wan.write_tiny_original(i2v_pipeline, str(tmp_path_factory.mktemp("Wan2.1-I2V-tiny")))
  with pytest.MonkeyPatch.context() as patch:
    tiny_clip_loads(patch, i2v_pipeline)
    encoders = WanEncoders.load(ckpt_path=folder)
  yield folder, encoders
  encoders.release()


def test_wan_ai_clip_names_are_wans_own(original_i2v, i2v_pipeline):
  """The CLIP file holds Wan's names (Wan2.1 `wan/modules/clip.py`, `VisionTransformer` under
  `visual.`), q, k, v fused in that order along the rows; the released shapes give the released
  image_encoder config (laion's CLIP-ViT-H-14, as diffusers' Wan I2V folders hold it)."""
  from transformers import CLIPVisionModel
  folder, _ = original_i2v
  clip = torch.load(f"{folder}/{wan.ORIGINAL_CLIP}", weights_only=True)
  assert {"visual.patch_embedding.weight", "visual.cls_embedding", "visual.pos_embedding",
          "visual.pre_norm.weight", "visual.transformer.0.norm1.bias",
          "visual.transformer.0.attn.to_qkv.weight", "visual.transformer.2.attn.to_qkv.bias",
          "visual.transformer.1.attn.proj.weight", "visual.transformer.0.norm2.weight",
          "visual.transformer.2.mlp.0.weight", "visual.transformer.0.mlp.2.bias",
          "visual.post_norm.bias"} <= set(clip)
  assert "visual.patch_embedding.bias" not in clip  # Wan's pre-norm tower has none
  assert clip["visual.cls_embedding"].shape == (1, 1, 24)
  assert clip["visual.pos_embedding"].shape == (1, 17, 24)  # the class token's, then 4 x 4 patches
  theirs = CLIPVisionModel.from_pretrained(f"{i2v_pipeline}/image_encoder").encoder.layers[1].self_attn
  qkv = clip["visual.transformer.1.attn.to_qkv.weight"].numpy()
  for rows, proj in zip(np.split(qkv, 3), (theirs.q_proj, theirs.k_proj, theirs.v_proj)):
    np.testing.assert_array_equal(rows, proj.weight.detach().numpy())
  released = {"visual.patch_embedding.weight": (1280, 3, 14, 14), "visual.pos_embedding": (1, 257, 1280),
              **{f"visual.transformer.{i}.mlp.0.weight": (5120, 1280) for i in range(32)}}
  config = wan.clip_vision_config(released, "released")
  assert ((config.hidden_size, config.num_attention_heads, config.intermediate_size,
           config.num_hidden_layers, config.patch_size, config.image_size, config.hidden_act,
           config.layer_norm_eps) == (1280, 16, 5120, 32, 14, 224, "gelu", 1e-5))


def test_wan_ai_i2v_folder_encodes_as_the_diffusers_i2v_folder(original_i2v, i2v_pipeline):
  """Without a diffusers folder, Wan-AI's CLIP file gives the image encoder and its processor:
  the cache's fields (`first_frame_fields`: condition and CLIP states) are the diffusers
  folder's. The states are the first L - 1 blocks' output after the pre-norm (Wan's
  `use_31_block`), which is `hidden_states[-2]`."""
  folder, ours = original_i2v
  theirs = WanEncoders.load(i2v_pipeline)
  clip = f"{folder}/{wan.ORIGINAL_CLIP}"
  assert ours.sources["image_encoder"] == ours.sources["image_processor"] == clip
  pixels = (np.round((clips(5, batch=1) + 1) * 127.5) / 127.5 - 1).astype(np.float32)
  got, want = ours.encode_fields(pixels), theirs.encode_fields(pixels)
  assert sorted(got) == ["condition", "image", "latents"]
  for field in ("latents", "condition"):
    assert_close(got[field], want[field], what=field)
  np.testing.assert_array_equal(got["image"], want["image"])
  assert ours.clip_processor.to_dict() == theirs.clip_processor.to_dict()
  model = ours.clip
  with torch.no_grad():
    x = ours.clip_processor(images=np.uint8(np.round((pixels[0, 0] + 1) * 127.5)), return_tensors="pt")
    h = model.pre_layrnorm(model.embeddings(x.pixel_values))
    for layer in model.encoder.layers[:-1]:
      h = layer(h, None)
  np.testing.assert_array_equal(got["image"], h.numpy())
  assert ours.identity() != theirs.identity()
  theirs.release()


def test_wan_ai_clip_files_are_checked(original_i2v, i2v_pipeline, tmp_path, monkeypatch):
  """One-line errors: a tower whose width is no multiple of the head size, a folder without the
  CLIP file, a CLIP file without the vision tower (the text tower only); a folder without it
  takes CLIP from the diffusers folder beside it."""
  folder, _ = original_i2v
  with pytest.raises(UserError, match=f"{wan.ORIGINAL_CLIP} is a CLIP vision tower 24 wide, not "
                     "heads of 80 as Wan's: give"):
    wan.read_clip_config(f"{folder}/{wan.ORIGINAL_CLIP}")
  partial = folder_without(folder, wan.ORIGINAL_CLIP, tmp_path / "partial")
  assert refusal(ckpt_path=str(partial)).startswith(
      f"{partial} lacks ['{wan.ORIGINAL_CLIP}']: model.ckpt_path must be Wan-AI's I2V folder")
  tiny_clip_loads(monkeypatch, i2v_pipeline)
  assert WanEncoders.load(i2v_pipeline, ckpt_path=str(partial)).sources["image_encoder"] == (
      f"{i2v_pipeline}/image_encoder")
  wan.save_torch({"textual.token_embedding.weight": np.zeros((5, 4), np.float32),
                  "log_scale": np.zeros((), np.float32)}, str(partial / wan.ORIGINAL_CLIP))
  assert refusal(ckpt_path=str(partial)) == (
      f"{partial}/{wan.ORIGINAL_CLIP} holds no CLIP vision tower (it lacks "
      f"'visual.patch_embedding.weight'): model.ckpt_path must be {wan.WHAT_I2V['ckpt_path']}, "
      f"or set model.diffusers_path to {wan.WHAT_I2V['diffusers_path']}")

