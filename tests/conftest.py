import os

import numpy as np
import pytest

from diffpipe_jax import tiny


def flux_inputs(batch, h, w, txt_len, guidance, in_channels=16, joint_dim=24, pooled_dim=20, seed=0):
  """Random packed latents and text of the given sizes, with FluxPipeline's position ids."""
  rng = np.random.default_rng(seed)
  img_ids = np.zeros((h, w, 3), np.float32)
  img_ids[..., 1] = np.arange(h)[:, None]
  img_ids[..., 2] = np.arange(w)[None, :]
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  return dict(
      hidden_states=f(batch, h * w, in_channels), encoder_hidden_states=f(batch, txt_len, joint_dim),
      pooled_projections=f(batch, pooled_dim),
      timestep=rng.uniform(0.05, 1.0, batch).astype(np.float32),
      img_ids=img_ids.reshape(-1, 3), txt_ids=np.zeros((txt_len, 3), np.float32),
      guidance=rng.uniform(1.0, 5.0, batch).astype(np.float32) if guidance else None)


@pytest.fixture(scope="session")
def flux_checkpoints(tmp_path_factory):
  """Tiny dev and schnell models (torch) and their files in every supported layout."""
  root = tmp_path_factory.mktemp("flux")
  out = {}
  for variant, guidance in (("dev", True), ("schnell", False)):
    model = tiny.build_flux(seed=1 if guidance else 2, guidance_embeds=guidance)
    base = root / variant
    out[variant] = dict(
        torch=model,
        diffusers=tiny.save_flux_diffusers(model, str(base / "pipeline")),
        diffusers_sharded=tiny.save_flux_diffusers(model, str(base / "sharded"), max_shard_size="40KB"),
        bfl=tiny.save_flux_single_file(model, str(base / "flux1.safetensors")),
        bfl_prefixed=tiny.save_flux_single_file(model, str(base / "flux1_comfy.safetensors"),
                                                prefix="model.diffusion_model."))
  assert any(f.endswith(".index.json") for f in os.listdir(root / "dev" / "sharded" / "transformer"))
  return out
