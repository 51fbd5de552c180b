"""HunyuanVideo's PyTorch side against diffusers: the cache's latents and text embeddings are
HunyuanVideoPipeline's own (its VAE, frame-wise encoding included; `encode_prompt` with Tencent's
image and video templates), and Tencent's folder and ComfyUI's files give the same encoders as
the diffusers folder."""
import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import HunyuanVideoPipeline
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from safetensors.numpy import load_file

from conftest import transformers_log
from tolerances import assert_close
from diffpipe_jax import cache, data, tiny
from diffpipe_jax.convert.tensorfile import write_safetensors
from diffpipe_jax.encoders import hunyuan_video
from diffpipe_jax.encoders.hunyuan_video import HunyuanVideoEncoders
from diffpipe_jax.errors import UserError

FAMILY, PIPELINE = "hunyuan-video", HunyuanVideoPipeline  # (the fixtures of conftest.py)
LONG = "a slow pan over a red and green pattern " * 8  # past 256 LLaMA and 77 CLIP tokens (bytes)
TEMPLATES = {1: hunyuan_video.IMAGE_TEMPLATE, 9: hunyuan_video.VIDEO_TEMPLATE}


@pytest.fixture(scope="module")
def ckpts(pipeline):
  return f"{pipeline}/ckpts"


@pytest.fixture(scope="module")
def comfyui_vae(pipe, tmp_path_factory):
  """The pipeline's VAE as ComfyUI ships it: one safetensors file, no config."""
  path = str(tmp_path_factory.mktemp("comfyui") / "hunyuan_video_vae_bf16.safetensors")
  write_safetensors(tiny.state_dict_numpy(pipe.vae), path)
  return path


def clips(frames, height=64, width=96, batch=2):
  rng = np.random.default_rng(frames)
  return rng.uniform(-1, 1, (batch, frames, height, width, 3)).astype(np.float32)


def vae_latents(vae, pixels, framewise=True):
  """The VAE's posterior mean times its scaling factor, frame-wise encoding on or off. The input
  is laid out contiguous, as the encoder lays it out: a permuted view makes oneDNN's convolutions
  sum in another order, 1e-5 away on some CPUs."""
  vae.use_framewise_encoding = framewise
  x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 4, 1, 2, 3)))
  try:
    with torch.no_grad():
      z = vae.encode(x).latent_dist.mean
  finally:
    vae.use_framewise_encoding = True
  return (z * vae.config.scaling_factor).numpy()


def test_the_vae_factors_come_from_its_config(encoders):
  assert (encoders.pixel_multiple, encoders.frames_per_latent, encoders.frame_rate) == (16, 4, 24)
  assert encoders.latent_grid(17, 64, 96) == (5, 8, 12)
  assert encoders.latent_grid(1, 16, 32) == (1, 2, 4)


@pytest.mark.parametrize("frames, height, width", [(1, 64, 96), (17, 32, 48)])
def test_latents_are_the_pipelines_vae(encoders, pipe, frames, height, width):
  pixels = clips(frames, height, width)
  got = encoders.encode_media(pixels)
  assert got.shape == (2, hunyuan_video.TINY_VAE["latent_channels"],
                       *encoders.latent_grid(frames, height, width))
  assert_close(got, vae_latents(pipe.vae, pixels))


def test_long_clips_are_encoded_frame_wise(encoders, pipe):
  """Past 16 frames the VAE encodes windows of 17 frames, and the latents differ from a
  whole-clip encode's; up to 17 they are the same."""
  pixels = clips(21, 32, 32, batch=1)
  got = encoders.encode_media(pixels)
  assert_close(got, vae_latents(pipe.vae, pixels))
  assert np.abs(got - vae_latents(pipe.vae, pixels, framewise=False)).max() > 0.1
  pixels = clips(17, 32, 32, batch=1)
  assert_close(encoders.encode_media(pixels), vae_latents(pipe.vae, pixels, framewise=False))


