"""A family's unrolled training step, or its sampler's steps, compiled for a GPU that is not here:
the programs they call, their kernels and the bytes each kernel reads and writes, from XLA's
optimised HLO. For sessions that get no GPU: what a change does to the copies, concatenations
and kernel launches can be seen, not timed (BENCHMARKS.md#deviceless).

  python benchmarks/deviceless.py --res 512 [--remat block] [--xla_option xla_gpu_dot_merger_threshold_mb=default]
  python benchmarks/deviceless.py --model hunyuan-video --res 512 --frames 33 --top 20
  python benchmarks/deviceless.py --res 1024 --sample 2   # two of the sampler's steps (and its modulations)

Needs jax's CUDA plugin (`pip install "jax[cuda13]"`), not a GPU: XLA compiles for the H200 of
`H200` (XLA's own spec of the card, less what a compile does not read) without autotuning, so
the fusions and copies are the device's and the matmul algorithms are not. What is compiled is
traced at the released shape (`train_step.SHAPES`) without allocating it: the gradient's
programs of one training step (`training_step.grad_fn`, one micro-batch; the optimizer update, one
program without matmuls, is left out), or `sampling.denoise` of `--sample` steps as
`sample_steps.py` runs it. Bytes are each kernel's operands and results (of an operand that a
fusion only slices, the slices); the floor is those bytes at `--tb_per_s` or the matmuls' FLOPs
at `--tflops`, whichever takes longer (attention: its bytes only), a bound to rank kernels by,
not a time. `--smoke` compiles the smoke shape for this machine's CPU (tests the script).
"""
import collections
import dataclasses
import os
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import train_step  # noqa: E402

