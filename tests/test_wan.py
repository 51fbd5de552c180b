"""Wan: the transformer against diffusers' `WanTransformer3DModel` (T2V, I2V with CLIP image
tokens, TI2V's per-token timesteps) from every format (diffusers folder, Wan-AI's folder, ComfyUI's
single files, a float8 file), its conversion table against diffusers' own, and what it refuses."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tolerances import assert_close, rel_err
from test_models import torch_forward
from diffpipe_jax import models, tiny
from diffpipe_jax.convert import CheckpointError
from diffpipe_jax.convert.tensorfile import TensorFiles
from diffpipe_jax.encoders import wan as wan_torch
from diffpipe_jax.errors import UserError
from diffpipe_jax.models import wan


@pytest.fixture(scope="module")
def t2v(tiny_models):
  return tiny_models("wan")


@pytest.fixture(scope="module")
def i2v(tiny_models):
  return tiny_models("wan", seed=2, **wan_torch.TINY_I2V)


def load_all(checkpoint):
  return {name: models.load("wan", path, progress=False) for name, path in checkpoint["formats"].items()}


def per_token_timesteps(config, inputs, seed):
  """One timestep per token (Wan 2.2 TI2V's form), the first frame's at 0 as its pipeline does."""
  grid = [n // p for n, p in zip(inputs["hidden_states"].shape[2:], config.patch_size)]
  t = np.random.default_rng(seed).uniform(0, 1000, (inputs["hidden_states"].shape[0], *grid))
  t[:, 0] = 0
  return t.reshape(t.shape[0], -1).astype(np.float32)


@pytest.mark.parametrize("batch,grid,txt_len,per_token", [
    (1, (1, 2, 2), 5, False), (2, (3, 1, 3), 7, False), (2, (2, 3, 1), 1, True)])
def test_parity_with_diffusers(t2v, batch, grid, txt_len, per_token):
  """Several token grids (one frame, odd sides), zero-padded prompts, per-sample and per-token
  timesteps, from every format."""
  loaded = load_all(t2v)
  config = loaded["diffusers"].config
  inputs = wan.random_inputs(config, batch, *grid, txt_len=txt_len, seed=batch * 10 + txt_len)
  if per_token:
    inputs["timestep"] = per_token_timesteps(config, inputs, seed=batch)
  ref = torch_forward(t2v["torch"], inputs)
  for name, model in loaded.items():
    assert_close(model(**inputs), ref, what=name)
  assert len({m.config for m in loaded.values()}) == 1


def test_i2v_parity_with_diffusers(i2v):
  """The image tokens' attention (k_img, v_img, norm_k_img) and the image embedder; diffusers'
  I2V attention takes the last 512 context tokens for the text, so the text is 512 long."""
  loaded = load_all(i2v)
  config = loaded["diffusers"].config
  assert config.image_dim is not None and config.in_channels > config.out_channels
  inputs = wan.random_inputs(config, 2, 2, 2, 1, txt_len=wan.TEXT_TOKENS, seed=5)
  ref = torch_forward(i2v["torch"], inputs)
  for name, model in loaded.items():
    assert_close(model(**inputs), ref, what=name)
  without_image = dict(inputs, encoder_hidden_states_image=np.zeros_like(inputs["encoder_hidden_states_image"]))
  assert rel_err(loaded["diffusers"](**without_image), ref) > 1e-3  # the image tokens matter


@pytest.mark.parametrize("name", ["t2v", "i2v"])
def test_table_is_diffusers_conversion(name, request):
  """diffusers -> Wan's original names through our table, then diffusers' own single-file
  conversion back, reproduces every tensor."""
  from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
  sd = tiny.state_dict_numpy(request.getfixturevalue(name)["torch"])
  original = wan.original_tensors(sd)
  assert {"blocks.1.self_attn.q.weight", "blocks.2.norm3.weight", "head.modulation",
          "time_projection.1.bias"} <= set(original)
  back = convert_wan_transformer_to_diffusers({k: torch.from_numpy(v) for k, v in original.items()})
  assert set(back) == set(sd)
  for k, v in sd.items():
    np.testing.assert_array_equal(back[k].numpy(), v, err_msg=k)


def test_rope_is_diffusers(t2v):
  """The tables at the released head size and a long axis, float64 rounded as diffusers'."""
  from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
  config = wan.WanConfig()
  grid = (21, 30, 52)  # 81 frames of 480x832
  cos, sin = wan.rope_tables(grid, config)
  theirs = WanRotaryPosEmbed(config.attention_head_dim, config.patch_size, config.rope_max_seq_len)
  ref_cos, ref_sin = theirs(torch.zeros(1, 1, *[n * p for n, p in zip(grid, config.patch_size)]))
  np.testing.assert_array_equal(np.asarray(cos), ref_cos[0, :, 0].numpy())
  np.testing.assert_array_equal(np.asarray(sin), ref_sin[0, :, 0].numpy())


def test_a_float8_file_loads_as_the_float8_base(t2v, tmp_path):
  """ComfyUI's fp8_e4m3fn file: the blocks' Linears keep the file's float8 values (scale 1);
  the rest is bf16 in the file and float32 here."""
  path = wan_torch.save_comfyui(t2v["torch"], str(tmp_path / "wan2.1_t2v_fp8_e4m3fn.safetensors"),
                                wan_torch.PREFIX, float8=True)
  files = TensorFiles([path], strip_prefix=wan_torch.PREFIX)
  stored = {k: np.array(files[k]) for k in files.keys()}
  model = models.load("wan", path, transformer_dtype="float8", progress=False)
  q = model.params["blocks"]["self_attn"]["q"]
  assert q["kernel"].dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(q["kernel"][1]).T.view(np.uint8),
                                stored["blocks.1.self_attn.q.weight"].view(np.uint8))
  np.testing.assert_array_equal(q["kernel_scale"], 1.0)
  from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
  reference = wan_torch.build_tiny()
  reference.load_state_dict(convert_wan_transformer_to_diffusers(
      {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in stored.items()}))
  inputs = wan.random_inputs(model.config, 1, 2, 2, 2, seed=4)
  assert rel_err(model(**inputs), torch_forward(reference.eval(), inputs)) < 0.1  # float8 activations