def test_frames_and_sides_the_pipeline_refuses_are_errors(encoders):
  with pytest.raises(ValueError, match="1 \\+ 4k frames with sides multiples of 16, got 8 frames"):
    encoders.encode_media(clips(8))
  with pytest.raises(ValueError, match="got 1 frames of 40x64"):
    encoders.encode_media(clips(1, width=40))


def test_the_templates_are_tencents_and_crop_start_is_measured(encoders):
  """The prefix's token count is where the caption's tokens start, and the count diffusers'
  rule gives (the template's tokens less `{}` and `<|eot_id|>`), as with the released tokenizer,
  whose counts are Tencent's 36 and 95."""
  assert hunyuan_video.VIDEO_TEMPLATE == DEFAULT_PROMPT_TEMPLATE["template"]
  tokenizer = encoders.tokenizer
  ids = lambda text, **kw: tokenizer(text, **kw).input_ids
  eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
  crops = [hunyuan_video.crop_start(tokenizer, TEMPLATES[f]) for f in (1, 9)]
  assert crops == [153, 424]  # bytes, special tokens and BOS of the tiny byte-level tokenizer
  for template, crop in zip(TEMPLATES.values(), crops):
    assert crop == len(ids(template)) - 2
    prompt = ids(template.format("a red pattern"))
    assert prompt[:crop] == ids(template.split("{}")[0])
    assert prompt[crop:] == ids("a red pattern", add_special_tokens=False) + [eot]


@pytest.mark.parametrize("frames", [9, 1])
def test_text_is_the_pipelines_and_truncation_is_tallied(encoders, pipe, frames):
  captions = ["a red pattern", LONG, "", "x" * 255, "y" * 256]
  template = TEMPLATES[frames]
  got = encoders.encode_text(captions, frames=frames)
  crop = hunyuan_video.crop_start(encoders.tokenizer, template)
  with torch.no_grad():
    embeds, pooled, mask = pipe.encode_prompt(
        captions, prompt_template=dict(template=template, crop_start=crop), device="cpu",
        max_sequence_length=256)
  assert_close(got["text"], embeds.numpy(), what="text")
  np.testing.assert_array_equal(got["text_mask"], mask.float().numpy())
  assert_close(got["pooled"], pooled.numpy(), what="pooled")
  assert got["text"].shape == (5, 256, 24) and got["pooled"].shape == (5, 20)
  assert {v.dtype for v in got.values()} == {np.dtype(np.float32)}
  assert got["text_mask"].sum(1).tolist() == [14, 256, 1, 256, 256]  # caption + <|eot_id|>
  llama, clip = encoders.truncation_notes()
  # "x" * 255 and its <|eot_id|> just fit; "y" * 256 loses its <|eot_id|>
  assert llama.startswith("2 of 4 captions are longer than the LLaMA's 256 tokens")
  assert clip.startswith("3 of 4 captions are longer than CLIP's 77 tokens")


def test_caption_dropout_takes_the_empty_caption_in_the_rows_template(encoders, pipe, tmp_path):
  """A dropped caption of a video is the empty caption in the video template, as
  HunyuanVideoPipeline encodes it; of an image, the empty caption in the image template."""
  buckets = [(32, 32, 1), (32, 32, 5)]
  items = [dict(key=str(b), caption="a red pattern", bucket=b,
                load_pixels=lambda b=b: clips(b[2], 32, 32, batch=1)[0]) for b in buckets]
  directory = data.CachedDirectory(cache.build_cache(str(tmp_path), items, encoders, batch_size=1), 1)
  batches = data.Batches([directory], 1, seed=0, position_ids=None, uncond_fraction=1.0)
  image, video = (batches.load((bucket, [(0, 0)])) for bucket in buckets)
  template = TEMPLATES[9]
  with torch.no_grad():
    embeds, pooled, mask = pipe.encode_prompt(
        [""], prompt_template=dict(template=template, crop_start=hunyuan_video.crop_start(
            encoders.tokenizer, template)), device="cpu", max_sequence_length=256)
  assert_close(video["text"], embeds.numpy(), what="text")
  np.testing.assert_array_equal(video["text_mask"], mask.float().numpy())
  assert_close(video["pooled"], pooled.numpy(), what="pooled")
  assert np.abs(image["text"] - video["text"]).max() > 0.1
  np.testing.assert_array_equal(image["text"], encoders.encode_text([""], frames=1)["text"])


