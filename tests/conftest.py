import atexit
import importlib
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

from diffpipe_jax import family as family_lib  # noqa: E402

# Every registered family: the generic tests run over each one's tiny model (its torch side's
# `build_tiny` and `save_tiny`), so a new family gets them by registering.
FAMILIES = family_lib.names()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
  """name -> dict(family, torch: its tiny transformer, layouts: {layout: path}), each family's
  built on first use; **config: another tiny model of that family."""
  built = {}

  def get(name, seed=1, **config):
    key = (name, seed, tuple(sorted(config.items())))
    if key not in built:
      fam = family_lib.get(name)
      side = family_lib.torch_side(fam)
      model = side.build_tiny(seed=seed, **config)
      built[key] = dict(family=fam, torch=model,
                        layouts=side.save_tiny(model, str(tmp_path_factory.mktemp(name))))
    return built[key]
  return get


@pytest.fixture(params=FAMILIES)
def tiny_model(request, tiny_models):
  """Each family's tiny model in turn (a generic test's parameter)."""
  return tiny_models(request.param)


@pytest.fixture(scope="session")
def flux_checkpoints(tiny_models):
  """Tiny FLUX.1 dev and schnell models (torch) and their files in every layout."""
  dev, schnell = tiny_models("flux"), tiny_models("flux", seed=2, guidance_embeds=False)
  return {variant: dict(torch=m["torch"], **m["layouts"]) for variant, m in
          (("dev", dev), ("schnell", schnell))}


def family_config(name, variant="tiny"):
  """configs/<family>.py's config (`name` is the model.type: "ltx-video" -> ltx_video.py)."""
  return importlib.import_module(f"configs.{name.replace('-', '_')}").get_config(variant)


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory):
  """name -> a complete tiny pipeline folder of that family (its torch side's), written once."""
  written = {}

  def get(name):
    if name not in written:
      fam = family_lib.get(name)
      written[name] = family_lib.torch_side(fam).write_tiny_pipeline(str(tmp_path_factory.mktemp(name)))
    return written[name]
  return get


def load_encoders(name, pipeline, **options):
  """The family's encoders of a tiny pipeline folder, on the CPU."""
  model_config = family_config(name).model
  model_config.diffusers_path = pipeline
  return family_lib.torch_side(family_lib.get(name)).load_encoders(model_config, device="cpu", **options)
