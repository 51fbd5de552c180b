"""Run in its own process with 8 fake CPU devices (see test_sharding.py): on every (data, stage)
layout the loss and LoRA gradients of a step, and a short training run, equal one device's.

The tiny model has 2 double and 3 single blocks, so 2, 4 and 8 stages all split unevenly and
carry padding layers."""
import functools
import os
import sys
import threading

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from diffpipe_jax import lora, models, optim, sharding, train  # noqa: E402
from diffpipe_jax.models import flux  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
import flux as flux_configs  # noqa: E402

# (data, stage, scan_layers): data parallel, unrolled (every stacked leaf stored per layer),
# pipelines of 2, 4 (with data parallelism) and 8 stages
LAYOUTS = ((2, 1, True), (8, 1, False), (1, 2, True), (2, 4, True), (1, 8, True))


UPDATE_COMPILES = []  # the threads that compiled an optimizer update
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, fun_name="", **kw: UPDATE_COMPILES.append(threading.current_thread().name)
    if event == "/jax/core/compile/backend_compile_duration" and "apply_gradients" in fun_name else None)


def batches_for(cfg, step, mesh, batch=32, accum=4):
  local = flux.random_batch(cfg, batch, 4, 4, 6, seed=step)
  local = jax.tree.map(lambda x: x.reshape(accum, batch // accum, *x.shape[1:]), local)
  return sharding.global_batch(mesh, local)


def run(path, config, data, stages, scan_layers=True, steps=3, accum=4):
  """(step-0 loss, step-0 LoRA gradients, losses of `steps` updates, final LoRA), plain layout."""
  mesh = sharding.make_mesh(stages, jax.devices()[:data * stages])
  layout = sharding.make_layout(mesh, flux, models.checkpoint_config("flux", path), accum,
                                scan_layers=scan_layers)
  model = models.load("flux", path, layout=layout, scan_layers=scan_layers, progress=False)
  tx, _ = optim.make(config, steps)
  layer_params = models.abstract_params(flux, model.module, model.config)
  adapter = lora.init(layer_params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
  adapter = jax.tree.map(lambda x: x + 0.05, adapter)  # non-zero B: gradients reach A too
  state = layout.create(functools.partial(train.init_state, layer_params=layer_params,
                                          config=config, tx=tx, family=flux), None, adapter)
  grads = train.grad_fn(model, config, layout.pipeline, split=layout.per_layer)
  step = train.make_step(model, config, tx, layout)  # unrolled: split into programs per block
  keys = jax.random.split(jax.random.key(99), accum)
  loss0, grads0 = (grads if layout.per_layer else jax.jit(grads))(
      state["lora"], model.params, batches_for(model.config, 0, mesh), keys)
  losses, compiles = [], len(UPDATE_COMPILES)
  for i in range(steps):
    state, m = step(state, model.params, batches_for(model.config, i, mesh), jax.random.key(i))
    losses.append(float(m["loss"]))
  if layout.per_layer:  # compiled once, in the thread that compiles it beside the first step
    assert [t.startswith("compile") for t in UPDATE_COMPILES[compiles:]] == [True], UPDATE_COMPILES
  plain = jax.jit(layout.to_layers)
  return float(loss0), jax.device_get(plain(grads0)), losses, jax.device_get(plain(state["lora"])), layout


def main(path):
  assert len(jax.devices()) == 8
  config = flux_configs.get_config("tiny")
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  ref_loss, ref_grads, ref_losses, ref_lora, _ = run(path, config, 1, 1)
  for data, stages, scan_layers in LAYOUTS:
    loss, grads, losses, adapter, layout = run(path, config, data, stages, scan_layers)
    if layout.plan is not None:
      print(layout.plan.describe())
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      assert rel(a, b) <= 1e-5, rel(a, b)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(adapter), jax.tree.leaves(ref_lora)):
      assert rel(a, b) <= 1e-5, rel(a, b)  # Adam amplifies noise of near-zero gradients elementwise
    print(f"(data, stage) = ({data}, {stages}){'' if scan_layers else ', unrolled'}: loss, gradients and losses {losses} match one device")
  print("ok")


if __name__ == "__main__":
  main(sys.argv[1])
