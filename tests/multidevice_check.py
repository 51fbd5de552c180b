"""Run in its own process with 8 fake CPU devices (see test_sharding.py), for a family's tiny
model (`multidevice_check.py <model type> <checkpoint> <placements> [key=value ...]`, the
config's tiny variant with those `model` keys set, placements such as
"2x1,1x2,8x1u,2x2@4,2x1x4": data x stages [x sequence_parallel], u for unrolled layers, @
diffusion-pipe's partition_split, ":"-separated): in every placement the loss and LoRA gradients of
a step, and a short training run, equal one device's, and the update compiles once; with
sequence parallelism the step's program holds the attention's all-to-alls, and samples drawn in
the placement equal one device's, their steps compiled once.

The tiny models' stacks are a few blocks deep (Flux: 2 double and 3 single blocks), so 2, 4 and
8 stages split unevenly and carry padding layers."""
import functools
import os
import re
import sys
import threading

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from conftest import family_config  # noqa: E402
from tolerances import assert_close  # noqa: E402
from diffpipe_jax import (family as family_lib, lora, models, optim, runtime, sampling,  # noqa: E402
                          sequence, sharding, training_step)


def parse_placements(text):
  """"2x1,8x1u,1x4@2:4:5,2x1x4u" -> ((2, 1, 1, False, ()), (8, 1, 1, True, ()),
  (1, 4, 1, False, (2, 4, 5)), (2, 1, 4, True, ())): (data, stage, seq, unrolled,
  partition_split) each."""
  def parse(placement):
    shape, _, split = placement.partition("@")
    unrolled = shape.endswith("u")
    data, stage, seq = (shape.rstrip("u").split("x") + ["1"])[:3]
    split = tuple(int(a) for a in split.split(":") if a)
    return int(data), int(stage), int(seq), unrolled, split
  return tuple(map(parse, text.split(",")))


COMPILES = []  # (thread, function) of each compilation
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, fun_name="", **kw: COMPILES.append((threading.current_thread().name, fun_name))
    if event == "/jax/core/compile/backend_compile_duration" else None)


def batches_for(fam, cfg, step, mesh, batch=32, accum=4):
  local = fam.random_batch(cfg, batch, seed=step)
  local = jax.tree.map(lambda x: x.reshape(accum, batch // accum, *x.shape[1:]), local)
  return sharding.global_batch(mesh, local)


def run(fam, path, config, data, stages, seq=1, unrolled=False, partition_split=(), steps=3, accum=4):
  """(step-0 loss, step-0 LoRA gradients, losses of `steps` updates, final LoRA), in the stacked form."""
  mesh = sharding.make_mesh(stages, jax.devices()[:data * stages * seq], seq)
  with sequence.parallel(mesh):
    return run_on(mesh, fam, path, config, stages, unrolled, partition_split, steps, accum)


def run_on(mesh, fam, path, config, stages, unrolled, partition_split, steps, accum):
  placement = sharding.make_placement(mesh, fam.stacks(models.checkpoint_config(fam.type, path)),
                                      accum, unrolled=unrolled, partition_split=partition_split,
                                      layers_around_stacks=fam.layers_around_stacks)
  model = models.load(fam.type, path, runtime=runtime.Runtime.of(placement), placement=placement,
                      progress=False)
  tx, _ = optim.make(config, steps)
  layer_params = models.abstract_params(fam, model.module, model.config)
  adapter = lora.init(layer_params, fam.lora_targets, 4, jnp.float32, jax.random.key(0))
  # a random, non-zero B: gradients reach A too (a B constant over its outputs gives A none where
  # the output feeds mean-free LayerNorms alone, as Wan's ungated cross-attention output does)
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  adapter = tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
  state = placement.create(functools.partial(training_step.init_state, layer_params=layer_params,
                                          config=config, tx=tx, family=fam), None, adapter)
  grads = training_step.grad_fn(model, config)
  step = training_step.make_step(model, config, tx, placement)  # unrolled: split into programs per block
  keys = jax.random.split(jax.random.key(99), accum)
  args = (state["lora"], model.params, batches_for(fam, model.config, 0, mesh), keys)
  loss0, grads0 = (grads if placement.unrolled else jax.jit(grads))(*args)
  if mesh.shape["seq"] > 1 and not placement.unrolled:
    assert "all-to-all" in jax.jit(grads).lower(*args).compile().as_text()
  losses, compiles = [], len(COMPILES)
  for i in range(steps):
    state, m = step(state, model.params, batches_for(fam, model.config, i, mesh), jax.random.key(i))
    losses.append(float(m["loss"]))
  # the update (unrolled: in the thread that compiles it beside the first step) compiled once:
  # each step's state leaves in the shardings it came in
  updates = [thread.startswith("compile") for thread, fun in COMPILES[compiles:]
             if re.search("apply_gradients" if placement.unrolled else "step_in_placement", fun)]
  assert updates == [placement.unrolled], COMPILES[compiles:]
  plain = jax.jit(placement.to_layers)
  latents = sampled(fam, model, config, placement, adapter) if mesh.size == 1 or mesh.shape["seq"] > 1 else None
  return (float(loss0), jax.device_get(plain(grads0)), losses, jax.device_get(plain(state["lora"])),
          latents, placement)


def sampled(fam, model, config, placement, adapter, steps=3):
  """The latents of two prompts after `steps` Euler steps with the adapter, drawn as training
  draws its samples in this placement; no step after the first compiles anything."""
  batch = fam.random_batch(model.config, 2, seed=5)
  noise = batch.pop("latents")
  uncond = {k: v[:1] for k, v in batch.items() if k != "position_ids"}
  compiles = []
  latents = sampling.denoise(
      model, model.params, placement.create(lambda a: a, adapter), config.model, batch, noise, (16,), steps,
      4.0, uncond, sampling.step_fn(model, config.model, 4.0),
      functools.partial(sharding.whole_rows, placement.mesh), lambda i: compiles.append(len(COMPILES)))
  assert compiles[0] == compiles[-1], COMPILES[compiles[0]:]
  return np.asarray(latents)


def main(model_type, path, placements, *model_keys):
  assert len(jax.devices()) == 8
  fam, config = family_lib.get(model_type), family_config(model_type)
  for setting in model_keys:
    key, value = setting.split("=")
    config.model[key] = type(config.model[key])(value)
  ref_loss, ref_grads, ref_losses, ref_lora, ref_latents, _ = run(fam, path, config, 1, 1)
  for data, stages, seq, unrolled, split in parse_placements(placements):
    loss, grads, losses, adapter, latents, placement = run(fam, path, config, data, stages, seq, unrolled, split)
    if placement.plan is not None:
      print(placement.plan.describe())
    name = (f"(data, stage, seq) = ({data}, {stages}, {seq}){', unrolled' if unrolled else ''}"
            f"{f', partition_split={list(split)}' if split else ''}")
    assert_close(loss, ref_loss, what=f"{name}: loss")
    assert_close(grads, ref_grads, what=f"{name}: gradients")
    assert_close(losses, ref_losses, what=f"{name}: losses")
    # over the whole LoRA: Adam amplifies the rounding of near-zero gradients entry by entry
    assert_close(adapter, ref_lora, what=f"{name}: LoRA")
    if latents is not None:  # sequence parallelism's samples
      assert_close(latents, ref_latents, what=f"{name}: samples")
    print(f"{name}: loss, gradients, losses {losses}{' and samples' if latents is not None else ''} "
          "match one device")
  print("ok")


if __name__ == "__main__":
  main(*sys.argv[1:])