def assert_same_encoders(got, want):
  pixels = clips(5, 32, 48, batch=1)
  np.testing.assert_array_equal(got.encode_media(pixels), want.encode_media(pixels))
  for frames in (1, 9):
    for field, value in want.encode_text(["a red pattern", ""], frames).items():
      np.testing.assert_array_equal(got.encode_text(["a red pattern", ""], frames)[field], value)


def test_tencents_folder_gives_the_diffusers_folders_encoders(ckpts, encoders):
  official = HunyuanVideoEncoders.load(ckpt_path=ckpts, device="cpu")
  assert official.sources["vae"] == f"{ckpts}/hunyuan-video-t2v-720p/vae"
  assert official.vae_config["block_out_channels"] == [32, 32, 64, 64]  # Tencent's config.json
  assert official.identity() != encoders.identity()  # its files are part of the fingerprint
  with transformers_log() as records:
    assert_same_encoders(official, encoders)
  # the LLaMA's head and CLIP's vision tower, which Tencent's folders hold, are not reported
  assert not [r.getMessage() for r in records if "LOAD REPORT" in r.getMessage()]


def test_a_missing_or_unknown_text_encoder_tensor_is_still_reported(ckpts, tmp_path):
  clip = shutil.copytree(f"{ckpts}/text_encoder_2", tmp_path / "clip")
  tensors = load_file(clip / "model.safetensors")
  del tensors["text_model.final_layer_norm.bias"]
  write_safetensors({**tensors, "text_model.surprise": np.zeros(1, np.float32)},
                    str(clip / "model.safetensors"))
  with transformers_log() as records:
    HunyuanVideoEncoders.load(ckpt_path=ckpts, clip_path=str(clip), device="cpu").clip
  (report,) = [r.getMessage() for r in records if "LOAD REPORT" in r.getMessage()]
  assert "final_layer_norm.bias" in report and "MISSING" in report
  assert "surprise" in report and "UNEXPECTED" in report
  assert "vision_model" not in report


def tencents_vae(ckpts):
  return f"{ckpts}/{hunyuan_video.OFFICIAL_VAE}/{hunyuan_video.OFFICIAL_VAE_WEIGHTS}"


@pytest.mark.parametrize("vae_file", ["comfyui", "tencent"])
def test_comfyuis_files_give_the_diffusers_folders_encoders(ckpts, comfyui_vae, pipe, encoders, vae_file,
                                                           capsys):
  """ComfyUI's VAE file, or Tencent's pytorch_model.pt given alone as vae_path; each load says
  what it loads from where."""
  vae = comfyui_vae if vae_file == "comfyui" else tencents_vae(ckpts)
  comfyui = HunyuanVideoEncoders.load(vae_path=vae, llm_path=f"{ckpts}/text_encoder",
                                      clip_path=f"{ckpts}/text_encoder_2", device="cpu")
  read = json.loads(json.dumps(comfyui.vae_config))  # from the file's shapes; tuples as lists
  assert read == {key: pipe.vae.config[key] for key in read}
  assert comfyui.component_files("vae") == [vae]
  encoders.vae, encoders.llm  # loaded before what this test prints
  capsys.readouterr()
  assert_same_encoders(comfyui, encoders)
  assert capsys.readouterr().out.splitlines() == [
      f"loading the VAE from {vae} (cpu)",
      f"loading the text encoders from {ckpts}/text_encoder, {ckpts}/text_encoder_2 (cpu)"]


def test_comfyuis_files_then_tencents_folder_win(pipeline, ckpts, comfyui_vae):
  model_config = SimpleNamespace(diffusers_path=pipeline, ckpt_path=ckpts, vae_path=comfyui_vae,
                                 llm_path="", clip_path="")
  both = hunyuan_video.TORCH_SIDE.load_encoders(model_config, device="cpu")
  assert both.sources == dict(vae=comfyui_vae, tokenizer=f"{ckpts}/text_encoder",
                              text_encoder=f"{ckpts}/text_encoder",
                              tokenizer_2=f"{ckpts}/text_encoder_2",
                              text_encoder_2=f"{ckpts}/text_encoder_2")
  assert both.path == f"{comfyui_vae}, {ckpts}"


def test_missing_components_name_the_keys_to_set(pipeline, comfyui_vae, tmp_path):
  with pytest.raises(UserError, match="caching needs the encoders \\['vae', 'tokenizer', "
                     "'text_encoder', 'tokenizer_2', 'text_encoder_2'\\]: set model.vae_path .* "
                     "and model.llm_path .* and model.clip_path .*; or model.ckpt_path .*; or "
                     "model.diffusers_path"):
    HunyuanVideoEncoders.load()
  with pytest.raises(UserError, match=f"{tmp_path} lacks the encoder folder\\(s\\) "
                     "\\['tokenizer_2', 'text_encoder_2'\\]: set model.clip_path \\(the CLIP-L "
                     "text encoder folder with its tokenizer\\); or model.ckpt_path .*; or "
                     "model.diffusers_path"):
    HunyuanVideoEncoders.load(ckpt_path=str(tmp_path), vae_path=comfyui_vae,
                              llm_path=f"{pipeline}/ckpts/text_encoder")
  with pytest.raises(UserError, match="model.llm_path .*nope does not exist"):
    HunyuanVideoEncoders.load(diffusers_path=pipeline, llm_path=str(tmp_path / "nope"))
  with pytest.raises(UserError, match="model.vae_path .* is a folder"):
    HunyuanVideoEncoders.load(diffusers_path=pipeline, vae_path=str(tmp_path))
  write_safetensors({"x": np.zeros(2, np.float32)}, str(tmp_path / "x.safetensors"))
  with pytest.raises(UserError, match="is not a HunyuanVideo VAE \\(it has no 'encoder.conv_in"):
    HunyuanVideoEncoders.load(diffusers_path=pipeline, vae_path=str(tmp_path / "x.safetensors"))
  for intact, message in ((comfyui_vae, "is truncated: its header describes"),
                          (tencents_vae(f"{pipeline}/ckpts"), "is not a readable torch checkpoint")):
    cut = tmp_path / os.path.basename(intact)  # a download cut in half
    cut.write_bytes(open(intact, "rb").read()[:os.path.getsize(intact) // 2])
    with pytest.raises(UserError, match=message):
      HunyuanVideoEncoders.load(diffusers_path=pipeline, vae_path=str(cut))


def test_the_transformer_formats_hold_the_same_tensors(tmp_path):
  model = hunyuan_video.build_tiny(seed=3)
  formats = hunyuan_video.save_tiny(model, str(tmp_path))
  official = torch.load(formats["official"], weights_only=True)["module"]
  assert formats["official"] == f"{tmp_path}/ckpts/{hunyuan_video.OFFICIAL_TRANSFORMER}"
  assert "double_blocks.0.img_attn_qkv.weight" in official
  comfyui, prefixed = load_file(formats["single_file"]), load_file(formats["single_file_prefixed"])
  assert sorted(prefixed) == sorted(hunyuan_video.PREFIX + k for k in official) and \
      sorted(comfyui) == sorted(official)
  for key, value in official.items():
    np.testing.assert_array_equal(comfyui[key], value.numpy())
    np.testing.assert_array_equal(prefixed[hunyuan_video.PREFIX + key], value.numpy())