def test_single_file_config(t2v, tmp_path):
  """A file's head count is the released head size's; Wan-AI's config.json says it; widths of
  no released head size and the first-last-frame model are refused."""
  folder = t2v["formats"]["original"]
  with open(os.path.join(folder, "config.json")) as f:
    assert json.load(f)["num_heads"] == t2v["torch"].config.num_attention_heads
  shapes = {"patch_embedding.weight": (100, 16, 1, 2, 2), "head.head.weight": (64, 100),
            "text_embedding.0.weight": (100, 20), "time_embedding.0.weight": (100, 16),
            "blocks.0.ffn.0.weight": (40, 100)}
  with pytest.raises(UserError, match="no multiple of 128"):
    wan.config_from_single_file(shapes, {})
  assert wan.config_from_single_file(shapes, {"num_heads": 5}).attention_head_dim == 20
  with pytest.raises(UserError, match="first-last-frame"):
    wan.config_from_single_file(dict(shapes, **{"img_emb.emb_pos": (1, 514, 1280)}), {})
  with pytest.raises(UserError, match="axes_dims_rope does not apply"):
    models.load("wan", t2v["formats"]["single_file"], axes_dims_rope=(44, 42, 42), progress=False)


def test_diffusers_config_values_we_do_not_implement(t2v, tmp_path):
  config = dict(t2v["torch"].config, pos_embed_seq_len=514)
  with pytest.raises(UserError, match="first-last-frame"):
    wan.config_from_diffusers(config)


def test_inputs_are_checked(t2v, i2v):
  model = models.load("wan", t2v["formats"]["diffusers"], progress=False)
  good = wan.random_inputs(model.config, 2, 1, 2, 2, seed=1)
  with pytest.raises(TypeError, match="missing"):
    model(**{k: v for k, v in good.items() if k != "timestep"})
  with pytest.raises(ValueError, match="pass latents"):
    model(**dict(good, hidden_states=good["hidden_states"][:, :, :, :1]))
  with pytest.raises(ValueError, match="one per token"):
    model(**dict(good, timestep=np.zeros((2, 3), np.float32)))
  with pytest.raises(ValueError, match="no I2V model"):
    model(**dict(good, encoder_hidden_states_image=np.zeros((2, 4, 8), np.float32)))
  image_model = models.load("wan", i2v["formats"]["diffusers"], progress=False)
  image_inputs = wan.random_inputs(image_model.config, 1, 1, 2, 2, seed=1)
  with pytest.raises(TypeError, match="encoder_hidden_states_image"):
    image_model(**dict(image_inputs, encoder_hidden_states_image=None))


