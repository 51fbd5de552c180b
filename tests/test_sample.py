"""Sampling: each family's sampler equals its diffusers pipeline (with a LoRA in both), and
the sampling command runs end to end."""
import contextlib
import dataclasses
import os

import diffusers
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch

from conftest import FAMILIES, diffusers_hidden_size, family_config, jaxpr_equations, load_encoders
from tolerances import FLOAT32_REORDERING, LORA_PARITY, assert_close, rel_err
from diffpipe_jax.errors import UserError
from diffpipe_jax import family as family_lib, lora, models, programs, runtime, sample, sampling, sharding

# a size of a few latent tokens per family: (frames, height, width) in pixels
SIZES = {"flux": (1, 32, 48), "ltx-video": (9, 64, 96), "hunyuan-video": (5, 32, 48), "wan": (5, 32, 48)}
PROMPTS = ["a red pattern, number 3", "blue"]


def tiny_model_config(name, folder):
  model_config = family_config(name).model
  model_config.diffusers_path = folder
  return model_config


@pytest.fixture(params=FAMILIES)
def pipeline_folder(request, tiny_pipelines):
  return request.param, tiny_pipelines(request.param)


def released_scheduler(released: dict):
  """The diffusers scheduler that a released scheduler config names."""
  name = released.get("_class_name", "FlowMatchEulerDiscreteScheduler")
  return getattr(diffusers, name)(**{k: v for k, v in released.items() if k != "_class_name"})


