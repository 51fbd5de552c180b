"""programs: a function of unrolled layers run as programs per block gives what jax gives for
the whole function, and compiles the same programs whatever the number of layers."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jaxpr_equations
from tolerances import assert_close
from diffpipe_jax import programs, stacks


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, scale):
    w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1],) * 2)
    return x + jnp.tanh(programs.keep(x @ w + x @ self.get_variable("lora", "a"))) * scale


def model(adapter, weights, x, scale, remat=None):
  """A head that the adapter reaches, unrolled blocks (their index a literal; each under
  jax.checkpoint with policy `remat`, if given), an integer passed between pieces and a
  constant: a scalar."""
  h = jnp.sin(x) * adapter["head"] + jnp.asarray(np.linspace(0, 1, x.shape[-1]), x.dtype)
  block = functools.partial(stacks.block_program, Block())
  if remat is not None:
    block = jax.checkpoint(block, policy=remat, prevent_cse=False)
  for i, (w, a) in enumerate(zip(weights, adapter["layers"])):
    h = block(h, {"w": w}, {"a": a}, (scale,), None, i)
  top = jnp.argmax(h[0])
  return jnp.mean(h ** 2) + h[0, top]


def arguments(n_layers, width, seed=0):
  keys = iter(jax.random.split(jax.random.key(seed), 2 * n_layers + 2))
  normal = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(width)
  adapter = dict(head=normal(width) + 1, layers=[normal(width, width) for _ in range(n_layers)])
  return adapter, [normal(width, width) for _ in range(n_layers)], normal(3, width), jnp.float32(0.5)


def test_per_block_gives_jax_value_and_gradient():
  args = arguments(4, 8)
  want_value, want_grad = jax.value_and_grad(model)(*args)
  value, grad = programs.value_and_grad(model)(*args)
  assert_close(value, want_value, what="value")
  assert_close(grad, want_grad, what="gradient")
  assert_close(programs.per_block(model)(*args), model(*args), what="per_block value")


@pytest.mark.parametrize("remat", [None, jax.checkpoint_policies.nothing_saveable])
def test_programs_do_not_grow_with_the_layers(remat):
  """Every layer of a stack reuses one forward and one backward program: a model of 6 layers
  lowers as many programs as one of 2 (each of its own width, so that nothing is shared)."""
  lowered = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _, **kw: lowered.append(kw.get("fun_name"))
      if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)
  counts = []
  for n_layers, width in ((2, 5), (6, 7)):
    args, same_shapes = arguments(n_layers, width), arguments(n_layers, width, seed=1)
    step = programs.value_and_grad(functools.partial(model, remat=remat))
    start = len(lowered)  # the step's programs only, not those that made its arguments
    step(*args)
    counts.append(len(lowered) - start)
    step(*same_shapes)  # nothing new
    assert len(lowered) - start == counts[-1]
  assert counts[0] == counts[1], (counts, lowered)


def test_remat_blocks_keep_no_residuals_and_host_weights_are_copied_once_a_pass(monkeypatch):
  """A block call under jax.checkpoint (per-block remat) is a piece of the checkpoint's policy:
  with nothing saveable its forward program returns no residuals (the backward program
  recomputes the block from its inputs, passed again). Weights in pinned host memory (swapped
  blocks) are copied to the device once for the forward and once for the backward pass, and
  everything gives what jax gives."""
  n_layers, nothing = 5, jax.checkpoint_policies.nothing_saveable
  args = arguments(n_layers, 8)
  want_value, want_grad = jax.value_and_grad(model)(*args)
  remat = functools.partial(model, remat=nothing)
  steps = programs.pieces(jax.make_jaxpr(remat)(*args))
  blocks = [n for n, piece in enumerate(steps) if piece.policy is nothing]
  assert len(blocks) == n_layers
  plan = programs._differentiated_inputs(jax.make_jaxpr(remat)(*args).jaxpr, steps,
                                         len(jax.tree.leaves(args[0])))
  h = jnp.ones_like(args[2])
  block_args = [h, args[1][0], args[0]["layers"][0], args[3]]
  # keeping what the block marks: the sum of its two matmuls, once (not each matmul's output)
  for policy, residuals in ((nothing, 0), (programs.keeps_for_backward, 1)):
    program = programs._Differentiated(steps[blocks[0]].jaxpr, plan[blocks[0]], policy,
                                          programs.JIT_OPTIONS)
    diff, rest = program.ordered(block_args + [0])
    assert len(program.forward(diff, rest)[1]) == residuals, policy

  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  swapped = (0, 2, 3)
  weights = [jax.device_put(w, host) if i in swapped else w for i, w in enumerate(args[1])]
  copied = []
  device_put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: copied.extend(
      leaf.sharding.memory_kind for leaf in jax.tree.leaves(x)) or device_put(x, *a, **k))
  for fn in (model, remat):
    copied.clear()
    value, grad = programs.value_and_grad(fn)(args[0], weights, *args[2:])
    assert copied == ["pinned_host"] * 2 * len(swapped), copied
    assert_close(value, want_value, what="value")
    assert_close(grad, want_grad, what="gradient")
    copied.clear()
    assert_close(programs.per_block(fn)(args[0], weights, *args[2:]), want_value, what="per_block value")
    assert copied == ["pinned_host"] * len(swapped), copied


def test_offloaded_block_inputs_wait_in_host_memory(monkeypatch):
  """`offload`: each remat block's input that only its backward program reads again (the one
  from the piece before; not a weight, the LoRA, nor the scale every block reads) is copied to
  pinned host memory after its forward program and back once for its backward program;
  swapped weights are copied as before, and everything gives what jax gives."""
  n_layers, swapped = 5, (1, 3)
  args = arguments(n_layers, 8)
  want_value, want_grad = jax.value_and_grad(model)(*args)
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  weights = [jax.device_put(w, host) if i in swapped else w for i, w in enumerate(args[1])]
  moves, device_put = [], jax.device_put

  def recorded(x, *a, **k):
    out = device_put(x, *a, **k)
    moves.extend((src.sharding.memory_kind, dst.sharding.memory_kind, src.shape)
                 for src, dst in zip(jax.tree.leaves(x), jax.tree.leaves(out)))
    return out
  monkeypatch.setattr(jax, "device_put", recorded)
  remat = functools.partial(model, remat=jax.checkpoint_policies.nothing_saveable)
  value, grad = programs.value_and_grad(remat, offload=True)(args[0], weights, *args[2:])
  assert_close(value, want_value, what="value")
  assert_close(grad, want_grad, what="gradient")
  block_input, weight = args[2].shape, args[1][0].shape
  assert sorted(moves) == sorted([("device", "pinned_host", block_input)] * n_layers
                                 + [("pinned_host", "device", block_input)] * n_layers
                                 + [("pinned_host", "device", weight)] * 2 * len(swapped)), moves


class Modulated(nn.Module):
  """A block modulated by an embedding of the time (marked `ahead`), whose matmul reads a slice
  of its weight, and which marks a value of its input too."""
  @nn.compact
  def __call__(self, x, time_embedding):
    d = x.shape[-1]
    w = self.param("w", nn.initializers.lecun_normal(), (d, 2 * d))
    shift, scale = jnp.split(programs.ahead(time_embedding @ w), 2, axis=-1)
    return x @ w[:, :d] * (1 + scale) + shift + programs.ahead(jnp.mean(x))


def modulated_model(weights, x, t):
  time_embedding = jnp.stack([jnp.cos(t), jnp.sin(t)] * (x.shape[-1] // 2))[None]
  for i, w in enumerate(weights):
    x = stacks.block_program(Modulated(), x, {"w": w}, None, (time_embedding,), None, i)
  return x


def test_values_ahead_of_calls_are_computed_once_for_every_call():
  """What a loop's calls mark `ahead` and compute from the varying argument (t) without the
  carried one (x) is computed for every call in one program, a row a call; each call then gives
  what the function gives, computing only the rest: the matmuls of x (with their weight
  slices), and the marked value that depends on x."""
  n_layers, width = 3, 4
  weights = [jax.random.normal(jax.random.key(i), (width, 2 * width)) for i in range(n_layers)]
  x, ts = jax.random.normal(jax.random.key(9), (2, width)), np.float32([0.9, 0.5, 0.1])
  loop = programs.ahead_of_calls(modulated_model, carried=1, varying=(2,))
  values = loop.values(weights, x, ts)
  assert [[v.shape for v in call] for call in values] == [[(1, 2 * width)] * n_layers] * len(ts)
  call = jax.jit(loop.call)
  for n, t in enumerate(ts):
    want = modulated_model(weights, x, t)
    assert_close(call(values[n], weights, x, t), want, what="call")
    assert_close(programs.per_block(loop.call)(values[n], weights, x, t), want, what="per_block call")
  eqns = list(jaxpr_equations(jax.make_jaxpr(loop.call)(values[0], weights, x, ts[0]).jaxpr))
  assert sum(e.primitive.name == "dot_general" for e in eqns) == n_layers  # x @ w[:, :d] only
  assert sum(e.params.get("name") == programs.AHEAD for e in eqns) == n_layers  # mean(x)
