"""Shared layers: a Linear of parts, the float8 matmul of a float8 base, the XLA flags set on
import, masked cross attention and the double- and single-stream blocks (text after the image)
against diffusers' modules."""
import os
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np

from tolerances import assert_close, rel_err
from diffpipe_jax import programs, runtime
from diffpipe_jax.models import layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def float8_dots(fn, *args):
  """The dtypes of the operands of every dot_general in fn's jaxpr (custom VJPs included)."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        yield tuple(str(v.aval.dtype) for v in eqn.invars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub)
  return list(walk(jaxpr))


def dequantised_rows(x):
  q, scale = layers.quantize_float8(x, axis=-1)
  return q.astype(jnp.float32) * scale


def assert_close_by_row(got, want):
  """Each row (token) on its own: a row 1e5 times larger must not hide the others' errors."""
  for n, (got_row, want_row) in enumerate(zip(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]))):
    assert_close(got_row, want_row, what=f"row {n}")


def test_a_lora_linear_keeps_its_output_once_for_the_backward_pass(capsys):
  """Under the programs' residual policy a LoRA Linear keeps its output (base and LoRA summed)
  and its rank-sized down projection; not the base matmul's output besides."""
  linear, x = layers.Linear(24), jnp.ones((2, 5, 16))
  params = linear.init(jax.random.key(0), x)["params"]
  adapter = {"lora_A": jnp.ones((16, 3)), "lora_B": jnp.ones((3, 24))}
  loss = jax.checkpoint(lambda a, x: jnp.sin(linear.apply({"params": params, "lora": a}, x)).sum(),
                        policy=programs.keeps_for_backward)
  jax.ad_checkpoint.print_saved_residuals(loss, adapter, x)
  kept = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "from the argument" not in line
          and "from a constant" not in line]
  assert kept == ["f32[2,5,3]", "f32[2,5,24]"], kept


def test_a_lora_linear_adds_its_bias_to_the_lora_output_where_told():
  """With `kernels_in_place` (scanned per-block remat) the base matmul's output meets the bias only in
  the LoRA's output, its one addend, and the sum is fenced off; the result is the same."""
  x, outs = jax.random.normal(jax.random.key(0), (2, 5, 16)), {}
  for with_lora in (False, True):
    linear = layers.Linear(24)
    apply = runtime.Runtime("block").traced(linear.apply) if with_lora else linear.apply
    variables = {"params": dict(linear.init(jax.random.key(1), x)["params"], bias=jnp.arange(24.)),
                 "lora": {"lora_A": jnp.ones((16, 3)), "lora_B": jnp.ones((3, 24))}}
    outs[with_lora] = apply(variables, x)
    eqns = jax.make_jaxpr(lambda x: apply(variables, x))(x).jaxpr.eqns
    made_by = {v: e for e in eqns for v in e.outvars}
    base = next(e for e in eqns if e.primitive.name == "dot_general").outvars[0]
    (use,) = [e for e in eqns if base in e.invars]
    (addend,) = [v for v in use.invars if v is not base]
    lora_sum = use.primitive.name == "add" and made_by[addend].primitive.name == "add" and any(
        made_by[v].primitive.name == "dot_general" for v in made_by[addend].invars if v in made_by)
    assert lora_sum == with_lora, (with_lora, use, made_by.get(addend))
    assert any(e.primitive.name == "optimization_barrier" for e in eqns) == with_lora
  assert_close(outs[True], outs[False])


class _Projections(flax.linen.Module):
  """q, k and v of one input: through `linears_of_one_input`, or each Linear on its own."""
  joined: bool

  @flax.linen.compact
  def __call__(self, x):
    names, widths = ("to_q", "to_k", "to_v"), (8, 8, 6)
    if self.joined:
      return layers.linears_of_one_input(x, names, widths)
    return [layers.Linear(w, name=n)(x) for n, w in zip(names, widths)]


def test_linears_of_one_input_compute_their_lora_down_projections_as_one_matmul():
  """The same outputs and LoRA gradients as each Linear on its own (LoRAs of unequal ranks),
  with one down-projection matmul for the three LoRAs instead of three."""
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  params = _Projections(False).init(jax.random.key(1), x)["params"]
  keys = iter(jax.random.split(jax.random.key(2), 6))
  adapter = {n: {"lora_A": jax.random.normal(next(keys), (16, r)),
                 "lora_B": jax.random.normal(next(keys), (r, params[n]["kernel"].shape[1]))}
             for n, r in (("to_q", 3), ("to_k", 3), ("to_v", 2))}
  results, dots = {}, {}
  for joined in (False, True):
    loss = lambda a: sum(jnp.sin(y).sum() for y in _Projections(joined).apply(
        {"params": params, "lora": a}, x))
    results[joined] = jax.value_and_grad(loss)(adapter)
    dots[joined] = str(jax.make_jaxpr(loss)(adapter)).count("dot_general")
  assert_close(results[True], results[False])
  assert (dots[False], dots[True]) == (9, 7), dots