# XLA's spec of an H200 (xla/backends/gpu/target_config/specs/h200.txtpb), the fields a
# compile reads
H200 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200 141GB HBM3e"
"""
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
         "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# what a program's entry computation holds that launches nothing
NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
               "opt-barrier", "copy-start", "copy-done"}
# what the programs of `programs.value_and_grad` do, by the name of the function each jits
ROLES = {"_traced_forward": "forward", "_backward": "backward"}
WORKSPACE = 1 << 20  # an s8 result at least this large beside a library call's is its scratch


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  kind: str  # "matmul", "attention", "fusion: <XLA's kind>", or the HLO op
  bytes_in: int
  bytes_out: int
  flops: int  # a matmul's (also one that reads a slice of an operand in place); 0 for the rest
  result: str  # its result type, as the HLO writes it
  source: str  # the model code it comes from (jax's op_name, less the program's name)


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  result: str
  op: str
  operands: list
  line: str


def _arrays(hlo_type: str) -> list:
  """[(dtype, dims)] of an HLO type: an array or a tuple of them."""
  return [(t, [int(d) for d in dims.split(",") if d])
          for t, dims in re.findall(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]", hlo_type)]


def _size(arrays) -> int:
  return sum(BYTES.get(t, 4) * int(np.prod(dims, dtype=np.int64)) for t, dims in arrays)


def _computations(hlo_text: str) -> dict:
  """{computation name (ENTRY's: "ENTRY"): [_Instruction]} of an HLO module's text."""
  found, current = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"(ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
    if head:
      current = found.setdefault("ENTRY" if head.group(1) else head.group(2), [])
      continue
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(?:, |$)", line)
    if m and current is not None:
      operands = [o.strip().lstrip("%") for o in m.group(4).split(",") if o.strip()]
      current.append(_Instruction(m.group(1), m.group(2), m.group(3), operands, line))
  return found


def _matmul_flops(inst, types) -> int:
  lhs, result = _arrays(types.get(inst.operands[0], "")), _arrays(inst.result)
  if not lhs or not result:
    return 0
  contracting = re.search(r'lhs_contracting_dim\w*"?[:=]\s*\[?"?\{?(\d+)', inst.line)
  k = lhs[0][1][int(contracting.group(1))] if contracting else lhs[0][1][-1]
  return 2 * k * int(np.prod(result[0][1], dtype=np.int64))


def _is_matmul(inst) -> bool:
  target = re.search(r'custom_call_target="([^"]+)"', inst.line)
  return inst.op == "dot" or bool(target and re.search("matmul|gemm", target.group(1)))


def _fused(body) -> tuple:
  """(bytes a fused computation reads: of each parameter that only slices feed on, the slices;
  its matmul's FLOPs, if it holds one)."""
  types = {i.name: i.result for i in body}
  read, flops = 0, 0
  for inst in body:
    if inst.op == "parameter":
      users = [u for u in body if inst.name in u.operands]
      slices = users and all(u.op in ("slice", "dynamic-slice") for u in users)
      read += sum(_size(_arrays(u.result)) for u in users) if slices else _size(_arrays(inst.result))
    elif _is_matmul(inst):
      flops += _matmul_flops(inst, types)
  return read, flops


def _source(line: str) -> str:
  """The model code an instruction comes from: jax's op_name without the program's name and
  the transformations (jvp, transpose, vmap, checkpoint), e.g. `SingleStreamBlock/attn.norm_q/mul`."""
  source = re.search(r'op_name="(?:jit\([^)]*\)/)?([^"]*)"', line)
  if not source:
    return ""
  path = re.sub(r"transpose\(|jvp\(|vmap\(|checkpoint/|rematted_computation/|[()]", "", source.group(1))
  return re.sub(r"/+", "/", path).strip("/")


def kernels(hlo_text: str) -> list:
  """The kernels of an optimised HLO module's entry computation, in order."""
  computations = _computations(hlo_text)
  types, out = {}, []
  for inst in computations["ENTRY"]:
    types[inst.name] = inst.result
    if inst.op in NOT_KERNELS:
      continue
    results = [a for a in _arrays(inst.result)
               if not (a[0] == "s8" and len(a[1]) == 1 and a[1][0] >= WORKSPACE)]
    read = sum(_size(_arrays(types.get(o, ""))) for o in inst.operands)
    kind, flops = inst.op, 0
    if _is_matmul(inst):
      kind, flops = "matmul", _matmul_flops(inst, types)
    elif inst.op == "custom-call":
      kind = re.search(r'custom_call_target="([^"]+)"', inst.line).group(1)
      kind = "attention" if "fmha" in kind else kind
    elif inst.op == "fusion":
      backend = re.search(r'"kind":"(\w+)"', inst.line)
      kind = "fusion: " + (backend.group(1) if backend else re.search(r"kind=(\w+)", inst.line).group(1))
      read, flops = _fused(computations.get(re.search(r"calls=%?([\w.\-]+)", inst.line).group(1), []))
      kind = "matmul" if flops else kind
    out.append(Kernel(inst.name, kind, read, _size(results), flops, inst.result, _source(inst.line)))
  return out


@dataclasses.dataclass(frozen=True)
class Program:
  name: str  # its order of first call, what it computes, the module most of its kernels are of
  calls: int
  kernels: list


def _abstract_model(a, device, remat):
  """(the family's model at the shape, unrolled, its weights ShapeDtypeStructs, the family's
  training config, the abstract weights in the stacked form, the placement)."""
  import importlib
  import jax
  import jax.numpy as jnp
  from diffpipe_jax import family as family_lib, models, runtime, sharding
  from diffpipe_jax.convert import table

  family, shape = family_lib.get(a.model), train_step.SHAPES[a.model](a)
  config = importlib.import_module(f"diffpipe_jax.configs.{a.model.replace('-', '_')}").get_config("")
  config.adapter.rank = a.rank
  module = models.make_module(family, shape.cfg, jnp.float32 if a.smoke else jnp.bfloat16, None,
                              None if a.smoke else "cudnn")
  placement = sharding.make_placement(sharding.make_mesh(1, [device]), family.stacks(shape.cfg), 1,
                                      unrolled=True)
  abstract = models.abstract_params(family, module, shape.cfg)
  params = jax.eval_shape(lambda p: table.unflatten(
      {path: placement.settle(path, w) for path, w in table.flatten(p).items()}), abstract)
  model = models.Model(family, shape.cfg, module, params, runtime.Runtime.of(placement, remat))
  return model, config, abstract, placement


def training_step(a, device):
  """(the training step's gradient (`training_step.grad_fn`, one micro-batch), its arguments)."""
  import jax
  from diffpipe_jax import lora, optim, training_step

  model, config, abstract, placement = _abstract_model(a, device, a.remat)
  tx, _ = optim.make(config, 1000)
  adapter = jax.eval_shape(lambda key: training_step.init_state(
      key, layer_params=abstract, config=config, tx=tx, family=model.family)["lora"], jax.random.key(0))
  adapter = jax.eval_shape(lambda a_: lora.in_dtype(placement.to_stages(a_), model.module.dtype), adapter)
  batch = train_step.as_cached(train_step.SHAPES[a.model](a).batch(1), model.module.dtype)
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 1))
  grads = training_step.grad_fn(model, config, jit_options={})  # (options: at compile)
  return grads, (adapter, model.params, jax.tree.map(lambda x: x[None], batch), keys)  # [A=1, ...]


def sampling(a, device):
  """(`sampling.denoise` of `--sample` steps of the base model, as `sample_steps.py` runs it, its
  arguments: the weights)."""
  from benchmarks import sample_steps
  from diffpipe_jax import sampling

  model, *_ = _abstract_model(a, device, "none")
  _, conditioning, uncond, noise, tokens = sample_steps.inputs(a)
  model_config = sample_steps.sampling_config(a)
  steps = sampling.step_fn(model, model_config, a.guidance, jit_options={})
  return (lambda params: sampling.denoise(model, params, None, model_config, conditioning, noise,
                                        (tokens,), a.sample, a.guidance, uncond=uncond, step=steps),
          (model.params,))


def step_programs(fn, args, device, compiler_options) -> tuple:
  """([Program] of a call of fn, its eager operations): fn traced, each distinct program it
  calls compiled for `device` with `compiler_options`."""
  import jax
  from jax.extend import core
  from jax.sharding import SingleDeviceSharding

  closed = jax.make_jaxpr(fn)(*args)
  calls, first, eager = collections.Counter(), {}, 0
  for eqn in closed.jaxpr.eqns:
    if "jaxpr" in eqn.params and "name" in eqn.params:
      key = id(eqn.params["jaxpr"])
      calls[key] += 1
      first.setdefault(key, eqn)
    else:
      eager += 1
  programs = []
  for n, (key, eqn) in enumerate(first.items()):
    on_device = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=SingleDeviceSharding(device))
                 for v in eqn.invars]
    compiled = jax.jit(core.jaxpr_as_fun(eqn.params["jaxpr"]), compiler_options=compiler_options).lower(
        *on_device).compile()
    found = kernels(compiled.as_text())
    modules = collections.Counter(k.source.split("/")[0] for k in found if "/" in k.source)
    label = " ".join([f"{n:02d}", ROLES.get(str(eqn.params["name"]), "forward only")]
                     + [m for m, _ in modules.most_common(1)])
    programs.append(Program(label, calls[key], found))
  return programs, eager


