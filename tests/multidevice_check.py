"""Run in its own process with 8 fake CPU devices (see test_sharding.py): on (data) meshes of 1,
2, 4 and 8 devices the LoRA gradients, losses and a short training run equal one device's."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from diffpipe_jax import lora, models, optim, sharding, train  # noqa: E402
from diffpipe_jax.models import flux  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
import flux as flux_configs  # noqa: E402


def run(model, config, mesh, steps=3, batch=16, accum=2):
  tx, _ = optim.make(config, steps)
  replicated = sharding.tree_shardings(mesh, model.params)
  params = jax.device_put(model.params, replicated)
  adapter = lora.init(model.params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
  adapter = jax.tree.map(lambda x: x + 0.05, adapter)  # non-zero B: gradients reach A too
  state = dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))
  state = jax.device_put(state, sharding.tree_shardings(mesh, state))
  step = jax.jit(lambda s, p, b, k: train.train_step(
      s, p, b, k, tx=tx, loss=lambda *a: train.loss_fn(*a, model=model, config=config)))
  grad_fn = jax.jit(jax.grad(lambda a, p, b, k: train.loss_fn(a, p, b, k, model=model, config=config)))
  losses, grads = [], None
  for i in range(steps):
    inputs = flux.random_inputs(model.config, batch, 4, 4, 6, seed=i)
    local = dict(latents=inputs["hidden_states"], text=inputs["encoder_hidden_states"],
                 pooled=inputs["pooled_projections"], img_ids=np.stack([inputs["img_ids"]] * batch))
    local = jax.tree.map(lambda x: x.reshape(accum, batch // accum, *x.shape[1:]), local)
    batches = sharding.global_batch(mesh, local)
    if grads is None:  # the gradient of one micro-batch, before any update
      grads = jax.device_get(grad_fn(state["lora"], params, jax.tree.map(lambda x: x[0], batches),
                                     jax.random.key(99)))
    state, m = step(state, params, batches, jax.random.key(i))
    losses.append(float(m["loss"]))
  return losses, grads, jax.device_get(state["lora"])


def main(path):
  assert len(jax.devices()) == 8
  model = models.load("flux", path, progress=False)
  config = flux_configs.get_config("tiny")
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  ref_losses, ref_grads, ref_lora = run(model, config, sharding.make_mesh(1, jax.devices()[:1]))
  for n in (2, 4, 8):
    losses, grads, adapter = run(model, config, sharding.make_mesh(1, jax.devices()[:n]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      assert rel(a, b) <= 1e-5, rel(a, b)
    for a, b in zip(jax.tree.leaves(adapter), jax.tree.leaves(ref_lora)):
      assert rel(a, b) <= 1e-5, rel(a, b)  # Adam amplifies noise of near-zero gradients elementwise
    print(f"data={n}: losses {losses} match one device")
  print("ok")


if __name__ == "__main__":
  main(sys.argv[1])