def test_a_linear_of_parts_is_the_linear_of_their_concatenation_without_it():
  """A Linear given a list of arrays computes, base and LoRA, what it computes on their
  concatenation, and its program concatenates nothing (the single-stream blocks' output) and
  sums its parts' products apart from the matmuls; except where it reads its kernel in place
  and the parts joined are smaller than the kernel."""
  linear = layers.Linear(13)
  keys = jax.random.split(jax.random.key(0), 4)
  parts = [jax.random.normal(keys[0], (2, 5, 7)), jax.random.normal(keys[1], (2, 5, 11))]
  joined = jnp.concatenate(parts, -1)
  variables = {"params": linear.init(keys[2], joined)["params"],
               "lora": {"lora_A": jax.random.normal(keys[3], (18, 3)),
                        "lora_B": jax.random.normal(keys[2], (3, 13))}}
  assert_close(linear.apply(variables, parts), linear.apply(variables, joined))
  jaxpr = str(jax.make_jaxpr(lambda ps: linear.apply(variables, ps))(parts))
  assert "concatenate" not in jaxpr and jaxpr.count("dot_general") == 5
  assert "optimization_barrier" in jaxpr
  in_place = runtime.Runtime("block").traced(linear.apply)
  # 2x2 tokens < 13 features <= 2x10 tokens
  for few, concatenated in (([p[:, :2] for p in parts], True),
                            ([jnp.concatenate([p, p], 1) for p in parts], False)):
    assert_close(in_place(variables, few), linear.apply(variables, few))
    jaxpr = str(jax.make_jaxpr(lambda ps: in_place(variables, ps))(few))
    assert ("concatenate" in jaxpr) == concatenated, few[0].shape


def test_float8_matmul_quantises_rows_and_runs_in_float8():
  """Forward: x quantised per row (one token at 1e5 times the others must not cost them
  their precision) times the float8 kernel, its scales on the output; backward: the output
  cotangent times the channel scales, quantised per row, times the kernel transposed. Both
  matmuls take float8 operands, so that XLA calls a float8 GEMM."""
  kx, kk, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (2, 8, 64)).at[0, 3].multiply(1e5)
  kernel, kernel_scale = layers.quantize_float8(jax.random.normal(kk, (64, 48)) * 0.1, axis=-2)
  kernel_scale = kernel_scale[0]
  ct = jax.random.normal(kc, (2, 8, 48))
  dequantised_kernel = kernel.astype(jnp.float32) * kernel_scale

  y, vjp = jax.vjp(lambda x: layers.float8_matmul(x, kernel, kernel_scale), x)
  assert_close_by_row(y, dequantised_rows(x) @ dequantised_kernel)
  assert_close_by_row(vjp(ct)[0], dequantised_rows(ct * kernel_scale) @ kernel.T.astype(jnp.float32))
  # against full precision: e4m3 keeps 3 mantissa bits, so a few percent, row by row
  exact = x @ dequantised_kernel
  err = np.linalg.norm(y - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
  assert 1e-3 < err.max() < 0.05, err

  grad = lambda x: jax.grad(lambda x: jnp.sum(layers.float8_matmul(x, kernel, kernel_scale) * ct))(x)
  assert float8_dots(grad, x) == [("float8_e4m3fn", "float8_e4m3fn")] * 2


def test_triton_gemms_are_off_unless_the_user_sets_them():
  show = [sys.executable, "-c", "import diffpipe_jax, os; print(os.environ['XLA_FLAGS'])"]
  run = lambda flags: subprocess.run(show, env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=flags),
                                     capture_output=True, text=True, check=True).stdout.strip()
  assert run("--xla_force_host_platform_device_count=2") == (
      "--xla_force_host_platform_device_count=2 --xla_gpu_enable_triton_gemm=false")
  assert run("--xla_gpu_enable_triton_gemm=true") == "--xla_gpu_enable_triton_gemm=true"


# ---- attention in pieces, against diffusers' attention modules -----------------------------------


def params_from_torch(module, torch_module, *inputs):
  """A Flax module's parameters from a torch module of the same names (kernels transposed)."""
  from diffpipe_jax.convert import table
  abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs))["params"]
  sd = {k: v.detach().numpy().copy() for k, v in torch_module.state_dict().items()}
  flat = {path: jnp.asarray(sd[table.diffusers_key(path)].T if path[-1] == "kernel" else
                            sd[table.diffusers_key(path)]) for path in table.flatten(abstract)}
  assert len(flat) == len(sd), sorted(set(sd) - {table.diffusers_key(p) for p in flat})
  return table.unflatten(flat)