def test_schedules_are_the_schedulers(pipeline_folder):
  """Our timesteps and sigmas against the set_timesteps of the scheduler of the family's released
  config (the tiny pipeline's scheduler may differ), at two sizes."""
  name, folder = pipeline_folder
  fam = family_lib.get(name)
  cfg = models.checkpoint_config(name, fam.checkpoint_path(tiny_model_config(name, folder)))
  released = fam.sampling.scheduler(cfg)
  scheduler = released_scheduler(released)
  solver = sampling.solver(released, fam.sampling.spacing)
  for steps, tokens in ((7, 300), (28, 4096)):
    base = {"1/N": np.linspace(1.0, 1 / steps, steps), "0": np.linspace(1.0, 0.0, steps + 1)[:-1],
            "scheduler": None}[fam.sampling.spacing]  # (none passed: the scheduler's own)
    mu = ((tokens - released["base_image_seq_len"]) * (released["max_shift"] - released["base_shift"])
          / (released["max_image_seq_len"] - released["base_image_seq_len"]) + released["base_shift"]
          if released.get("use_dynamic_shifting") else None)
    scheduler.set_timesteps(steps, sigmas=base, mu=mu)
    timesteps, coefficients = solver.schedule(steps, tokens)
    np.testing.assert_allclose(coefficients[:, 0], scheduler.sigmas.numpy()[:-1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(timesteps * 1000, scheduler.timesteps.numpy(), rtol=1e-6)


@pytest.mark.parametrize("settings", [
    {}, dict(solver_order=3, flow_shift=5.0), dict(lower_order_final=False, final_sigmas_type="sigma_min"),
    dict(disable_corrector=[1, 3], solver_order=1)], ids=str)
def test_unipc_steps_are_the_schedulers(settings):
  """UniPC's steps from precomputed coefficients (`sampling.unipc_update`) against
  UniPCMultistepScheduler.step over flow sigmas, with the velocity of a fixed nonlinear function
  of the latents and the timestep, for several orders and options and step counts."""
  released = dict(_class_name="UniPCMultistepScheduler", prediction_type="flow_prediction",
                  use_flow_sigmas=True, **{"flow_shift": 3.0, **settings})
  scheduler, solver = released_scheduler(released), sampling.solver(released, "scheduler")
  rng = np.random.default_rng(0)
  x0, w = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32)
  velocity = lambda x, t: np.tanh(x @ w) * (1 + t / 1000)
  for steps in (1, 2, 6, 13):
    scheduler.set_timesteps(steps)
    want = torch.from_numpy(x0)
    for t in scheduler.timesteps:
      want = scheduler.step(torch.from_numpy(velocity(want.numpy(), float(t))), t, want).prev_sample
    timesteps, coefficients = solver.schedule(steps, 100)
    x, history = jnp.asarray(x0), (jnp.zeros_like(x0),) * solver.carries
    for t, row in zip(timesteps, coefficients):
      x, history = solver.update(x, jnp.asarray(velocity(np.asarray(x), float(t) * 1000)), row, history)
    assert_close(x, want.numpy(), bound=FLOAT32_REORDERING)


def test_unsupported_schedulers_are_refused():
  with pytest.raises(UserError, match="DDIMScheduler is not supported"):
    sampling.solver(dict(_class_name="DDIMScheduler"), "scheduler")
  with pytest.raises(UserError, match="'prediction_type': 'epsilon'"):
    sampling.solver(dict(_class_name="UniPCMultistepScheduler", use_flow_sigmas=True), "scheduler")


def pipeline_kwargs(fam, conditioning, uncond):
  """Our cached text fields as the diffusers pipeline's prompt arguments."""
  names = dict(text="prompt_embeds", pooled="pooled_prompt_embeds", text_mask="prompt_attention_mask")
  kw = {names[k]: torch.from_numpy(np.asarray(v)) for k, v in conditioning.items() if k in names}
  if fam.sampling.guidance_mode == "cfg":
    n = len(PROMPTS)
    kw |= {f"negative_{names[k]}": torch.from_numpy(np.repeat(v, n, 0)) for k, v in uncond.items()}
  return kw


def test_latents_equal_the_diffusers_pipeline_with_a_lora(pipeline_folder, tmp_path):
  name, folder = pipeline_folder
  fam = family_lib.get(name)
  model_config = tiny_model_config(name, folder)
  model = models.load(name, fam.checkpoint_path(model_config), progress=False)
  encoders = load_encoders(name, folder)
  frames, height, width = SIZES[name]
  grid = encoders.latent_grid(frames, height, width)
  conditioning = encoders.encode_text(PROMPTS, frames)
  uncond = encoders.encode_text([""], frames)
  if fam.position_ids is not None:
    conditioning["position_ids"] = np.stack([fam.position_ids(grid)] * len(PROMPTS))
  shape = fam.sampling.latent_shape(model.config, grid)
  noise = np.random.default_rng(0).standard_normal((len(PROMPTS), *shape)).astype(np.float32)
  adapter = lora.init(model.params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  leaves, tree = jax.tree.flatten(adapter)
  adapter = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(jax.random.key(i), x.shape)
                                      for i, x in enumerate(leaves)])
  steps, guidance = 4, 4.5
  step = sampling.step_fn(model, model_config, guidance)  # compiled once: the base is B = 0
  ours, base = (sampling.denoise(model, model.params, a, model_config, conditioning, noise, grid, steps,
                               guidance, uncond=uncond, step=step)
                for a in (adapter, jax.tree.map(jnp.zeros_like, adapter)))

  pipe = getattr(diffusers, family_lib.torch_side(fam).pipeline).from_pretrained(folder)
  width_hint = model.config.num_attention_heads * model.config.attention_head_dim
  with diffusers_hidden_size(width_hint) if name == "hunyuan-video" else contextlib.nullcontext():
    pipe.load_lora_weights(lora.save(adapter, str(tmp_path / "lora"), fam, 4, np.float32))
  video = dict(num_frames=frames, frame_rate=model_config.frame_rate) if name == "ltx-video" else (
      dict(num_frames=frames) if frames > 1 else {})
  run = lambda output_type: pipe(
      **pipeline_kwargs(fam, {k: v for k, v in conditioning.items() if k != "position_ids"}, uncond),
      latents=torch.from_numpy(noise), height=height, width=width, num_inference_steps=steps,
      guidance_scale=guidance, output_type=output_type, return_dict=False, **video)[0]
  with torch.no_grad():
    want = run("latent").numpy()
  assert_close(ours, want, bound=LORA_PARITY)
  assert rel_err(base, want) > 1e-3  # the LoRA changes the samples
  # decoded as the pipeline decodes: its [0, 1] pixels. LTX-Video's decoder adds fresh random
  # noise inside its resnets (where it has `per_channel_scale`s), so both decode without it here.
  for vae in (pipe.vae, encoders.vae):
    for module in vae.modules():
      if getattr(module, "per_channel_scale1", None) is not None:
        module.per_channel_scale1 = module.per_channel_scale2 = None
  with torch.no_grad():
    pixels = np.asarray(run("np")).reshape(len(PROMPTS), frames, height, width, 3)
  decoded = encoders.decode_media(want, grid)
  assert decoded.shape == pixels.shape
  np.testing.assert_allclose((decoded + 1) / 2, pixels, atol=2e-3)


def randomised_adapter(params, fam, patterns, rank, seed):
  adapter = lora.init(params, patterns, rank, jnp.float32, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(adapter)
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(jax.random.key(seed + i), x.shape)
                                   for i, x in enumerate(leaves)])