def test_a_folder_of_another_original_model_is_refused(t2v, tmp_path):
  folder = tmp_path / "other"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"_class_name": "HunyuanVideoModel"}))
  with pytest.raises(CheckpointError, match="describes a HunyuanVideoModel"):
    models.load("wan", str(folder), progress=False)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
  """A tiny Wan 2.2 A14B folder: two experts (`transformer` for high noise, `transformer_2` for
  low) and the boundary in its model_index.json, as WanPipeline saves them."""
  from diffusers import UniPCMultistepScheduler, WanPipeline
  root = str(tmp_path_factory.mktemp("a14b"))
  tokenizer = tiny.t5_tokenizer()
  released = {k: v for k, v in wan.RELEASED_SCHEDULER.items() if k != "_class_name"}
  WanPipeline(tokenizer=tokenizer, text_encoder=tiny.umt5_encoder(tokenizer, 20), vae=wan_torch.build_tiny_vae(),
              transformer=wan_torch.build_tiny(seed=5), transformer_2=wan_torch.build_tiny(seed=6),
              scheduler=UniPCMultistepScheduler(**released), boundary_ratio=0.875).save_pretrained(root)
  return root


def a14b_config(folder, **model):
  from conftest import family_config
  config = family_config("wan")
  config.model.diffusers_path = folder
  config.model.update(model)
  return config.model


def test_an_a14b_expert_is_one_transformer_on_its_side_of_the_boundary(a14b, tmp_path):
  """model.expert picks the folder's transformer and the timesteps it serves in WanPipeline
  (t >= boundary_ratio for the high-noise one), whatever the drawn t; min_t/max_t on the
  expert's side are kept as the range, across it refused; no expert for an A14B folder, or one
  for another folder, is refused."""
  high, low = (a14b_config(a14b, expert=e) for e in ("high_noise", "low_noise"))
  assert wan.checkpoint_path(high) == os.path.join(a14b, "transformer")
  assert wan.checkpoint_path(low) == os.path.join(a14b, "transformer_2")
  t = jnp.linspace(0.0, 1.0, 11)
  np.testing.assert_allclose(wan.shift_timesteps(high, t, None), 0.875 + 0.125 * t, rtol=1e-6)
  np.testing.assert_allclose(wan.shift_timesteps(low, t, None), 0.875 * t, rtol=1e-6)
  shifted = a14b_config(a14b, expert="low_noise", shift=3.0)
  np.testing.assert_allclose(wan.shift_timesteps(shifted, t, None), 0.875 * (3 * t / (1 + 2 * t)), rtol=1e-6)
  own = a14b_config(a14b, expert="high_noise", min_t=0.9, max_t=1.0)
  np.testing.assert_allclose(wan.shift_timesteps(own, t, None), t, rtol=1e-6)  # the range is applied before
  with pytest.raises(UserError, match=r"trains the timesteps \[0.875, 1.0\] .* min_t/max_t = \[0.5, 1.0\]"):
    wan.checkpoint_path(a14b_config(a14b, expert="high_noise", min_t=0.5))
  with pytest.raises(UserError, match="holds Wan 2.2 A14B's two experts .* set model.expert"):
    wan.checkpoint_path(a14b_config(a14b))
  with pytest.raises(UserError, match="is no Wan 2.2 A14B folder"):
    wan.checkpoint_path(a14b_config(str(tmp_path), expert="low_noise"))
  model = models.load("wan", wan.checkpoint_path(low), progress=False)
  inputs = wan.random_inputs(model.config, 1, 1, 2, 2, seed=3)
  assert_close(model(**inputs), torch_forward(wan_torch.build_tiny(seed=6), inputs))


