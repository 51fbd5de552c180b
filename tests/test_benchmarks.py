"""The GPU benchmark scripts run end to end on a tiny shape (CPU): the benchmark is not a test,
but a broken benchmark script should not wait for a GPU session to be found."""
import collections
import functools
import glob
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import full_job, full_size, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a PyTorch peer whose run without checkpointing runs out of GPU memory, as at --res 2048
OOM_PEER = """import json, sys
import torch
if sys.argv[sys.argv.index("--ckpt") + 1] == "0":
  raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
print(json.dumps(dict(step_s_median=2.0, peak_mem_gib=None)))  # no peak off the GPU
"""


def test_flux_forward_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "flux_forward.py"), "--smoke",
                        "--workdir", str(tmp_path)], env=env, check=True, stdout=subprocess.PIPE,
                       text=True).stdout
  assert "load from diffusers folder (s)" in out
  err = float(out.split("rel. error vs diffusers bf16")[1].split("|")[2])
  assert err < 2e-2, out


# a PyTorch peer that checks it is asked for the same video shape
VIDEO_PEER = """import json, sys
args = " ".join(sys.argv[1:])
assert "--res 64 --width 64 --frames 9 --txt 8 --rank 4" in args, args
assert sys.argv[2] in ("ltx", "hunyuan", "wan"), args
print(json.dumps(dict(step_s_median=0.5, peak_mem_gib=None)))
"""


@pytest.mark.parametrize("model,title", [
    ("ltx-video", "LTX-Video, smoke shape, 9 frames of 64x64 (8 video + 8 text tokens)"),
    ("hunyuan-video", "HunyuanVideo, smoke shape, 9 frames of 64x64 (48 video + 8 text tokens)"),
    ("wan", "Wan, smoke shape, 9 frames of 64x64 (48 video + 8 text tokens)")])
def test_video_step_benchmark_smoke(tmp_path, model, title):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  (tmp_path / "peer.py").write_text(VIDEO_PEER)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--model",
                        model, "--smoke", "--modes", "per-block remat", "--meshes", "1x1,1x2",
                        "--peer", str(tmp_path / "peer.py")],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  assert out.startswith(title), out
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert [(r[1], r[3], r[4]) for r in rows] == [
      ("no remat", "PyTorch peer", "1x1"), ("per-block remat", "diffpipe-jax", "1x1"),
      ("per-block remat", "PyTorch peer", "1x1"), ("per-block remat", "diffpipe-jax", "1x2")], out
  assert all(float(r[5]) > 0 for r in rows), out


def test_flux_step_benchmark_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--smoke",
                        "--modes", "per-block remat,fp8 base + per-block remat", "--meshes", "1x1,2x2",
                        "--microbatches", "2", "--profile", str(tmp_path)],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "diffpipe-jax" in line]
  assert len(rows) == 4, out  # per-block remat, fp8 base; on 1 and on 2x2 devices
  assert all(float(row.split("|")[7].strip(" x")) > 0 for row in rows), out  # speed-ups
  assert len(glob.glob(str(tmp_path / "**" / "*.trace.json.gz"), recursive=True)) == 4


