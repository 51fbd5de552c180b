import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the test session, inherited by the subprocesses: the
# main.py runs compile the same programs again and again (tests/test_train.py took 257 s with
# it, 315 s without, on 2 cores). Set before anything imports jax.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="diffpipe_jax_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402

from diffpipe_jax import tiny  # noqa: E402


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
