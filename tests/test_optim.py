"""The optimizers diffusion-pipe's users pick (optim.make), force_constant_lr, and bfloat16 LoRAs:
small random LoRA-shaped trees, each optimizer compared with an independent reference."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from conftest import family_config
from tolerances import FLOAT32_REORDERING, assert_close
from diffpipe_jax import optim, schema, sharding, stacks, training_step, validate
from diffpipe_jax.sharding import pipeline as pipeline_lib

# one matrix of 4096 values (8-bit moments in adamw8bit), one smaller (float32 moments)
SHAPES = {"block": {"lora_A": (256, 16), "lora_B": (16, 64)}}


def config(kind, dtype="float32", lr=1e-4, **keys):
  c = family_config("flux")
  c.optimizer.type, c.adapter.dtype, c.optimizer.lr = kind, dtype, lr
  for key, value in keys.items():  # "section.key" too
    section, _, leaf = key.rpartition(".")
    (c[section] if section else c)[leaf] = value
  return c


def random_tree(seed, shapes=SHAPES):
  leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, s) for k, s in zip(keys, leaves)])


INIT = optax.tree.cast(optax.tree.cast(random_tree(0), jnp.bfloat16), jnp.float32)  # bf16-exact
TARGET = jax.tree.map(lambda p: p + 0.3, INIT)


def train(tx, dtype, steps, noise=0.0):
  """The state after `steps` updates toward TARGET (gradient p - TARGET plus noise, in the
  LoRA's dtype), through `training_step.apply_gradients`; the optimizer states after each step."""
  state = dict(lora=optax.tree.cast(INIT, dtype), step=jnp.zeros((), jnp.int32))
  state["opt_state"] = tx.init(state["lora"])

  @jax.jit
  def step(state, key):
    g = jax.tree.map(lambda p, t, n: (p.astype(jnp.float32) - t + noise * n).astype(p.dtype),
                     state["lora"], TARGET, random_tree(key))
    return training_step.apply_gradients(state, 0.0, g, tx=tx)[0]
  states = []
  for i in range(steps):
    states.append(state := step(state, i + 1))
  return state, states


def mean_distance(a, b):
  return np.mean([np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).mean()
                  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))])


def state_bytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_adamw_optimi_in_float32_is_adamw():
  adamw, _ = train(optim.make(config("adamw"), 100)[0], "float32", 5)
  optimi, _ = train(optim.make(config("adamw_optimi"), 100)[0], "float32", 5)
  assert jax.tree.all(jax.tree.map(np.array_equal, optimi["lora"], adamw["lora"]))
  assert jax.tree.structure(optimi["opt_state"]) == jax.tree.structure(adamw["opt_state"])


def test_adamw_optimi_bfloat16_follows_float32():
  """Steps of 1e-4 on weights ~1 are below half a bfloat16 step: rounded away without Kahan."""
  reference, _ = train(optim.make(config("adamw"), 1000)[0], "float32", 200)
  plain, _ = train(optim.make(config("adamw", "bfloat16"), 1000)[0], "bfloat16", 200)
  kahan, _ = train(optim.make(config("adamw_optimi", "bfloat16"), 1000)[0], "bfloat16", 200)
  assert {x.dtype for x in jax.tree.leaves(kahan["lora"])} == {jnp.dtype(jnp.bfloat16)}
  moved = mean_distance(reference["lora"], INIT)
  assert moved > 0.015  # 200 steps of 1e-4 (Adam's first steps are lr * sign(g))
  assert mean_distance(plain["lora"], reference["lora"]) > 0.9 * moved  # bf16 alone: stuck
  # (what remains: the compensation's own bfloat16 rounding, as optimi's)
  assert mean_distance(kahan["lora"], reference["lora"]) < 0.15 * moved


def test_kahan_summation_stores_the_rounded_sum():
  """apply_updates(p, u') is bf16(p + u + c), exactly, and c' keeps the rest; when p shrinks
  2^20-fold in one step (u' not exact in float32), c' keeps what the stored weight misses."""
  kahan = optim.kahan_summation()
  p = optax.tree.cast(random_tree(1), jnp.bfloat16)
  scaled = lambda scale, seed: jax.tree.map(lambda x: scale * x, random_tree(seed))
  c = optax.tree.cast(scaled(1e-3, 2), jnp.bfloat16)
  shrink = jax.tree.map(lambda x: -np.float32(x) * (1 - 2.0 ** -20), p)
  for u, c, exact in ((scaled(3e-4, 3), c, True), (random_tree(4), c, True),
                      (shrink, optax.tree.cast(scaled(1e-7, 5), jnp.bfloat16), False)):
    new_u, state = kahan.update(u, optim.KahanState(c), p)
    stored = optax.apply_updates(p, new_u)
    for p_, u_, c_, s_, c_new in zip(*map(jax.tree.leaves, (p, u, c, stored, state.compensation))):
      target = np.float32(p_) + np.float32(u_) + np.float32(c_)  # the sum in float32
      assert s_.dtype == c_new.dtype == jnp.bfloat16
      if exact:
        np.testing.assert_array_equal(s_, target.astype(ml_dtypes.bfloat16))
      rest = np.float64(target) - np.float64(s_)
      np.testing.assert_allclose(np.float64(c_new), rest, rtol=2 ** -8, atol=1e-30)
      assert np.abs(rest).max() > 0


