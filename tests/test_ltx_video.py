"""LTX-Video: the Flax transformer against diffusers' LTXVideoTransformer3DModel (two tiny sizes,
odd latent grids, batch 1 and 2, per-sample and per-token timesteps, padded text, RoPE from the
latent grid or given coordinates, every format), its inputs' checks, bf16, its single-file table
and config, RoPE at the released widths, the training inputs and first-frame conditioning."""
import copy
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch

from tolerances import assert_close, rel_err
from diffpipe_jax import lora, models, tiny
from diffpipe_jax.convert import table
from diffpipe_jax.convert.tensorfile import TensorFiles, write_safetensors
from diffpipe_jax.models import layers, ltx_video as ltx

FORMATS = ("diffusers", "diffusers_sharded", "single_file", "single_file_prefixed")
# The torch side's tiny model (4 heads of 8: 32 % 6 = 2 RoPE padding channels, as 2048 has),
# and one of 3 heads of 8 (24 % 6 = 0: no padding).
VARIANTS = {"padded": dict(seed=1),
            "unpadded": dict(seed=2, num_attention_heads=3, cross_attention_dim=24)}


def torch_forward(model, inputs, dtype=torch.float32):
  """diffusers' forward; arrays become tensors (latents and text in `dtype`), the rest as is."""
  lowered = ("hidden_states", "encoder_hidden_states")
  convert = lambda k, v: (torch.from_numpy(v).to(dtype if k in lowered else torch.float32)
                          if isinstance(v, np.ndarray) else v)
  model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
  with torch.no_grad():
    out = model(**{k: convert(k, v) for k, v in inputs.items()}, return_dict=False)[0]
  return out.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tiny_models):
  return {name: tiny_models("ltx-video", **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def loaded(checkpoints):
  return {name: models.load("ltx-video", c["formats"]["diffusers"], progress=False)
          for name, c in checkpoints.items()}


def case_inputs(cfg, grid, batch, timestep, positions, mask, seed):
  """(our inputs, diffusers' inputs) for a latent grid: per-sample or per-token timesteps;
  RoPE from given coordinates ([B, 3, S], or ours unbatched [3, S]) or from the grid ints
  (with LTXPipeline's scale at 24 or 25 fps, or none); padded, empty or no text mask."""
  inputs = ltx.random_inputs(cfg, batch, *grid, txt_len=7, seed=seed)
  rng = np.random.default_rng(seed)
  if timestep == "token":
    inputs["timestep"] = rng.uniform(0, 1000, (batch, int(np.prod(grid)))).astype(np.float32)
  ref = dict(inputs)
  if mask == "empty":
    # A sample without any text token: diffusers' bias, -10000 on every score, is no mask at
    # all, but for rounding the scores to 1e-3 in float32 (3e-5 of output): the exact
    # reference is the sample unmasked.
    inputs["encoder_attention_mask"][-1] = 0
    ref["encoder_attention_mask"] = inputs["encoder_attention_mask"].copy()
    ref["encoder_attention_mask"][-1] = 1
  elif mask == "none":
    inputs["encoder_attention_mask"] = ref["encoder_attention_mask"] = None
  if positions.startswith("grid"):
    frame_rate = dict(grid=25, grid_24fps=24).get(positions)
    for d in (inputs, ref):
      del d["video_coords"]
      d.update(num_frames=grid[0], height=grid[1], width=grid[2],
               rope_interpolation_scale=frame_rate and ltx.pipeline_rope_scale(frame_rate))
  elif positions == "unbatched":
    inputs["video_coords"] = inputs["video_coords"][0]
  return inputs, ref


CASES = [((1, 4, 4), 1, "sample", "coords", "padded"),
         ((3, 5, 3), 2, "token", "grid", "padded"),
         ((2, 3, 7), 2, "sample", "grid_24fps", "empty"),
         ((2, 3, 7), 1, "token", "unbatched", "padded"),
         ((3, 5, 3), 2, "sample", "grid_unscaled", "none")]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("grid,batch,timestep,positions,mask", CASES)
def test_parity_with_diffusers(checkpoints, loaded, variant, grid, batch, timestep, positions,
                               mask):
  model = loaded[variant]
  inputs, ref_inputs = case_inputs(model.config, grid, batch, timestep, positions, mask,
                                   seed=batch * 100 + grid[1])
  ref = torch_forward(checkpoints[variant]["torch"], ref_inputs)
  out = model(**inputs)
  assert out.shape == ref.shape == (batch, int(np.prod(grid)), model.config.out_channels)
  assert_close(out, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_format_loads_the_same_model(checkpoints, loaded, variant):
  """Each format gives the diffusers folder's config and weights, and diffusers' output; the
  single file with the VAE beside (whose `vae.` tensors the loader leaves) tells the head
  count by its metadata."""
  want = loaded[variant]
  inputs = ltx.random_inputs(want.config, 2, 2, 3, 5, seed=7)
  ref = torch_forward(checkpoints[variant]["torch"], inputs)
  for format in FORMATS:
    model = models.load("ltx-video", checkpoints[variant]["formats"][format], progress=False)
    assert model.config == want.config, format
    jax.tree.map(np.testing.assert_array_equal, model.params, want.params)
    assert_close(model(**inputs), ref, what=format)


def test_vae_keys_are_ignored_unprefixed_too(checkpoints, tmp_path):
  """diffusers also takes the transformer unprefixed beside `vae.` tensors: so do we."""
  formats = checkpoints["padded"]["formats"]
  prefixed = TensorFiles([formats["single_file_prefixed"]])
  tensors = {k.removeprefix("model.diffusion_model."): np.array(prefixed[k])
             for k in prefixed.keys()}
  assert any(k.startswith("vae.") for k in tensors)
  path = str(tmp_path / "unprefixed.safetensors")
  write_safetensors(tensors, path, metadata=prefixed.metadata)
  model = models.load("ltx-video", path, progress=False)
  want = models.load("ltx-video", formats["diffusers"], progress=False)
  assert model.config == want.config
  jax.tree.map(np.testing.assert_array_equal, model.params, want.params)


def test_single_file_table_is_diffusers_conversion(checkpoints):
  """diffusers -> Lightricks through the table, then diffusers' own single-file conversion back,
  reproduces every tensor; and the table reads each one back from the single file."""
  from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers
  sd = tiny.state_dict_numpy(checkpoints["padded"]["torch"])
  single = table.to_single_file(sd, ltx.SINGLE_FILE_TABLE)
  assert {"patchify_proj.weight", "adaln_single.linear.bias", "scale_shift_table",
          "transformer_blocks.1.attn2.k_norm.weight",
          "transformer_blocks.1.scale_shift_table"} <= set(single)
  back = convert_ltx_transformer_checkpoint_to_diffusers(
      {"model.diffusion_model." + k: torch.from_numpy(v) for k, v in single.items()})
  assert set(back) == set(sd)
  for key, value in back.items():
    np.testing.assert_array_equal(value.numpy(), sd[key])
  sources = table.row_sources(ltx.SINGLE_FILE_TABLE, {k: v.shape for k, v in sd.items()}, "single")
  assert set(sources) == set(sd)
  for key, source in sources.items():
    np.testing.assert_array_equal(table.read_tensor(single, source), sd[key])


def test_single_file_config():
  """Sizes from the shapes; the heads from the metadata, else those of the released width."""
  shapes = {"patchify_proj.weight": (2048, 128), "proj_out.weight": (128, 2048),
            "caption_projection.linear_1.weight": (2048, 4096),
            **{f"transformer_blocks.{i}.attn2.to_k.weight": (2048, 2048) for i in range(28)}}
  assert ltx.config_from_single_file(shapes, {}) == ltx.LTXVideoConfig()
  config = json.dumps({"transformer": {"num_attention_heads": 16, "norm_eps": 1e-5}})
  cfg = ltx.config_from_single_file(shapes, {"config": config})
  assert (cfg.num_attention_heads, cfg.attention_head_dim, cfg.norm_eps) == (16, 128, 1e-5)
  narrow = {**shapes, "patchify_proj.weight": (1024, 128)}
  with pytest.raises(ValueError, match="head count is unknown"):
    ltx.config_from_single_file(narrow, {})


def test_diffusers_config_values_we_do_not_implement():
  with pytest.raises(ValueError, match="'attention_bias': False"):
    ltx.config_from_diffusers({"attention_bias": False})
  assert ltx.config_from_diffusers({"in_channels": 16, "out_channels": None}).out_channels == 16


def test_inputs_are_checked(loaded):
  model = loaded["padded"]
  inputs = ltx.random_inputs(model.config, 2, 1, 2, 3, seed=0)
  call = lambda **changes: model(**{k: v for k, v in {**inputs, **changes}.items()
                                    if not (k in changes and v is ...)})
  with pytest.raises(TypeError, match="missing \\['timestep'\\], unexpected \\['guidance'\\]"):
    call(timestep=..., guidance=np.ones(2))
  with pytest.raises(ValueError, match="timestep \\(2, 5\\): pass one per sample \\[2\\] or "
                     "one per token \\[2, 6\\]"):
    call(timestep=np.ones((2, 5), np.float32))
  with pytest.raises(ValueError, match="encoder_attention_mask \\(2, 3\\): pass \\(2, 6\\)"):
    call(encoder_attention_mask=np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match="pass video_coords \\[B, 3, S\\], or num_frames, height"):
    call(video_coords=..., num_frames=1, height=2)
  with pytest.raises(ValueError, match="\\(2, 2, 2\\) is not the 6 tokens"):
    call(video_coords=..., num_frames=2, height=2, width=2)
  with pytest.raises(ValueError, match="video_coords differ across the batch"):
    call(video_coords=inputs["video_coords"] * np.array([1, 2], np.float32)[:, None, None])
  with pytest.raises(ValueError, match="\\(2, 6, 5\\): pass packed latents \\[B, S, 12\\]"):
    call(hidden_states=inputs["hidden_states"][..., :5])
  with pytest.raises(ValueError, match="pass T5 states \\[2, T, 20\\]"):
    call(encoder_hidden_states=inputs["encoder_hidden_states"][..., :4])
  # a scalar timestep, a [B, 1] one and no mask are diffusers' too
  one = model(**{**inputs, "timestep": np.float32(500), "encoder_attention_mask": None})
  same = {"timestep": np.full((2, 1), 500, np.float32),
          "encoder_attention_mask": np.ones((2, 6), np.float32)}
  np.testing.assert_array_equal(one, model(**{**inputs, **same}))


def test_bfloat16_params_and_compute(checkpoints):
  """In bf16 we stay as close to the float32 reference as diffusers' own bf16 forward does, on
  average over samples and timesteps (one sample's error is a matter of luck: 0.7x to 2x)."""
  m = models.load("ltx-video", checkpoints["padded"]["formats"]["single_file_prefixed"],
                  dtype=jnp.bfloat16, progress=False)
  assert m.params["transformer_blocks"]["attn1"]["to_q"]["kernel"].dtype == jnp.bfloat16
  model, ours, theirs = checkpoints["padded"]["torch"], [], []
  for seed in (5, 6):
    for t in (1.0, 360.0, 900.0):
      inputs = {**ltx.random_inputs(m.config, 1, 2, 4, 4, seed=seed),
                "timestep": np.array([t], np.float32)}
      ref = torch_forward(model, inputs)
      theirs.append(rel_err(torch_forward(model, inputs, torch.bfloat16), ref))
      ours.append(rel_err(m(**inputs).astype(jnp.float32), ref))
  assert np.mean(ours) <= 1.5 * np.mean(theirs), (ours, theirs)


def test_rope_at_the_released_widths():
  """At 2048 and 4096 channels the angles reach 1e4 rad, where float32 keeps 1e-3 of them: our
  tables are as close to exact (float64) RoPE as diffusers' are."""
  from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed
  grid = (13, 16, 22)
  ids = layers.grid_positions(grid)
  scale = ltx.pipeline_rope_scale(25)
  for dim in (2048, 4096):
    ours = np.asarray(ltx.rope_tables(ltx.video_coords(ids, scale, ltx.LTXVideoConfig()), dim)[0])
    theirs = LTXVideoRotaryPosEmbed(dim)(torch.zeros(1, len(ids), dim), *grid, scale)[0][0].numpy()
    freqs = 10000.0 ** np.linspace(0, 1, dim // 6) * np.pi / 2
    positions = ids * np.array(scale) / ltx.ROPE_BASE.astype(np.float64)
    angles = freqs[None, :, None] * (2 * positions - 1)[:, None]
    exact = np.concatenate([np.ones((len(ids), dim % 6)),
                            np.repeat(np.cos(angles.reshape(len(ids), -1)), 2, -1)], -1)
    rms = lambda a: np.sqrt(np.mean(np.square(a - exact)))
    assert rms(ours) <= 1.05 * rms(theirs) < 1e-3, (rms(ours), rms(theirs))


def test_default_lora_targets_cover_every_block_linear(loaded):
  targets = lora.select_targets(loaded["padded"].params, ltx.LORA_TARGETS)
  assert sorted(targets) == sorted(f"transformer_blocks.{m}" for m in (
      "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
      "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2"))


# ---- training ------------------------------------------------------------------------------------


def model_config(**kw):
  defaults = dict(frame_rate=24, first_frame_conditioning_p=0.0, shift=1.0)
  return ml_collections.ConfigDict({**defaults, **kw})


def test_training_inputs_are_what_the_pipeline_passes(checkpoints, loaded):
  """A cached batch through `training_inputs` gives what diffusers computes from LTXPipeline's
  inputs at the configured frame rate: timestep sigma * 1000, RoPE of the latent grid."""
  model, grid = loaded["padded"], (3, 2, 5)
  batch = ltx.random_batch(model.config, 2, *grid, txt_len=4, seed=3)
  t = np.array([0.25, 0.8], np.float32)
  inputs = ltx.training_inputs(model_config(), model.config, batch, batch["latents"], t)
  assert inputs["video_coords"].shape == (3, 30)
  out = model.module.apply({"params": model.params}, **inputs)
  ref = torch_forward(checkpoints["padded"]["torch"], dict(
      hidden_states=batch["latents"], encoder_hidden_states=batch["text"],
      encoder_attention_mask=batch["text_mask"], timestep=t * 1000, num_frames=grid[0],
      height=grid[1], width=grid[2], rope_interpolation_scale=(8 / 24, 32, 32)))
  assert_close(out, ref)


def test_first_frame_conditioning(loaded):
  """With p = 1 every video's first latent frame is the clean latents at t = 0 and out of the
  loss, an image's never; with p = 0.5 about half the videos; with p = 0 nothing changes."""
  cfg = loaded["padded"].config
  condition = lambda p: jax.jit(lambda *args: ltx.condition(
      model_config(first_frame_conditioning_p=p), cfg, *args))
  video = ltx.random_batch(cfg, 64, 3, 2, 2, seed=1)
  image = ltx.random_batch(cfg, 64, 1, 2, 2, seed=2)
  first = video["position_ids"][..., 0] == 0
  t = jnp.linspace(0.1, 0.9, 64)
  key = jax.random.key(0)
  for batch, clean in ((video, first), (image, np.zeros_like(first[:, :4]))):
    noisy = batch["latents"] + 1.0
    same, t0, mask = ltx.condition(model_config(), cfg, key, batch, noisy, t)
    assert same is noisy and t0 is t and mask is None
    out, tt, mask = condition(1.0)(key, batch, noisy, t)
    np.testing.assert_array_equal(out, np.where(clean[..., None], batch["latents"], noisy))
    np.testing.assert_array_equal(tt, np.where(clean, 0.0, np.asarray(t)[:, None]))
    np.testing.assert_array_equal(mask, ~clean)
  _, tt, mask = condition(0.5)(key, video, video["latents"], t)
  chosen = np.asarray(mask == 0).any(-1)
  assert 16 < chosen.sum() < 48
  np.testing.assert_array_equal(np.asarray(mask == 0), first & chosen[:, None])
  np.testing.assert_array_equal(tt == 0, first & chosen[:, None])