def test_flux_step_benchmark_smoke_of_unrolled_and_swapped_steps(tmp_path):
  """The unrolled mode (its step split into programs per block), blocks_to_swap per mode, and a
  peer that runs out of memory: an OOM row, the rest of the table, `-` where nothing applies."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  (tmp_path / "peer.py").write_text(OOM_PEER)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--smoke",
                        "--modes", "no remat (unrolled),per-block remat (unrolled)", "--blocks_to_swap", "0,2",
                        "--peer", str(tmp_path / "peer.py")],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert [(r[1], r[2], r[3]) for r in rows] == [
      ("no remat", "0", "PyTorch peer"), ("no remat (unrolled)", "0", "diffpipe-jax"),
      ("per-block remat", "0", "PyTorch peer"), ("per-block remat (unrolled)", "2", "diffpipe-jax")], out
  assert rows[0][5:-1] == ["OOM"] + ["-"] * 9, out
  assert rows[2][5:-1] == ["2.000", "0.50"] + ["-"] * 6 + ["0.0%", "-"], out  # no peak off the GPU
  assert all(float(r[5]) > 0 for r in rows[1::2]), out  # step times
  assert "nan" not in out, out


def test_flux_step_table_of_runs_out_of_memory(tmp_path):
  """A run that dies of XLA's RESOURCE_EXHAUSTED is an OOM row, and the row of a mesh whose 1x1
  run it was has no speed-up; a run that fails otherwise still stops the benchmark."""
  (tmp_path / "oom.py").write_text('raise SystemExit("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: '
                                   'Out of memory while trying to allocate 25769803776 bytes.")')
  (tmp_path / "bug.py").write_text('raise ValueError("a bug")')
  assert train_step.sub([sys.executable, str(tmp_path / "oom.py")]) == train_step.OOM
  with pytest.raises(subprocess.CalledProcessError):
    train_step.sub([sys.executable, str(tmp_path / "bug.py")])
  run = dict(step_s=1.0, samples_per_s=2.0, peak_gib=30.0, step_peak_gib=None, resident_gib=20.0,
             bubble=0.125, compile_s=40.0)
  lines = train_step.table({("per-block remat", 0, "1x1"): train_step.OOM, ("per-block remat", 0, "2x1"): run},
                          {}, flop=81e12)
  rows = [[c.strip() for c in line.split("|")][1:-1] for line in lines[2:]]
  assert rows == [["per-block remat", "0", "diffpipe-jax", "1x1", "OOM"] + ["-"] * 9,
                  ["per-block remat", "0", "diffpipe-jax", "2x1", "1.000", "2.00", "-", "30.00", "-",
                   "20.00", "81", "10%", "12.5%", "40"]], lines


def test_host_copy_benchmark_smoke():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_copy.py"), "--smoke"],
                       check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
  assert len(rows) == 5 and all(float(row.split("|")[2]) > 0 for row in rows), out


def test_trace_summary_counts_overlapping_gpu_work_once(tmp_path):
  gpu, host = 7, 1
  events = [dict(ph="M", name="process_name", pid=gpu, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=host, args=dict(name="/host:CPU")),
            dict(ph="X", pid=gpu, tid=1, ts=0, dur=600, name="nvjet_sm90_gemm"),
            dict(ph="X", pid=gpu, tid=2, ts=500, dur=200, name="loop_add_fusion_12"),  # overlaps
            dict(ph="X", pid=gpu, tid=1, ts=900, dur=100, name="loop_add_fusion_3"),
            dict(ph="X", pid=host, tid=1, ts=0, dur=5000, name="ThunkExecutor")]  # not GPU time
  folder = tmp_path / "run" / "plugins" / "profile" / "1"
  folder.mkdir(parents=True)
  with gzip.open(folder / "vm.trace.json.gz", "wt") as f:
    json.dump(dict(traceEvents=events), f)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "trace_summary.py"),
                        str(tmp_path), "--host", "3"], check=True, stdout=subprocess.PIPE, text=True).stdout
  assert "GPU busy 0.8 ms of 1.0 ms traced (80%); 3 device events" in out, out
  assert "| matmul | 0.6 | 75.0% |" in out and "| loop_add_fusion_N | 2 | 0.3 | 37.5% |" in out, out
  assert "| ThunkExecutor | 1 | 5.0 | 500.0% |" in out, out  # the host's events, listed apart


def test_sample_benchmark_smoke():
  """Ours and the diffusers pipeline on LTX-Video's smoke shape (classifier-free guidance: the
  pipeline's negative prompt arguments), one table."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sample_steps.py"), "--smoke",
                        "--model", "ltx-video", "--steps", "3", "--guidance", "3", "--unrolled"],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  assert out.startswith("LTX-Video, smoke shape") and "3 sampling steps, guidance 3, ours unrolled" in out, out
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert [r[1] for r in rows] == ["diffpipe-jax", "diffusers pipeline"], out
  assert all(float(r[2]) > 0 for r in rows), out