def report(programs, eager, a) -> str:
  floor = lambda k: max(k.flops / (a.tflops * 1e12), (k.bytes_in + k.bytes_out) / (a.tb_per_s * 1e12))
  lines = [f"programs called: {sum(p.calls for p in programs)} ({len(programs)} compiled), "
           f"eager operations: {eager}, kernels: {sum(p.calls * len(p.kernels) for p in programs)}",
           "", "| program | calls | kernels | matmuls | fusions | other |", "|---|---|---|---|---|---|"]
  for p in programs:
    kinds = collections.Counter(k.kind for k in p.kernels)
    fusions = sum(v for kind, v in kinds.items() if kind.startswith("fusion"))
    lines.append(f"| {p.name} | {p.calls} | {len(p.kernels)} | {kinds['matmul']} | {fusions} | "
                 f"{len(p.kernels) - kinds['matmul'] - fusions} |")
  by_kind = collections.defaultdict(lambda: np.zeros(4))
  for p in programs:
    for k in p.kernels:
      by_kind[k.kind] += p.calls * np.array([1, k.bytes_in + k.bytes_out, k.flops, floor(k)])
  lines += ["", f"| kernel kind | kernels | GB read + written | TFLOP | floor (ms; {a.tb_per_s} TB/s, "
            f"{a.tflops:.0f} TFLOP/s) |", "|---|---|---|---|---|"]
  for kind, (n, b, f, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][3]):
    lines.append(f"| {kind} | {int(n)} | {b / 1e9:.2f} | {f / 1e12:.2f} | {t * 1e3:.2f} |")
  rows = sorted(((p.calls * floor(k), p, k) for p in programs for k in p.kernels
                 if k.kind not in ("matmul", "attention")), key=lambda r: -r[0])[:a.top]
  if rows:
    lines += ["", "| memory-bound kernel | from | program | calls | MB read | MB written | floor, all calls (ms) | result |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {k.name} ({k.kind}) | {k.source[:70]} | {p.name} | {p.calls} | {k.bytes_in / 1e6:.1f} | "
              f"{k.bytes_out / 1e6:.1f} | {t * 1e3:.2f} | `{k.result[:60]}` |" for t, p, k in rows]
  return "\n".join(lines)


def main():
  p = train_step.shape_arguments(frames=121)
  p.add_argument("--rank", type=int, default=32)
  p.add_argument("--sample", type=int, default=0,
                 help="STEPS: the sampler's STEPS steps of the base model instead of a training step")
  p.add_argument("--guidance", type=float, default=3.5, help="with --sample")
  p.add_argument("--remat", default="none", help="activation_checkpointing (none, block, ...)")
  p.add_argument("--xla_option", action="append", default=[],
                 help="KEY=VALUE added to the programs' compiler options (repeatable); KEY=default: "
                      "XLA's own")
  p.add_argument("--tb_per_s", type=float, default=3.0)
  p.add_argument("--tflops", type=float, default=train_step.CEILING_TFLOPS)
  p.add_argument("--top", type=int, default=15)
  a = train_step.shape_defaults(p.parse_args())
  if not a.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only GPU comes from the plugin
  import jax
  from jax.sharding import SingleDeviceSharding
  from diffpipe_jax import programs
  if a.smoke:
    device = jax.devices()[0]
  else:
    from jax.experimental import topologies
    device = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H200).devices[0]
  options = dict(programs.JIT_OPTIONS["compiler_options"], **dict(o.split("=", 1) for o in a.xla_option))
  options = {k: v for k, v in options.items() if v != "default"}  # XLA's own
  fn, args = (sampling if a.sample else training_step)(a, device)
  found, eager = step_programs(fn, jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=SingleDeviceSharding(device)), args), device, options)
  what = (f"{a.sample} sampling steps, guidance {a.guidance}" if a.sample else
          f"LoRA rank {a.rank}, activation_checkpointing={a.remat!r}")
  print(f"{train_step.SHAPES[a.model](a).title}, {what}, unrolled, compiled for {device.device_kind}; "
        f"options {options}")
  print(report(found, eager, a))


if __name__ == "__main__":
  main()