def randomised(torch_module, seed):
  import torch
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in torch_module.parameters():
      p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
  return torch_module.eval()


def rope_tables(tokens, head_dim, seed):
  """Interleaved (cos, sin) tables [tokens, head_dim] of random 2-D positions."""
  ids = np.random.default_rng(seed).integers(0, 9, (tokens, 2)).astype(np.float32)
  return tuple(np.asarray(t) for t in layers.rope_tables(ids, (head_dim // 2, head_dim // 2), 256.0))


def key_mask(batch, length, valid):
  mask = np.zeros((batch, length), bool)
  for b, n in enumerate(valid):
    mask[b, :n] = True
  return mask


def test_cross_attention_with_a_padding_mask_matches_ltx_attention():
  """LTX-Video's attn2: q/k RMSNorm across heads, keys and values from the padded text."""
  import torch
  from diffusers.models.transformers.transformer_ltx import LTXAttention
  heads, head_dim, dim, ctx_dim = 3, 8, 20, 12
  ref = randomised(LTXAttention(dim, heads, heads, head_dim, cross_attention_dim=ctx_dim), 0)
  rng = np.random.default_rng(1)
  x, ctx = rng.standard_normal((2, 7, dim), np.float32), rng.standard_normal((2, 5, ctx_dim), np.float32)
  mask = key_mask(2, 5, (5, 2))
  ours = layers.CrossAttention(heads, head_dim, eps=1e-5)
  params = params_from_torch(ours, ref, x, ctx, mask)
  out = ours.apply({"params": params}, x, ctx, mask)
  bias = torch.from_numpy((1.0 - mask.astype(np.float32)) * -10000.0)[:, None]  # as LTX's forward
  with torch.no_grad():
    want = ref(torch.from_numpy(x), torch.from_numpy(ctx), bias).numpy()
  assert_close(out, want)
  # the mask matters: without it the padded tokens change the output
  unmasked = ours.apply({"params": params}, x, ctx)
  assert rel_err(unmasked, want) > 1e-3


DIFFUSERS_DOUBLE = dict(
    img=layers.StreamNames("norm1.linear", ("attn.to_q", "attn.to_k", "attn.to_v"),
                           ("attn.norm_q", "attn.norm_k"), "attn.to_out.0", ("ff.net.0.proj", "ff.net.2")),
    txt=layers.StreamNames("norm1_context.linear", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
                           ("attn.norm_added_q", "attn.norm_added_k"), "attn.to_add_out",
                           ("ff_context.net.0.proj", "ff_context.net.2")))
DIFFUSERS_SINGLE = layers.SingleStreamNames(
    "norm.linear", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), ("attn.norm_q", "attn.norm_k"),
    "proj_out")


def test_stream_blocks_with_text_last_and_rope_on_the_image_match_hunyuan_video():
  """The double- and single-stream blocks shared by Flux and HunyuanVideo, in HunyuanVideo's
  order ([image; text], RoPE on the image tokens only, padded text masked), named as diffusers
  names them, against diffusers' HunyuanVideo blocks."""
  import torch
  from diffusers.models.transformers import transformer_hunyuan_video as hv
  heads, head_dim, dim, img_len, txt_len = 3, 8, 24, 6, 4
  rng = np.random.default_rng(2)
  img, txt = rng.standard_normal((2, img_len, dim), np.float32), rng.standard_normal((2, txt_len, dim), np.float32)
  temb = rng.standard_normal((2, dim), np.float32)
  rope = rope_tables(img_len, head_dim, 3)
  mask = key_mask(2, img_len + txt_len, (10, 8))  # the second prompt has 2 padding tokens
  joined = np.concatenate([img, txt], axis=1)
  torch_in = lambda *a: [torch.from_numpy(np.array(v)) for v in a]
  torch_args = (*torch_in(img, txt, temb), torch.from_numpy(mask)[:, None, None, :],
                tuple(torch_in(*rope)))
  for ref, ours in (
      (hv.HunyuanVideoTransformerBlock(heads, head_dim, mlp_ratio=2.0),
       layers.DoubleStreamBlock(heads, 2.0, txt_len, **DIFFUSERS_DOUBLE, text_first=False)),
      (hv.HunyuanVideoSingleTransformerBlock(heads, head_dim, mlp_ratio=2.0),
       layers.SingleStreamBlock(heads, 2.0, DIFFUSERS_SINGLE))):
    ref = randomised(ref, 4)
    params = params_from_torch(ours, ref, joined, rope, temb, mask)
    out = ours.apply({"params": params}, joined, rope, temb, mask)
    with torch.no_grad():
      want = torch.cat(ref(*torch_args), dim=1).numpy()
    assert_close(out, want, what=type(ref).__name__)
    # the mask matters: without it the padded tokens change the output
    assert rel_err(ours.apply({"params": params}, joined, rope, temb), want) > 1e-3