def test_kernel_benchmark_smoke():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_ceilings.py"), "--smoke"],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")][1:]
  assert len(rows) == 8 + 4 + 16 and all(float(r[2]) > 0 for r in rows), out


def deviceless_programs(*args) -> tuple:
  """(the output of benchmarks/deviceless.py --smoke *args, {(what, module): calls}), each
  program with kernels."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "deviceless.py"), "--smoke", *args],
                       env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.split("\n\n")[1].splitlines()[2:]]
  assert f"kernels: {sum(int(r[1]) * int(r[2]) for r in rows)}" in out, out
  assert all(int(r[2]) > 0 for r in rows), out
  calls = collections.Counter()
  for name, n, *_ in rows:
    calls[tuple(name.split(maxsplit=1)[1].rsplit(maxsplit=1))] += int(n)
  return out, calls


def test_deviceless_benchmark_smoke():
  """benchmarks/deviceless.py on the smoke Flux (2 double and 2 single blocks), compiled for the
  CPU: a training step's forward and backward programs for each block call, two sampling steps'
  programs for each block call, each with its kernels counted; and its count of a kernel's
  bytes and FLOPs on an HLO module written out."""
  from benchmarks import deviceless
  out, calls = deviceless_programs()
  for block in ("DoubleStreamBlock", "SingleStreamBlock"):
    assert calls["forward", block] == calls["backward", block] == 2, out
  out, calls = deviceless_programs("--sample", "2")
  assert calls["forward only", "DoubleStreamBlock"] == calls["forward only", "SingleStreamBlock"] == 4, out
  # a matmul's FLOPs and bytes from its HLO line, and a fused slice read as the slice
  hlo = """HloModule m