def test_quantize_round_trip():
  """Float8 codes: 1/16 relative precision down to 2^-6 / 448 of a block's largest value (and
  zeros exact); each leading index quantized alone, as a layer stored per layer would be."""
  x = np.array(random_tree(5, (3, 50, 40)) * np.logspace(-5, 0, 40))
  x[0, :10] = 0
  q = optim.quantize(jnp.asarray(x))
  assert q.dtype == jnp.uint8 and q.shape == (3, 2000 + 4 * 8)
  np.testing.assert_array_equal(q[1], optim.quantize(jnp.asarray(x[1])))
  y = np.asarray(optim.dequantize(q, x.shape))
  blocks_max = np.abs(np.pad(x.reshape(3, -1), [(0, 0), (0, 48)]).reshape(3, 8, 256)).max(-1)
  floor = np.repeat(blocks_max, 256, -1)[:, :2000].reshape(x.shape) * 2.0 ** -6 / 448
  assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) / 16, floor))
  assert np.all(y[0, :10] == 0) and np.all(np.sign(y) * np.sign(x) >= 0)


def test_adamw8bit_tracks_adamw():
  tx8, _ = optim.make(config("AdamW8bit", lr=1e-2), 100)  # the case diffusion-pipe's users write
  reference, _ = train(optim.make(config("adamw", lr=1e-2), 100)[0], "float32", 50, noise=0.5)
  state, _ = train(tx8, "float32", 50, noise=0.5)
  moments = optax.tree.get(state["opt_state"], "mu")
  assert moments["block"]["lora_A"].dtype == jnp.uint8  # 4096 values: 8 bits
  assert moments["block"]["lora_B"].dtype == jnp.float32  # 1024: float32, as bitsandbytes
  assert mean_distance(state["lora"], reference["lora"]) < 0.03 * mean_distance(reference["lora"], INIT)
  big = random_tree(0, {"a": (8, 256, 64)})  # where it counts, a quarter of adamw's state
  eight_bit, adamw = (state_bytes(optim.make(config(kind), 100)[0].init(big))
                      for kind in ("adamw8bit", "adamw"))
  assert eight_bit < 0.26 * adamw


def test_prodigy_estimates_the_learning_rate():
  tx, lr_fn = optim.make(config("Prodigy", lr=1.0), 100)
  state, states = train(tx, "float32", 60)
  estimates = [float(optax.tree.get(s["opt_state"], "estim_lr")) for s in states]
  assert lr_fn(50) == 1.0
  assert 1e-6 < estimates[5] < estimates[20] < estimates[-1]  # from its initial 1e-6
  # each update's metrics carry the estimate it used (train/lr logs the schedule times it)
  metrics = training_step.apply_gradients(states[20], 0.0, states[20]["lora"], tx=tx)[1]
  assert float(metrics["estim_lr"]) == estimates[20]
  adamw, _ = optim.make(config("adamw"), 100)
  adamw_state = dict(lora=INIT, opt_state=adamw.init(INIT), step=jnp.zeros((), jnp.int32))
  assert "estim_lr" not in training_step.apply_gradients(adamw_state, 0.0, INIT, tx=adamw)[1]
  assert mean_distance(state["lora"], TARGET) < 0.3 * mean_distance(INIT, TARGET)


def test_force_constant_lr_overrides_the_schedule_and_a_resumed_state():
  schedule = dict(warmup_steps=100, lr_scheduler="cosine", **{"optimizer.weight_decay": 0.0})
  scheduled, forced = config("adamw", **schedule), config("adamw", force_constant_lr=3e-4, **schedule)
  (tx, lr_fn), (forced_tx, forced_lr) = optim.make(scheduled, 2000), optim.make(forced, 2000)
  assert forced_lr(0) == forced_lr(1000) == 3e-4 and lr_fn(0) == 0 and lr_fn(1000) < 1e-4
  # a run without it, resumed with it: the same state, continued at the constant lr
  state, _ = train(tx, "float32", 3)
  assert jax.tree.structure(forced_tx.init(INIT)) == jax.tree.structure(state["opt_state"])
  g = random_tree(6)
  (u, _), (u_forced, _) = (t.update(g, state["opt_state"], state["lora"]) for t in (tx, forced_tx))
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_forced)):
    np.testing.assert_allclose(b, a * (3e-4 / lr_fn(3)), rtol=1e-5)


