import os

import pytest

from diffpipe_jax import tiny


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