%fused (p0: f32[16,4], p1: f32[2,8]) -> f32[2,4] {
  %p0 = f32[16,4]{1,0} parameter(0)
  %p1 = f32[2,8]{1,0} parameter(1)
  %s = f32[8,4]{1,0} slice(%p0), slice={[0:8], [0:4]}
  ROOT %d = f32[2,4]{1,0} dot(%p1, %s), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[16,4], b: f32[2,8]) -> f32[2,4] {
  %a = f32[16,4]{1,0} parameter(0)
  %b = f32[2,8]{1,0} parameter(1)
  ROOT %f = f32[2,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
}
"""
  (kernel,) = deviceless.kernels(hlo)
  assert (kernel.kind, kernel.flops, kernel.bytes_in, kernel.bytes_out) == (
      "matmul", 2 * 8 * 2 * 4, 4 * (8 * 4 + 2 * 8), 4 * 2 * 4)


# ---- benchmarks/full_size.py: full-size checkpoints and media, here at --shrink dimensions --------

# (family, format) -> what a user points the config at: model path, encoder keys
SHRUNK_USES = {
    ("flux", "diffusers"): ("", dict(diffusers_path="")),
    ("flux", "single_file"): ("flux1-dev.safetensors", None),
    ("ltx-video", "diffusers"): ("", dict(diffusers_path="")),
    ("ltx-video", "single_file"): ("ltx-video-2b-v0.9.1.safetensors",
                                   dict(diffusers_path="../ltx-video-diffusers",
                                        single_file_path="ltx-video-2b-v0.9.1.safetensors")),
    ("hunyuan-video", "comfyui"): ("hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors",
                                   dict(diffusers_path=None, vae_path="hunyuan_video_vae_bf16.safetensors",
                                        llm_path="llava-llama-3-8b-text-encoder-tokenizer",
                                        clip_path="clip-vit-large-patch14")),
    ("hunyuan-video", "official"): ("", dict(diffusers_path=None, ckpt_path="")),
    ("wan", "diffusers"): ("", dict(diffusers_path="")),
    # ComfyUI's transformer file, its encoders from a diffusers folder (full_job.py's recipe)
    ("wan", "comfyui"): ("wan2.1_t2v_14B_bf16.safetensors", dict(diffusers_path="../wan-diffusers")),
    ("wan", "comfyui --fp8"): ("wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
                               dict(diffusers_path="../wan-diffusers")),
}
# the variants a flag writes, beside each family's formats: (family, name) -> (format, flags)
SHRUNK_VARIANTS = {("wan", "comfyui --fp8"): ("comfyui", ["--fp8"])}
# a float8 file's block Linear, which the loader keeps float8 (the float8 base)
FLOAT8_KERNEL = {"hunyuan-video": ("double_blocks", "img_attn_qkv"), "wan": ("blocks", "self_attn", "q")}


@pytest.fixture(scope="module")
def shrunk_formats(tmp_path_factory):
  """Every family's every format and `SHRUNK_VARIANTS`, written by the command line at
  --shrink: (family, format or variant) -> its folder."""
  root = tmp_path_factory.mktemp("full_size")
  written = {(family, format): (format, []) for family, formats in full_size.FORMATS.items()
             for format in formats}
  folders = {}
  for (family, name), (format, flags) in {**written, **SHRUNK_VARIANTS}.items():
    folders[family, name] = str(root / f"{family}-{name.replace(' --', '-')}")
    full_size.main(["--family", family, "--format", format, "--out", folders[family, name],
                    "--shrink", *flags])
  return folders


def in_folder(folder, path):
  """`path` under `folder` ("" is the folder; None stays None: a key left empty)."""
  return None if path is None else os.path.normpath(os.path.join(folder, path))


@pytest.mark.parametrize("family,format", sorted(SHRUNK_USES))
def test_full_size_formats_load_as_users_load_them(shrunk_formats, family, format):
  """Each format's transformer through `models.load` (ComfyUI's float8 file as the float8 base),
  and its encoders through the family's `load_encoders`, encoding an image and a caption."""
  import jax.numpy as jnp
  from conftest import family_config
  from diffpipe_jax import family as family_lib
  from diffpipe_jax import models
  folder = shrunk_formats[family, format]
  model_path, keys = SHRUNK_USES[family, format]
  float8 = "fp8" in model_path
  model = models.load(family, in_folder(folder, model_path), progress=False,
                      transformer_dtype="float8" if float8 else None)
  if float8:
    block_linear = functools.reduce(dict.__getitem__, FLOAT8_KERNEL[family], model.params)
    assert block_linear["kernel"].dtype == jnp.float8_e4m3fn
  if keys is None:  # BFL's file is the transformer alone
    return
  model_config = family_config(family).model
  for key, path in keys.items():
    setattr(model_config, key, in_folder(folder, path) or "")
  encoders = family_lib.torch_side(model.family).load_encoders(model_config, device="cpu")
  pixels = np.random.default_rng(0).uniform(-1, 1, (1, 1, 32, 32, 3)).astype(np.float32)
  encoded = [encoders.encode_media(pixels), *encoders.encode_text(["a red circle"], 1).values()]
  assert all(np.isfinite(x).all() for x in encoded)
  encoders.release()


def test_full_size_diffusers_folders_load_in_diffusers(shrunk_formats):
  """The pipeline folders load whole in diffusers, every component its class, with our values."""
  import diffusers
  import torch
  from diffpipe_jax.convert.tensorfile import TensorFiles, safetensors_in_folder
  for family, pipeline in (("flux", "FluxPipeline"), ("ltx-video", "LTXPipeline"), ("wan", "WanPipeline")):
    folder = shrunk_formats[family, "diffusers"]
    pipe = getattr(diffusers, pipeline).from_pretrained(folder, dtype=torch.bfloat16)
    with open(f"{folder}/model_index.json") as f:
      classes = {k: v[1] for k, v in json.load(f).items() if isinstance(v, list) and v[0]}
    assert {k: type(pipe.components[k]).__name__ for k in classes} == classes
    stored = TensorFiles(safetensors_in_folder(f"{folder}/transformer"))["proj_out.weight"]
    np.testing.assert_array_equal(pipe.transformer.proj_out.weight.detach().float().numpy(),
                                  stored.astype(np.float32))


