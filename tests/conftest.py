import atexit
import contextlib
import importlib
import inspect
import logging
import os
import platform
import shutil
import tempfile

# One persistent compilation cache for the test session, inherited by the subprocesses: the
# main.py runs compile the same programs again and again (tests/test_train.py took 257 s with
# it, 315 s without, on 2 cores). Set before anything imports jax.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="diffpipe_jax_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# The tests compile many small programs and run each a few times: XLA's CPU backend without
# LLVM's optimisations compiles them about a third faster (the tiny HunyuanVideo run's three
# buckets: 27 s -> 17 s). Every run of a test uses the same flags, so comparisons are unaffected.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), TEST_XLA_FLAGS]))


def xla_flags(devices):
  """XLA_FLAGS for a subprocess with `devices` CPU devices: the session's, and the device count."""
  return f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}"


import pytest  # noqa: E402

from diffpipe_jax import family as family_lib  # noqa: E402

# Every registered family: the generic tests run over each one's tiny model (its torch side's
# `build_tiny` and `save_tiny`), so a new family gets them by registering.
FAMILIES = family_lib.names()
# The trainer's machinery around the step (signals, several processes, a resume's refusals,
# config errors, a diverging run, restoring into swapped or unrolled data-parallel placements) is
# the same code for every family: it is tested on one, the tiny model with videos and images
# that compiles fastest. What a family's model changes (its stacks over stages, swapped blocks,
# its export) is tested for every family.
MACHINERY_FAMILY = "ltx-video"


def cpu():
  """The CPU's name and the vector extensions of those XLA compiles for that it has (from
  /proc/cpuinfo, where there is one)."""
  try:
    with open("/proc/cpuinfo") as f:
      first = f.read().split("\n\n")[0]
  except OSError:
    first = ""
  fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
  name = fields.get("model name") or platform.processor() or platform.machine()
  vector = [ext for ext in ("avx512f", "avx2", "fma") if ext in fields.get("flags", "").split()]
  return f"{name} ({' '.join(vector)})" if vector else name