def test_optimizer_type_rule():
  for name in ("AdamW8bit", "Prodigy", "adamw_optimi", "ADAMW"):
    assert validate.value_problems({"optimizer.type": name}, schema.SHARED) == []
  [problem] = validate.value_problems({"optimizer.type": "automagic"}, schema.SHARED)
  assert problem == ("optimizer.type='automagic': must be one of 'adamw', 'adamw_optimi', "
                     "'adamw8bit', 'prodigy', in any case (automagic: no maintained JAX library "
                     "implements it)")


@pytest.mark.parametrize("kind", optim.OPTIMIZERS)
def test_optimizer_state_in_every_placement(kind):
  """The state is placed as the LoRA (per pipeline stage), and its updates there are those of
  the stacked form, on the second step too (read from the state). (The programs differ:
  with 8-bit moments, a float8 code may round the other way.) Unrolled, the training state's
  LoRA is stored per layer, its optimizer state stacked, as the update reads it."""
  shapes = {"blocks": {"lora_A": (5, 256, 16), "lora_B": (5, 16, 64)}, "proj": {"lora_A": (64, 4)}}
  lora, grads = random_tree(8, shapes), [random_tree(9, shapes), random_tree(10, shapes)]
  tx, _ = optim.make(config(kind, "bfloat16"), 100)
  plan = pipeline_lib.make_plan([("blocks", 5, 1.0)], stages=2, microbatches=2)
  placements = [sharding.Placement(None, ("blocks",)), sharding.Placement(None, ("blocks",), plan)]
  unrolled = sharding.Placement(None, ("blocks",), unrolled=True).to_stages(
      dict(lora=lora, opt_state=tx.init(lora)))
  assert all(isinstance(a, stacks.LayerArrays) for a in unrolled["lora"]["blocks"].values())
  assert jax.tree.structure(unrolled["opt_state"]) == jax.tree.structure(tx.init(lora))

  def second_update(placement):
    params = placement.to_stages(optax.tree.cast(lora, jnp.bfloat16))
    state = placement.to_stages(tx.init(placement.to_layers(params)))
    for g in grads:
      u, state = tx.update(placement.to_stages(g), state, params)
    return placement.to_layers(u)
  plain, staged = (jax.jit(second_update, static_argnums=0)(placement) for placement in placements)
  # an 8-bit moment whose code rounds the other way moves its entry of the update by up to 1/8
  # (3 mantissa bits): ~8e-4 of the 26,000 entries' norm, 1e-2 for some 150 of them
  assert_close(staged, plain, bound=1e-2 if kind == "adamw8bit" else FLOAT32_REORDERING)


@pytest.mark.parametrize("kind", optim.OPTIMIZERS)
def test_bfloat16_lora_keeps_its_dtype(kind):
  """Every optimizer, gradients in bfloat16 or float32: the LoRA stays bfloat16, the state keeps
  its dtypes, its moments float32 (or 8-bit)."""
  tx, _ = optim.make(config(kind, "bfloat16", lr=1e-2), 100)
  lora = optax.tree.cast(INIT, jnp.bfloat16)
  state = dict(lora=lora, opt_state=tx.init(lora), step=jnp.zeros((), jnp.int32))
  dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)
  changed = lambda a, b: not jax.tree.all(jax.tree.map(np.array_equal, a, b))
  for g_dtype in (jnp.bfloat16, jnp.float32):
    new, _ = training_step.apply_gradients(state, 0.0, optax.tree.cast(random_tree(7), g_dtype), tx=tx)
    assert dtypes(new) == dtypes(state)
    if kind == "prodigy":  # its first steps (its initial estimate is 1e-6) are below bf16's precision
      assert changed(*(optax.tree.get(s["opt_state"], "exp_avg") for s in (new, state)))
    else:
      assert changed(new["lora"], lora)
  moments = {x.dtype for x in jax.tree.leaves(state["opt_state"]) if x.shape == (16, 64)}
  assert moments == ({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)} if kind == "adamw_optimi"
                     else {jnp.dtype(jnp.float32)})  # the Kahan compensation is bfloat16