def safetensors_summary(folder):
  """{file: its header (dtype and shape per tensor, metadata) or JSON content} of a folder."""
  from diffpipe_jax.convert.tensorfile import read_header_and_metadata
  out = {}
  for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if name.endswith(".safetensors"):
      header, _, metadata = read_header_and_metadata(path)
      out[name] = ({k: (e["dtype"], e["shape"]) for k, e in header.items()}, metadata)
    elif name.endswith(".json"):
      with open(path) as f:
        out[name] = json.load(f)
  return out


@pytest.mark.parametrize("library,model,config_class,name,dtype", [
    ("diffusers", "FluxTransformer2DModel", None, "flux_transformer", "bfloat16"),
    ("diffusers", "AutoencoderKLLTXVideo", None, "ltx_vae", "bfloat16"),
    ("transformers", "T5EncoderModel", "T5Config", "t5_xxl", "bfloat16"),
    ("transformers", "LlamaForCausalLM", "LlamaConfig", "llama_3_8b", "float16"),
    ("transformers", "CLIPModel", "CLIPConfig", "clip_l", "float32"),
    ("diffusers", "WanTransformer3DModel", None, "wan_transformer", "bfloat16"),
    ("diffusers", "AutoencoderKLWan", None, "wan_vae", "bfloat16"),
    ("transformers", "UMT5EncoderModel", "UMT5Config", "umt5_xxl", "bfloat16")])
def test_full_size_folders_are_what_save_pretrained_writes(tmp_path, library, model, config_class,
                                                          name, dtype):
  """The same files (shards and index), tensor names, shapes, dtypes, metadata and config files
  as the real class's save_pretrained at the same shard size (tied weights left out, T5's)."""
  import importlib
  import torch
  dtype = getattr(torch, dtype)
  cfg, shard_size = full_size.config(name, True), full_size.max_shard_size(name, True)
  lib = importlib.import_module(library)
  if library == "diffusers":
    real = getattr(lib, model)(**cfg)
    plan = full_size.diffusers_folder("ours", full_size.diffusers_model(model, cfg), dtype, shard_size)
  else:
    real = getattr(lib, model)(getattr(lib, config_class)(**cfg))
    plan = full_size.transformers_folder(
        "ours", full_size.transformers_model(model, config_class, cfg), dtype, shard_size)
  real.to(dtype).save_pretrained(str(tmp_path / "real"), max_shard_size=shard_size)
  full_size.write_plan(plan, str(tmp_path))
  ours, theirs = safetensors_summary(tmp_path / "ours"), safetensors_summary(tmp_path / "real")
  assert ours == theirs
  shards = dict(flux_transformer=3, llama_3_8b=4, t5_xxl=2, wan_transformer=6, umt5_xxl=3)
  assert len([f for f in ours if f.endswith(".safetensors")]) == shards.get(name, 1)  # the released