def machine():
  """The lines that name the machine: XLA compiles for the CPU it runs on (its vector width, its
  FMA), so float32 results differ in their last bits between machines (tests/tolerances.py)."""
  import jax
  import jaxlib
  return [f"cpu: {cpu()}, {os.cpu_count()} cores",
          f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, XLA_FLAGS: {os.environ['XLA_FLAGS']}"]


def pytest_report_header(config):
  return machine()


def pytest_terminal_summary(terminalreporter, config):
  """-q (CI's) writes no header: the machine goes under the results instead."""
  if config.get_verbosity() < 0:
    for line in machine():
      terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
  """name -> dict(family, torch: its tiny transformer, formats: {format: path}), each family's
  built on first use; **config: another tiny model of that family."""
  built = {}

  def get(name, seed=1, **config):
    key = (name, seed, tuple(sorted(config.items())))
    if key not in built:
      fam = family_lib.get(name)
      side = family_lib.torch_side(fam)
      model = side.build_tiny(seed=seed, **config)
      built[key] = dict(family=fam, torch=model,
                        formats=side.save_tiny(model, str(tmp_path_factory.mktemp(name))))
    return built[key]
  return get


@pytest.fixture(scope="module")
def flux(tiny_models):
  """Our tiny FLUX.1, loaded from its diffusers folder."""
  from diffpipe_jax import models
  return models.load("flux", tiny_models("flux")["formats"]["diffusers"], progress=False)


@pytest.fixture(params=FAMILIES)
def tiny_model(request, tiny_models):
  """Each family's tiny model in turn (a generic test's parameter)."""
  return tiny_models(request.param)


@pytest.fixture(scope="session")
def flux_checkpoints(tiny_models):
  """Tiny FLUX.1 dev and schnell models (torch) and their files in every format."""
  dev, schnell = tiny_models("flux"), tiny_models("flux", seed=2, guidance_embeds=False)
  return {variant: dict(torch=m["torch"], **m["formats"]) for variant, m in
          (("dev", dev), ("schnell", schnell))}


def jaxpr_equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs its equations call."""
  import jax
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
          yield from jaxpr_equations(getattr(sub, "jaxpr", sub))


def family_config(name, variant="tiny"):
  """configs/<family>.py's config (`name` is the model.type: "ltx-video" -> ltx_video.py)."""
  return importlib.import_module(f"diffpipe_jax.configs.{name.replace('-', '_')}").get_config(variant)


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


@contextlib.contextmanager
def transformers_log():
  """The records transformers logs for its users meanwhile (it writes them to stderr itself)."""
  records, handler = [], logging.Handler()
  handler.emit = records.append
  logger = logging.getLogger("transformers")
  logger.addHandler(handler)
  try:
    yield records
  finally:
    logger.removeHandler(handler)


def load_encoders(name, pipeline, model=(), **options):
  """The family's encoders of a tiny pipeline folder, on the CPU: `model` keys set in the model
  config, `options` passed to the encoders."""
  model_config = family_config(name).model
  model_config.diffusers_path = pipeline
  model_config.update(dict(model))
  return family_lib.torch_side(family_lib.get(name)).load_encoders(model_config, device="cpu", **options)


# A family's torch-side test module names its family (`FAMILY`) and diffusers pipeline class
# (`PIPELINE`); these fixtures give it the tiny pipeline's folder, the pipeline and our encoders.
@pytest.fixture(scope="module")
def pipeline(request, tiny_pipelines):
  return tiny_pipelines(request.module.FAMILY)


@pytest.fixture(scope="module")
def pipe(request, pipeline):
  return request.module.PIPELINE.from_pretrained(pipeline).to("cpu")


@pytest.fixture(scope="module")
def encoders(request, pipeline):
  enc = load_encoders(request.module.FAMILY, pipeline)
  yield enc
  enc.release()


@contextlib.contextmanager
def diffusers_hidden_size(hidden_size):
  """diffusers' HunyuanVideo conversions (`convert_hunyuan_video_transformer_to_diffusers` and
  the LoRA converter `load_lora_weights` runs) split `linear1` at a hard-coded hidden size of
  3072, the released model's, so a tiny model fails in them. This runs their own source with
  the tiny model's size instead, nothing else changed (REFERENCE-video.md, section 7)."""
  from diffusers.loaders import lora_conversion_utils, lora_pipeline, single_file_utils
  patched = []
  for module, name, users in (
      (single_file_utils, "convert_hunyuan_video_transformer_to_diffusers", ()),
      (lora_conversion_utils, "_convert_hunyuan_video_lora_to_diffusers", (lora_pipeline,))):
    source = inspect.getsource(getattr(module, name))
    assert source.count("hidden_size = 3072") == 1, name  # what this works around is still there
    namespace = dict(vars(module))
    exec(source.replace("hidden_size = 3072", f"hidden_size = {hidden_size}"), namespace)
    for owner in (module, *users):
      patched.append((owner, name, getattr(owner, name)))
      setattr(owner, name, namespace[name])
  try:
    yield
  finally:
    for owner, name, original in patched:
      setattr(owner, name, original)


def load_lora_in_diffusers(fam, torch_model, path, adapter_name):
  """Loads our exported LoRA into the torch transformer as a user does, through the family's
  diffusers pipeline (its key conversions included; only the transformer is needed, the other
  components may be absent). Returns the names of the modules that got the adapter."""
  import diffusers
  pipeline = getattr(diffusers, family_lib.torch_side(fam).pipeline)
  components = {n: None for n in inspect.signature(pipeline.__init__).parameters if n != "self"}
  # diffusers' HunyuanVideo LoRA converter splits fused weights at the released width only
  width = torch_model.config.num_attention_heads * torch_model.config.attention_head_dim
  with diffusers_hidden_size(width) if fam.type == "hunyuan-video" else contextlib.nullcontext():
    pipeline(**dict(components, transformer=torch_model)).load_lora_weights(
        path, adapter_name=adapter_name)
  return {n for n, m in torch_model.named_modules() if hasattr(m, "lora_A") and adapter_name in m.lora_A}


def diffusers_modules(fam, modules):
  """The diffusers modules our exported ones are (a fused one is several: the family's rows)."""
  from diffpipe_jax.convert import table
  if fam.diffusers_rows is None:
    return set(modules)
  sources = table.row_sources(fam.diffusers_rows, {m + ".weight": (2, 2) for m in modules}, "parts")
  assert set(sources) == {m + ".weight" for m in modules}  # every exported module has its row
  return {key.rsplit(".", 1)[0] for pieces in sources.values() for key, _ in pieces}