def test_the_modulations_are_computed_ahead_of_the_steps(tiny_model):
  """Every value the model marks `ahead` (its AdaLN modulations) is computed once for all the
  steps, none in a step; the steps as programs per block over unrolled layers (as the sampling
  command runs them) give the latents of one program a step over scanned layers."""
  fam = tiny_model["family"]
  name, path = fam.type, tiny_model["formats"]["diffusers"]
  cfg = models.checkpoint_config(name, path)
  model_config = family_config(name).model
  batch = fam.random_batch(cfg, 2)
  noise = batch.pop("latents")
  uncond = {k: v[:1] for k, v in batch.items() if k != "position_ids"}
  calls = []  # the arguments of each call of `ahead` and `step`
  record = lambda fn: lambda *a: calls.append(a) or fn(*a)
  draw = lambda model, steps: np.asarray(sampling.denoise(
      model, model.params, None, model_config, batch, noise, (16,), 3, 4.0, uncond, steps))

  scanned = models.load(name, path, progress=False)
  steps = sampling.step_fn(scanned, model_config, 4.0)
  recorded = lambda steps: dataclasses.replace(steps, ahead=record(steps.ahead), step=record(steps.step))
  latents = draw(scanned, recorded(steps))
  (_, params, rows, (x, _), *_), step_args = calls[:2]
  marked = lambda closed: sum(e.params.get("name") == programs.AHEAD
                              for e in jaxpr_equations(closed.jaxpr))
  latents_of_rows = np.concatenate([x] * (len(rows["text"]) // len(x)))
  forward = lambda p: scanned.module.apply({"params": p}, **fam.training_inputs(
      model_config, cfg, rows, latents_of_rows, jnp.ones(len(latents_of_rows))))
  assert len(step_args[0]) == marked(jax.make_jaxpr(forward)(params)) > 0  # a value a mark
  assert marked(steps.step.trace(*step_args).jaxpr) == 0

  placement = sharding.make_placement(sharding.make_mesh(1, jax.devices()[:1]), fam.stacks(cfg), 1,
                                      unrolled=True)
  unrolled = models.load(name, path, runtime=runtime.Runtime.of(placement), placement=placement,
                         progress=False)
  per_block = sampling.step_fn(unrolled, model_config, 4.0)
  assert_close(draw(unrolled, recorded(per_block)), latents)
  # ... whose layers still share their stack's program
  forward = lambda p: unrolled.runtime.apply(unrolled.module, {"params": p}, **fam.training_inputs(
      model_config, cfg, rows, latents_of_rows, jnp.ones(len(latents_of_rows))))
  blocks = [e.params["jaxpr"] for e in jaxpr_equations(jax.make_jaxpr(forward)(unrolled.params).jaxpr)
            if programs.block_call(e)]
  assert len(blocks) == sum(n for _, n, _ in fam.stacks(cfg))
  assert len(set(map(id, blocks))) == len(fam.stacks(cfg))


def test_a_lora_file_is_read_with_its_own_targets_rank_and_alpha(tiny_models, tmp_path):
  tiny = tiny_models("flux")
  fam, model = tiny["family"], models.load("flux", tiny["formats"]["diffusers"], progress=False)
  part = randomised_adapter(model.params, fam, [r"transformer_blocks\.attn\.to_q",
                                                r"single_transformer_blocks\.proj_out"], 3, 1)
  path = lora.save(part, str(tmp_path / "part"), fam, 3, np.float32)
  read = lora.read(path, model.params, fam)
  assert jax.tree.structure(read) == jax.tree.structure(part)
  for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(part)):
    np.testing.assert_array_equal(a, b)
  # a PEFT config whose alpha is not the rank scales the update as PEFT does
  config = tmp_path / "part" / "adapter_config.json"
  config.write_text(config.read_text().replace('"lora_alpha": 3', '"lora_alpha": 6'))
  doubled = lora.read(str(tmp_path / "part"), model.params, fam)
  np.testing.assert_allclose(doubled["transformer_blocks"]["attn.to_q"]["lora_B"],
                             2 * part["transformer_blocks"]["attn.to_q"]["lora_B"], rtol=1e-6)
  with pytest.raises(ValueError, match="holds no transformer.*lora_A/B weights"):
    lora.read(str(tiny["formats"]["diffusers"] + "/transformer/diffusion_pytorch_model.safetensors"),
              model.params, fam)


def test_loras_combine_into_the_sum_of_their_updates(tiny_models):
  tiny = tiny_models("flux")
  fam, model = tiny["family"], models.load("flux", tiny["formats"]["diffusers"], progress=False)
  a = randomised_adapter(model.params, fam, fam.lora_targets, 4, 1)
  b = randomised_adapter(model.params, fam, [r"transformer_blocks\.attn\.to_q"], 2, 7)
  combined = lora.combine([lora.scaled(a, 0.5), b])
  update = lambda adapter, m: adapter[m[0]][m[1]]["lora_A"] @ adapter[m[0]][m[1]]["lora_B"]
  for m in (("transformer_blocks", "attn.to_q"), ("single_transformer_blocks", "proj_out")):
    want = 0.5 * update(a, m) + (update(b, m) if m[1] in b.get(m[0], {}) else 0)
    assert_close(update(combined, m), want, what=str(m))


def test_the_sampling_command_draws_with_loras(tmp_path, tiny_models, monkeypatch):
  """`python -m diffpipe_jax.sample` on the tiny default: a JPEG (as `--out` names it) and its
  prompt; in-process (PNGs of the requested size) (`sample.run`, what the command calls), a LoRA at scale 0 draws the base
  model, and a missing LoRA is a one-line error before anything loads."""
  import subprocess
  import sys
  from PIL import Image
  from diffpipe_jax.errors import UserError
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tiny = tiny_models("flux")
  model = models.load("flux", tiny["formats"]["diffusers"], progress=False)
  path = lora.save(randomised_adapter(model.params, tiny["family"], tiny["family"].lora_targets, 4, 3),
                   str(tmp_path / "lora"), tiny["family"], 4, np.float32)
  run = subprocess.run(
      [sys.executable, "-m", "diffpipe_jax.sample", "--config", os.path.join(root, "configs", "flux.py:tiny"),
       "--prompt", "a red pattern", "--height", "24", "--width", "40", "--out", str(tmp_path / "one.jpg"),
       f"--lora={path}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  assert run.returncode == 0 and f"wrote {tmp_path / 'one.jpg'}" in run.stdout, run.stdout
  assert (tmp_path / "one.txt").read_text() == "a red pattern\n"
  assert Image.open(tmp_path / "one.jpg").format == "JPEG"
  monkeypatch.chdir(tmp_path)  # the tiny default's paths, as the command had them
  config = family_config("flux")
  draw = lambda out, *loras: sample.run(config, loras, ["a red pattern"], str(tmp_path / out), height=24,
                                        width=40)
  draw("base.png")
  draw("zero.png", f"{path}:0")
  pixels = {out: np.asarray(Image.open(tmp_path / out)) for out in ("base.png", "zero.png", "one.jpg")}
  assert pixels["base.png"].shape == (24, 40, 3)
  np.testing.assert_array_equal(pixels["zero.png"], pixels["base.png"])
  assert np.abs(pixels["one.jpg"].astype(int) - pixels["base.png"]).max() > 2
  with pytest.raises(UserError, match="^--lora missing.safetensors does not exist$"):
    draw("odd.png", "missing.safetensors")
  with pytest.raises(UserError, match="^--lora_2 is for the second expert of a checkpoint of two"):
    sample.run(config, [], ["a red pattern"], str(tmp_path / "odd.png"), loras_2=[path])


def test_out_is_a_folder_or_a_file_in_its_format_and_one_that_cannot_hold_the_samples_is_one_line(tmp_path):
  from diffpipe_jax.errors import UserError
  assert sample.output_paths("out.jpg", 1, 1) == ["out.jpg"]
  assert sample.output_paths("out.webp", 2, 1) == ["out_00.webp", "out_01.webp"]  # several prompts
  assert sample.output_paths("clips", 2, 9) == ["clips/00.mp4", "clips/01.mp4"]
  (tmp_path / "v1.5").mkdir()  # an existing folder, whatever its name
  assert sample.output_paths(str(tmp_path / "v1.5"), 1, 1) == [str(tmp_path / "v1.5" / "00.png")]
  with pytest.raises(UserError, match=r"^--out l\.png: each sample is a video of 9 frames; name a \.mp4 "
                                      r"or \.webm file, or a folder \(a path without extension\)$"):
    sample.output_paths("l.png", 1, 9)
  with pytest.raises(UserError, match=r"^--out out\.gif: each sample is an image; name a \.png, \.jpg, "
                                      r"\.jpeg or \.webp file"):
    sample.output_paths("out.gif", 1, 1)


def test_a_lora_scale_that_is_not_a_number_is_one_line(tmp_path):
  from diffpipe_jax.errors import UserError
  assert sample.lora_argument("a.safetensors:0.5") == ("a.safetensors", 0.5)
  assert sample.lora_argument("a.safetensors") == ("a.safetensors", 1.0)
  (tmp_path / "run:1").mkdir()  # a path with a colon of its own
  assert sample.lora_argument(str(tmp_path / "run:1")) == (str(tmp_path / "run:1"), 1.0)
  with pytest.raises(UserError, match=r"^the scale 'abc' of --lora path:abc is not a number \(--lora PATH "
                                      r"or PATH:SCALE\)$"):
    sample.lora_argument("path:abc")


def test_the_default_sample_size_is_the_first_resolution_rounded_down_to_the_vaes_multiple():
  config = ml_collections.ConfigDict(dict(dataset=dict(resolutions=(627,), toml_path=""), sample_frames=1,
                                          sample_height=0, sample_width=0))
  assert sampling.size(config, 32) == (1, 608, 608)  # 768x512's resolution, as the buckets round
  assert sampling.size(config, 16) == (1, 624, 624)
  config.sample_width = 768
  assert sampling.size(config, 32) == (1, 608, 768)  # a size given is kept (and checked: below)


def test_a_sample_size_the_vae_cannot_take_is_one_line():
  import types
  video = types.SimpleNamespace(pixel_multiple=16, frames_per_latent=4)
  assert sampling.checked_size(video, 33, 32, 48) == (33, 32, 48)
  with pytest.raises(ValueError, match=r"^sample size: width 40 is not a multiple of 16; frames 6 is not 1 \+ 4k$"):
    sampling.checked_size(video, 6, 32, 40)
  with pytest.raises(ValueError, match="this family draws images: frames must be 1, not 5"):
    sampling.checked_size(types.SimpleNamespace(pixel_multiple=16, frames_per_latent=None), 5, 32, 32)


def test_decoding_short_of_gpu_memory_tiles_then_moves_to_the_cpu(pipeline_folder, monkeypatch):
  """Beside JAX's pool PyTorch may run out of GPU memory decoding a sample (a 24 GB card): the
  decode is tried again with the VAE tiled, then with the VAE on the CPU in float32. (Here the
  "GPU" is the CPU in bfloat16 and running out is simulated: decode_media fails the first `n`
  times. Tiles are blended at their seams, so a tiled decode is not the plain one: at these
  tiny sizes, where the VAEs' tiles are a few pixels, not even close.)"""
  name, folder = pipeline_folder
  frames, height, width = SIZES[name]
  pixels = np.random.default_rng(0).uniform(-1, 1, (1, frames, height, width, 3)).astype(np.float32)
  grid = load_encoders(name, folder).latent_grid(frames, height, width)
  latents = load_encoders(name, folder).encode_media(pixels)
  want = load_encoders(name, folder).decode_media(latents, grid)
  for n, tiled, dtype in ((0, False, torch.bfloat16), (1, True, torch.bfloat16), (2, True, torch.float32)):
    enc = load_encoders(name, folder, dtype=torch.bfloat16)
    decode_media, failures = enc.decode_media, [n]
    def short_of_memory(*args):
      failures[0] -= 1
      if failures[0] >= 0:
        raise torch.OutOfMemoryError("simulated")
      return decode_media(*args)
    monkeypatch.setattr(enc, "decode_media", short_of_memory)
    got = enc.decode(latents, grid)
    assert (bool(getattr(enc.vae, "use_tiling", False)), enc.vae.dtype) == (tiled, dtype), n
    assert got.shape == want.shape and (tiled or rel_err(got, want) < 0.05), (n, rel_err(got, want))
  failures[0] = 3
  with pytest.raises(torch.OutOfMemoryError):
    enc.decode(latents, grid)  # no third way: the error stands


def test_the_negative_prompt_is_the_unconditional_row(tiny_pipelines):
  fam, folder = family_lib.get("wan"), tiny_pipelines("wan")
  encoders = load_encoders("wan", folder)
  prompts = sampling.encode_prompts(fam, encoders, ["blue"], *SIZES["wan"], negative="blurry, static")
  np.testing.assert_array_equal(prompts.uncond["text"], encoders.encode_text(["blurry, static"])["text"])
  assert not np.array_equal(prompts.uncond["text"], encoders.encode_text([""])["text"])
  with pytest.raises(UserError, match="sample_negative_prompt: this family's guidance is embedded"):
    sampling.encode_prompts(family_lib.get("flux"), load_encoders("flux", tiny_pipelines("flux")),
                            ["blue"], *SIZES["flux"], negative="blurry")