def test_a14b_samples_switch_experts_at_the_boundary_as_wan_pipeline(a14b, tmp_path):
  """With no model.expert, samples of an A14B folder take the high-noise expert for the steps at
  t >= boundary_ratio and the low-noise one below, each with its own LoRA (the sampling
  command's --lora and --lora_2): the latents equal WanPipeline's with both transformers and
  the LoRAs loaded into each."""
  import jax
  from diffusers import WanPipeline
  from tolerances import LORA_PARITY
  from diffpipe_jax import lora, sampling
  config = a14b_config(a14b)
  (high_config, boundary), (low_config, below) = wan.FAMILY.sampling_experts(config)
  assert (boundary, below, high_config.expert, low_config.expert) == (0.875, 0.0, "high_noise", "low_noise")
  assert wan.FAMILY.sampling_experts(a14b_config(a14b, expert="low_noise")) == ()
  high, low = (models.load("wan", wan.checkpoint_path(c), progress=False) for c in (high_config, low_config))
  adapters = []
  for seed, model in enumerate((high, low)):
    adapter = lora.init(model.params, wan.FAMILY.lora_targets, 4, jnp.float32, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(adapter)
    adapters.append(jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(jax.random.key(seed * 100 + i), x.shape)
                                              for i, x in enumerate(leaves)]))
  encoders = wan_torch.TORCH_SIDE.load_encoders(high_config, device="cpu")
  frames, height, width, steps, guidance = 5, 32, 48, 8, 4.5
  grid = encoders.latent_grid(frames, height, width)
  conditioning, uncond = encoders.encode_text(["a red pattern"], frames), encoders.encode_text([""], frames)
  noise = np.random.default_rng(0).standard_normal((1, *wan.SAMPLING.latent_shape(high.config, grid)))
  step = sampling.step_fn(high, config, guidance)
  timesteps, _ = step.solver.schedule(steps, 0)
  assert (timesteps >= boundary).any() and (timesteps < boundary).any()  # both experts serve
  ours = sampling.denoise(high, high.params, adapters[0], config, conditioning, noise, grid, steps, guidance,
                          uncond, step, experts=[sampling.Expert(boundary, low.params, adapters[1], step)])

  pipe = WanPipeline.from_pretrained(a14b)
  high_file, low_file = (lora.save(adapter, str(tmp_path / name), wan.FAMILY, 4, np.float32)
                         for adapter, name in zip(adapters, ("high", "low")))
  pipe.load_lora_weights(high_file)
  pipe.load_lora_weights(low_file, load_into_transformer_2=True)
  with torch.no_grad():
    want = pipe(prompt_embeds=torch.from_numpy(conditioning["text"]),
                negative_prompt_embeds=torch.from_numpy(uncond["text"]), latents=torch.from_numpy(noise).float(),
                height=height, width=width, num_frames=frames, num_inference_steps=steps,
                guidance_scale=guidance, output_type="latent", return_dict=False)[0].numpy()
  assert_close(ours, want, bound=LORA_PARITY)
  one_expert = sampling.denoise(high, high.params, adapters[0], config, conditioning, noise, grid, steps,
                                guidance, uncond, step)
  assert rel_err(one_expert, want) > 1e-3  # the switch matters
  # the low-noise expert's own guidance (sample_guidance_2, --guidance_2: guidance_scale_2)
  from conftest import family_config
  settings = family_config("wan")
  assert sampling.second_guidance(settings, guidance) == guidance
  settings.sample_guidance_2 = 3.0
  assert (sampling.second_guidance(settings, guidance), sampling.second_guidance(settings, guidance, 2.0)) == (3.0, 2.0)
  ours = sampling.denoise(high, high.params, adapters[0], config, conditioning, noise, grid, steps, guidance,
                          uncond, step, experts=[sampling.Expert(boundary, low.params, adapters[1],
                                                                 sampling.step_fn(high, config, 3.0))])
  with torch.no_grad():
    want_2 = pipe(prompt_embeds=torch.from_numpy(conditioning["text"]),
                  negative_prompt_embeds=torch.from_numpy(uncond["text"]), latents=torch.from_numpy(noise).float(),
                  height=height, width=width, num_frames=frames, num_inference_steps=steps,
                  guidance_scale=guidance, guidance_scale_2=3.0, output_type="latent", return_dict=False)[0].numpy()
  assert_close(ours, want_2, bound=LORA_PARITY)
  assert rel_err(want_2, want) > 1e-3