def test_full_size_weights_are_drawn_as_the_models_initialise_them(shrunk_formats):
  """Linear weights N(0, 1/fan_in), biases 0, norms 1, embeddings N(0, 0.02^2); ComfyUI's float8
  files have the blocks' Linear weights in float8 (within its range) and the rest in bf16."""
  from safetensors.numpy import load_file
  folder = shrunk_formats["flux", "single_file"]
  tensors = {k: v.astype(np.float32) for k, v in load_file(f"{folder}/flux1-dev.safetensors").items()}
  qkv = tensors["double_blocks.0.img_attn.qkv.weight"]
  assert abs(qkv.std() * qkv.shape[1] ** 0.5 - 1) < 0.05 and abs(qkv.mean()) < 0.01
  assert (tensors["double_blocks.0.img_attn.qkv.bias"] == 0).all()
  assert (tensors["double_blocks.0.img_attn.norm.query_norm.scale"] == 1).all()
  t5 = load_file(f"{shrunk_formats['flux', 'diffusers']}/text_encoder_2/model-00001-of-00002.safetensors")
  assert abs(t5["shared.weight"].astype(np.float32).std() / 0.02 - 1) < 0.05
  vae = load_file(f"{shrunk_formats['wan', 'diffusers']}/vae/diffusion_pytorch_model.safetensors")
  gammas = [v for k, v in vae.items() if k.endswith(".gamma")]  # Wan's RMS norms' scales
  assert gammas and all((v.astype(np.float32) == 1).all() for v in gammas)
  from diffpipe_jax.convert.tensorfile import read_header
  for family, file, blocks in (
      ("hunyuan-video", "comfyui/hunyuan_video_720_cfgdistill_fp8_e4m3fn.safetensors",
       ("double_blocks.", "single_blocks.")),
      ("wan", "comfyui --fp8/wan2.1_t2v_14B_fp8_e4m3fn.safetensors", ("blocks.",))):
    name, file = file.split("/")
    header, _ = read_header(f"{shrunk_formats[family, name]}/{file}")
    float8 = {k for k, e in header.items() if e["dtype"] == "F8_E4M3"}
    assert float8 == {k for k, e in header.items() if k.startswith(blocks)
                      and k.endswith(".weight") and len(e["shape"]) == 2}, family
    assert {e["dtype"] for k, e in header.items() if k not in float8} == {"BF16"}, family


def test_full_size_torch_pickle_reads_back_exactly(shrunk_formats):
  """Tencent's .pt, written a tensor at a time in torch.save's zip format: torch.load reads every
  tensor's bytes back, memory-mapped and not, from a valid zip with 64-byte aligned storages."""
  import struct
  import torch
  import zipfile
  folder = shrunk_formats["hunyuan-video", "official"]
  plan = full_size.hunyuan_official(True)
  pools = full_size.Pools([t for f in plan.weights for t in f.tensors])
  for file in plan.weights:
    if not file.path.endswith(".pt"):
      continue
    path = os.path.join(folder, file.path)
    for mmap in (True, False):
      state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
      state = state[file.under] if file.under else state
      assert list(state) == [t.name for t in file.tensors]
      for t in file.tensors:
        value = state[t.name]
        assert full_size.SAFETENSORS_DTYPE[value.dtype] == t.dtype and tuple(value.shape) == t.shape
        assert (value.contiguous().view(torch.uint8).numpy().tobytes()
                == b"".join(bytes(chunk) for chunk in full_size.tensor_chunks(t, pools))), t.name
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
      assert archive.testzip() is None
      for info in archive.infolist():
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        if "/data/" in info.filename:
          assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0, info.filename


STREAMING = """import json, sys
from benchmarks import full_size
tensors = tuple(full_size.Tensor(f"blocks.{i}.weight", (3072, 12288), "BF16", (full_size.NORMAL, 0.01))
                for i in range(4))
plan = full_size.Plan([full_size.WeightFile("model.safetensors", tensors[:2]),
                       full_size.WeightFile("model.pt", tensors[2:], under="module")])
before = full_size.peak_rss_bytes()
written = full_size.write_plan(plan, sys.argv[1], pool_values=1 << 20)
print(json.dumps(dict(written=written, growth=full_size.peak_rss_bytes() - before)))
"""


def test_full_size_writer_streams(tmp_path):
  """0.3 GB of weights (a safetensors file and a torch pickle) are written with the host's peak
  memory growing by a small fraction of that: tensors stream from the pools, none is held whole."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", STREAMING, str(tmp_path)], env=env, check=True,
                       stdout=subprocess.PIPE, text=True).stdout
  result = json.loads(out.splitlines()[-1])
  assert result["written"] == 4 * 3072 * 12288 * 2 and result["growth"] < result["written"] / 20, result


def test_full_size_dataset_decodes_as_planned(tmp_path):
  """Images of the planned sizes (jpg, png, webp), H.264 yuv420p clips of the planned sizes,
  frame rates and durations, and a caption beside each, short and long (past CLIP's 77 tokens)."""
  import av
  from PIL import Image
  items = full_size.write_dataset(str(tmp_path), shrink=True, workers=1)  # JAX's threads: no fork
  assert {os.path.splitext(i.path)[1] for i in items} == {".jpg", ".png", ".webp", ".mp4"}
  assert {os.path.dirname(i.path) for i in items} == {"images", "videos", "eval"}
  for item in items:
    path = str(tmp_path / item.path)
    if item.fps:
      with av.open(path) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert stream.average_rate == item.fps and len(frames) == item.frames
        assert float(frames[-1].time) == pytest.approx(item.seconds - 1 / item.fps)
        assert frames[0].to_ndarray(format="rgb24").shape == (item.height, item.width, 3)
    else:
      with Image.open(path) as image:
        assert image.size == (item.width, item.height)
  words = [len(open(os.path.splitext(str(tmp_path / i.path))[0] + ".txt").read().split())
           for i in items]
  assert min(words) < 20 and max(words) > 77


def test_full_job_reads_step_times_from_the_runs_events_and_rates_from_its_bars(tmp_path):
  """benchmarks/full_job.py's readings (the job itself needs a GPU and full-size files): each
  step's wall time from the TensorBoard events the run writes, and a cache's items a second
  from the largest of its tqdm bars (the training set's, beside the eval set's)."""
  from tensorboardX import SummaryWriter
  board = SummaryWriter(str(tmp_path))
  for step, loss in ((1, 0.5), (2, 0.25)):
    board.add_scalar("train/loss", loss, step)
    board.add_scalar("train/lr", 1e-4, step)
  board.close()
  scalars = full_job.tensorboard_scalars(str(tmp_path), "train/loss")
  assert [(s, v) for s, _, v in scalars] == [(1, 0.5), (2, 0.25)]
  assert list(full_job.step_times(scalars, 1, 2)) == [2]
  bar = lambda total: [f"caching latents: {100 * n // total}%|##| {n}/{total} [00:01<00:00]"
                       for n in range(total + 1)]
  lines = list(enumerate(bar(4) + bar(2), start=10))  # a second a line
  assert full_job.bar_rate(dict(lines=lines), "caching latents") == 1.0
  assert full_job.bar_rate(dict(lines=lines), "caching captions") is None


def test_full_job_phases_read_only_the_figures_they_need(tmp_path, monkeypatch):
  """`--phases` runs some phases: one that needs no other's figures (the bare step) runs
  without them; one that does (the resume: the training's steps and run) says which to run."""
  def job(phases):
    monkeypatch.setattr(sys, "argv", ["full_job.py", "--smoke", "--phases", phases, "--out", str(tmp_path)])
    full_job.main()
  job("train_step")  # (--smoke skips the bare step itself)
  with pytest.raises(SystemExit, match="needs the cache phase's figures"):
    job("resume")


@pytest.mark.parametrize("family", sorted(full_job.RECIPES))
def test_full_job_recipes_name_keys_the_configs_have(family, tmp_path):
  """Each family's recipe in full_job.py, the file it writes as a user would and its overrides,
  names keys its config has (a typo would show only on a GPU), and its bare
  step's shape and modes are train_step.py's."""
  import importlib
  import importlib.util
  recipe = full_job.RECIPES[family]
  path = tmp_path / "job_config.py"
  full_job.user_config(str(path), family, "/models", "/data")
  spec = importlib.util.spec_from_file_location("job_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert config.dataset.path == os.path.join("/data", recipe["data"])
  family_config = importlib.import_module(f"diffpipe_jax.configs.{recipe['config']}").get_config()
  for format, model_keys in recipe["formats"].items():  # update() would add any key
    assert set(model_keys("/models")) <= set(family_config.model), format
    assert format in full_size.FORMATS[family], format
  for card in recipe["cards"].values():
    for key in {**recipe["dataset"], **card["overrides"]}:
      *parents, name = key.split(".")
      assert name in functools.reduce(getattr, parents, config), key
    assert card["modes"] in train_step.MODES
  assert set(recipe["step"]) <= {"model", "res", "width", "frames"}
  assert recipe["step"]["model"] in train_step.SHAPES