def test_ti2v_first_frame_conditioning():
  """The 2.2 TI2V 5B (48 channels in and out): with p = 1 every video's first latent frame is its
  clean latents, its tokens at t = 0 in WanPipeline's per-token order (the frame mask's patches,
  flattened), and out of the loss; an image's never; p = 0.5 about half the videos; p = 0, a
  T2V or an I2V model: nothing changes (an I2V model takes the frame in its channels)."""
  import jax
  from conftest import family_config
  ti2v = wan.WanConfig(num_attention_heads=3, attention_head_dim=14, in_channels=48, out_channels=48)
  settings = family_config("wan").model
  video, image = wan.random_batch(ti2v, 64, 3, 2, 2, seed=1), wan.random_batch(ti2v, 64, 1, 2, 2, seed=2)
  t, key = jnp.linspace(0.1, 0.9, 64), jax.random.key(0)
  for p, cfg in ((0.0, ti2v), (1.0, wan.WanConfig()), (1.0, wan.WanConfig(in_channels=36))):
    settings.first_frame_conditioning_p = p
    noisy = video["latents"] + 1.0
    same, t0, mask = wan.condition(settings, cfg, key, video, noisy, t)
    assert same is noisy and t0 is t and mask is None
  settings.first_frame_conditioning_p = 1.0
  condition = jax.jit(lambda *args: wan.condition(settings, ti2v, *args))
  noisy = video["latents"] + 1.0
  out, tt, mask = condition(key, video, noisy, t)
  first = (np.arange(3) == 0)[None, None, :, None, None]
  np.testing.assert_array_equal(out, np.where(first, video["latents"], noisy))
  frame_mask = np.ones((3, 4, 4)) * (np.arange(3) > 0)[:, None, None]  # WanPipeline's, latent-sized
  np.testing.assert_allclose(tt, frame_mask[None, :, ::2, ::2].reshape(1, -1) * np.asarray(t)[:, None])
  assert mask.shape == (64, 1, 3, 1) and (np.asarray(mask)[:, 0, :, 0] == [0, 1, 1]).all()
  assert wan.condition(settings, ti2v, key, image, image["latents"], t)[2] is None
  settings.first_frame_conditioning_p = 0.5
  _, tt, mask = jax.jit(lambda *args: wan.condition(settings, ti2v, *args))(key, video, video["latents"], t)
  chosen = np.asarray(mask[:, 0, 0, 0] == 0)
  assert 16 < chosen.sum() < 48
  np.testing.assert_array_equal(np.asarray(tt == 0).any(-1), chosen)


@pytest.mark.parametrize("variant", ["tiny_i2v", "tiny_ti2v"])
def test_i2v_and_ti2v_train_end_to_end(variant, tmp_path):
  """configs/wan.py's I2V (first frame through the input channels and CLIP; no samples) and
  TI2V (half the clips' first frames clean) variants cache, train, evaluate and export."""
  import subprocess
  import sys
  from conftest import xla_flags
  from test_train import ROOT, no_samples
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(1))
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "main.py"), "--config",
       os.path.join(ROOT, "configs", f"wan.py:{variant}"), f"--config.output_dir={tmp_path}/out",
       "--config.epochs=1", *no_samples()],
      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert "done: 3 steps" in proc.stdout
  [run] = os.listdir(tmp_path / "out")
  assert os.path.isfile(tmp_path / "out" / run / "epoch1" / "pytorch_lora_weights.safetensors")


def test_ti2v_conditioning_over_sequence_and_pipeline_parallelism_matches_one_device(tiny_models):
  """The 2.2 TI2V 5B's per-token timesteps (half the videos' first frames clean) split over 4
  sequence-parallel devices and over 2 pipeline stages: loss, gradients, training and samples
  equal one device's (tests/multidevice_check.py)."""
  import subprocess
  import sys
  from test_sharding import ROOT
  path = tiny_models("wan", seed=4, **wan_torch.TINY_TI2V)["formats"]["diffusers"]
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "multidevice_check.py"), "wan",
                        path, "1x1x4,1x2", "first_frame_conditioning_p=0.5"],
                       env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout
