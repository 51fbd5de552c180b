"""LoRA training end to end: the step learns, exports load in diffusers, runs resume exactly."""
import copy
import dataclasses
import functools
import glob
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from diffpipe_jax import lora, models, optim, sharding, train
from diffpipe_jax.models import flux
from diffpipe_jax.models.layers import is_layer_arrays, swapped_stacks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import flux as flux_configs  # noqa: E402  configs/flux.py


def tiny_config(**overrides):
  config = flux_configs.get_config("tiny")
  config.update_from_flattened_dict(overrides)
  return config


def run_main(tmp_path, *args, output="out", devices=1, shared_compilation_cache=True):
  """main.py on the tiny variant, its model and images generated under tmp_path; compiled
  programs in the test session's cache (conftest.py), or else where the config says."""
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  if not shared_compilation_cache:
    del env["JAX_COMPILATION_CACHE_DIR"]
  return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "--config",
                         os.path.join(ROOT, "configs", "flux.py") + ":tiny",
                         f"--config.output_dir={tmp_path}/{output}", *args],
                        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)


def trained_adapter(model, config, steps, samples=2):
  """Runs the real jitted train step `steps` times on a synthetic dataset; returns (adapter, losses)."""
  batch = flux.random_batch(model.config, samples, 4, 4, 6)
  tx, _ = optim.make(config, steps)
  adapter = lora.init(model.params, flux.LORA_TARGETS, config.adapter.rank, jnp.float32, jax.random.key(0))
  state = dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))
  step = jax.jit(lambda s, b, k: train.train_step(
      s, model.params, b, k, grads=train.grad_fn(model, config),
      update=functools.partial(train.apply_gradients, tx=tx)))
  losses = []
  for i in range(steps):
    batches = jax.tree.map(lambda x: x.reshape(1, samples, *x.shape[1:]), batch)
    state, metrics = step(state, batches, jax.random.key(1))  # fixed noise: a pure overfit
    losses.append(float(metrics["loss"]))
  return state["lora"], losses


@pytest.fixture(scope="module")
def dev(flux_checkpoints):
  return flux_checkpoints["dev"]["torch"], models.load("flux", flux_checkpoints["dev"]["diffusers"], progress=False)


def test_loss_goes_down_when_overfitting(dev):
  _, model = dev
  _, losses = trained_adapter(model, tiny_config(**{"optimizer.lr": 3e-3}), 30)
  assert losses[-1] < 0.5 * losses[0], losses


def test_trained_lora_exports_to_diffusers(dev, tmp_path):
  torch_model, model = dev
  adapter, _ = trained_adapter(model, tiny_config(**{"optimizer.lr": 1e-2}), 5)
  path = lora.save(adapter, str(tmp_path / "epoch1"), flux.STACKED, flux.LORA_PREFIX, 4, np.float32)
  inputs = flux.random_inputs(model.config, 2, 3, 4, 5)
  ours = np.asarray(model.module.apply({"params": model.params, "lora": adapter}, **inputs))
  t = copy.deepcopy(torch_model)
  t.load_lora_adapter(path, prefix="transformer", adapter_name="trained")
  n_lora = sum(1 for m in t.modules() if hasattr(m, "lora_A") and "trained" in m.lora_A)
  assert 2 * n_lora == len(load_file(path))  # every key consumed
  with torch.no_grad():
    after = t(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)[0].numpy()
  base = np.asarray(model(**inputs))
  assert np.linalg.norm(after - base) / np.linalg.norm(base) > 1e-3  # training changed the model
  assert np.linalg.norm(ours - after) / np.linalg.norm(after) < 1e-4


def test_lora_dropout_acts_in_training_only(dev):
  _, model = dev
  adapter = lora.init(model.params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
  adapter = jax.tree.map(lambda x: x + 0.1, adapter)  # non-zero B
  batch = flux.random_batch(model.config, 2, 3, 4, 4)
  loss = lambda rate, seed: float(train.loss_fn(adapter, model.params, batch, jax.random.key(seed),
                                                model=model, config=tiny_config(**{"adapter.dropout": rate})))
  assert loss(0.5, 0) != loss(0.0, 0)  # same noise and t, dropped LoRA inputs
  assert loss(0.0, 0) == loss(0.0, 0)


def read_metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_resume_gives_the_same_run(tmp_path):
  args = ["--config.epochs=4", "--config.checkpoint_every_n_steps=2"]  # 3 steps an epoch
  full = run_main(tmp_path, *args, output="a")
  assert full.returncode == 0, full.stdout
  half = run_main(tmp_path, "--config.max_steps=5", *args, output="b")  # stops mid-epoch
  assert half.returncode == 0, half.stdout
  # resumed with 4 of the 5 blocks' weights in host memory (all 3 single blocks and 1 double)
  resumed = run_main(tmp_path, "--resume_from_checkpoint", "--config.blocks_to_swap=4", *args,
                     output="b")
  assert resumed.returncode == 0, resumed.stdout
  assert "resumed" in resumed.stdout
  assert ("pinned host memory: 3 of the single_transformer_blocks, spread evenly, 1 of the "
          "transformer_blocks") in resumed.stdout, resumed.stdout
  (run_a,) = glob.glob(str(tmp_path / "a" / "*"))
  (run_b,) = glob.glob(str(tmp_path / "b" / "*"))
  losses_a = [m["loss"] for m in read_metrics(run_a)]
  losses_b = [m["loss"] for m in read_metrics(run_b)]
  assert len(losses_a) == len(losses_b) == 12
  np.testing.assert_allclose(losses_b, losses_a, rtol=1e-5)
  final_a = load_file(os.path.join(run_a, "epoch4", lora.WEIGHTS_NAME))
  final_b = load_file(os.path.join(run_b, "epoch4", lora.WEIGHTS_NAME))
  # Swapping runs the blocks as a program of its own, whose rounding AdamW amplifies where a
  # gradient is near zero: the weights agree to 1e-3 of their scale (the losses to 1e-5).
  for k in final_a:
    np.testing.assert_allclose(final_b[k], final_a[k], rtol=1e-5, atol=1e-3 * np.abs(final_a[k]).max())

  # Layouts: 5 steps on a 2-stage pipeline, resumed on 2 data-parallel devices (same global batch),
  half = run_main(tmp_path, "--config.max_steps=5", "--config.pipeline_stages=2", *args, output="c",
                  devices=2)
  assert half.returncode == 0 and "stage 1: transformer_blocks 1" in half.stdout, half.stdout
  # ... with the layers unrolled (every stacked leaf stored per layer; per-block remat), 2 of
  # the single blocks' weights in host memory
  resumed = run_main(tmp_path, "--resume_from_checkpoint", "--config.micro_batch_size_per_gpu=1",
                     "--config.scan_layers=False", "--config.blocks_to_swap=2", *args,
                     output="c", devices=2)
  assert resumed.returncode == 0 and "'data': 2" in resumed.stdout, resumed.stdout
  (run_c,) = glob.glob(str(tmp_path / "c" / "*"))
  np.testing.assert_allclose([m["loss"] for m in read_metrics(run_c)], losses_a, rtol=1e-5)


def test_config_typo_is_a_clear_error(tmp_path):
  out = run_main(tmp_path, "--config.optimizer.lrr=1e-3")
  assert out.returncode != 0 and 'Did you mean "lr"' in out.stdout, out.stdout
  out = run_main(tmp_path, "--config.pipeline_stages=2", "--config.scan_layers=False", devices=2)
  assert out.returncode != 0 and "set scan_layers=True" in out.stdout, out.stdout
  out = run_main(tmp_path, "--config.activation_checkpointing=blok")
  assert out.returncode != 0 and "activation_checkpointing='blok'; use one of" in out.stdout, out.stdout


def test_non_finite_loss_stops_with_a_message(tmp_path):
  out = run_main(tmp_path, "--config.model.guidance=nan", "--config.epochs=1",
                 "--config.compilation_cache_dir=xla", shared_compilation_cache=False)
  assert out.returncode != 0
  assert "non-finite loss" in out.stdout and "last good checkpoint" in out.stdout, out.stdout
  assert os.listdir(tmp_path / "xla"), "the compiled programs were not kept"


def test_float8_base_tracks_full_precision(flux_checkpoints):
  path = flux_checkpoints["dev"]["diffusers"]
  full = models.load("flux", path, progress=False)
  fp8 = models.load("flux", path, transformer_dtype="float8", progress=False)
  kernel = fp8.params["transformer_blocks"]["attn"]["to_q"]
  assert kernel["kernel"].dtype == jnp.float8_e4m3fn and kernel["kernel_scale"].shape == (2, 64)
  assert fp8.params["x_embedder"]["kernel"].dtype == jnp.float32  # embedders stay
  config = tiny_config(**{"optimizer.lr": 3e-3})
  _, losses = trained_adapter(full, config, 15)
  _, losses8 = trained_adapter(fp8, config, 15)
  np.testing.assert_allclose(losses8, losses, rtol=0.03)  # within 1% on 2026-12-02
  assert losses8[-1] < 0.6 * losses8[0]


def equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it (scan bodies, checkpoints, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)


def host_copies(jaxpr):
  """The values a jaxpr moves to host memory."""
  return [v.aval for eqn in equations(jaxpr) if eqn.primitive.name == "device_put"
          for v in eqn.outvars if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host]


def test_remat_policies_and_unrolled_layers_give_the_same_gradients(flux_checkpoints):
  """Each activation_checkpointing value in a scan, and no remat unrolled, against no remat in a
  scan: same loss and gradients. Remat must shrink the temporaries, and "block_offload" must send
  each block's input [B, T + L, D] to host memory. Unrolled, the layout stores every stacked
  leaf per layer, so that no stacked weight or LoRA (nor a slice of one) is in the program; the
  trainer runs it split into programs per block (`programs`), which must give the same."""
  path = flux_checkpoints["dev"]["diffusers"]
  model = models.load("flux", path, progress=False)
  batch = flux.random_batch(model.config, 2, 4, 4, 6)
  adapter = lora.init(model.params, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
  adapter = jax.tree.map(lambda a: a + 0.01, adapter)  # B != 0: every gradient is nonzero
  inputs = (jax.tree.map(lambda x: x[None], batch), jax.random.split(jax.random.key(1), 1))
  unrolled = sharding.make_layout(sharding.make_mesh(1), flux, model.config, 1, scan_layers=False)
  stacked_shapes = {a.shape for n in flux.STACKED for a in jax.tree.leaves((model.params[n], adapter[n]))
                    if a.ndim >= 3}  # the kernels and LoRA matrices
  results, temp_bytes = {}, {}
  for remat, scan_layers in [(r, True) for r in models.REMAT_POLICIES] + [("none", False)]:
    if scan_layers:
      run = dataclasses.replace(model, module=model.module.clone(remat=models.REMAT_POLICIES[remat]))
      args = (adapter, model.params, *inputs)
    else:
      run = models.load("flux", path, scan_layers=False, layout=unrolled, progress=False)
      args = (unrolled.to_stages(adapter), run.params, *inputs)
      loss, g = train.grad_fn(run, tiny_config(), split=True)(*args)
      results["split", False] = loss, unrolled.to_layers(g)
    grads = train.grad_fn(run, tiny_config())
    compiled = jax.jit(grads).lower(*args).compile()
    loss, g = compiled(*args)
    results[remat, scan_layers] = loss, unrolled.to_layers(g)
    temp_bytes[remat, scan_layers] = compiled.memory_analysis().temp_size_in_bytes
    jaxpr = jax.make_jaxpr(grads)(*args).jaxpr
    offloaded = host_copies(jaxpr)
    assert (remat == "block_offload") == bool(offloaded), remat
    assert all(a.shape == (2, 6 + 16, model.config.inner_dim) for a in offloaded)
    stacked = [v.aval.shape for eqn in equations(jaxpr) for v in eqn.invars
               if getattr(v.aval, "shape", None) in stacked_shapes]
    assert bool(stacked) == scan_layers, (remat, scan_layers, stacked)
  assert temp_bytes["block", True] < temp_bytes["none", True] / 2, temp_bytes
  loss, want = results["none", True]
  for key, (value, got) in results.items():
    np.testing.assert_allclose(value, loss, rtol=1e-5, err_msg=str(key))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max()), key
  with pytest.raises(ValueError, match="scan_layers=False"):
    models.load("flux", path, remat="block_offload", scan_layers=False, progress=False)


def test_swapped_blocks_stay_in_host_memory_and_give_the_same_gradients(flux_checkpoints):
  """blocks_to_swap: the swapped layers' weights live in pinned host memory, are never kept as
  residuals for the backward pass (they are copied to the device again), and change nothing;
  each block is recomputed in the backward pass, not merged with the forward pass by XLA (the
  compiled temporaries stay those of per-block remat, plus one swapped layer)."""
  path = flux_checkpoints["dev"]["diffusers"]
  mesh = sharding.make_mesh(1)
  config = tiny_config()
  results, temps = {}, {}
  # none; single blocks 0 and 2 (a resident one between them); the 3 single blocks and double
  # block 1; unrolled, each layer's weights an array of their own (`programs` copies them)
  for remat, swap, scan_layers in (("block", 0, True), ("none", 2, True), ("block", 4, True),
                                   ("block", 4, False), ("none", 2, False)):
    layout = sharding.make_layout(mesh, flux, models.checkpoint_config("flux", path), 1, swap,
                                  scan_layers)
    model = models.load("flux", path, remat=remat, layout=layout, scan_layers=scan_layers,
                        progress=False)
    if not results:
      abstract = models.abstract_params(flux, model.module, model.config)
      batch = flux.random_batch(model.config, 2, 4, 4, 6)
      adapter = lora.init(abstract, flux.LORA_TARGETS, 4, jnp.float32, jax.random.key(0))
      adapter = jax.tree.map(lambda a: a + 0.01, adapter)
    args = (layout.to_stages(adapter), model.params, jax.tree.map(lambda x: x[None], batch),
            jax.random.split(jax.random.key(1), 1))
    if not scan_layers:
      in_host = {(name, n): [[a.sharding.memory_kind == "pinned_host" for a in leaf.arrays]
                             for leaf in jax.tree.leaves(model.params[name], is_leaf=is_layer_arrays)]
                 for name, n in layout.swap}
      want = {("single_transformer_blocks", 2): [True, False, True],
              ("single_transformer_blocks", 3): [True, True, True], ("transformer_blocks", 1): [False, True]}
      assert all(all(h == want[key] for h in hs) for key, hs in in_host.items()), in_host
      loss, g = train.grad_fn(model, config, split=True)(*args)
      results[remat, swap, scan_layers] = loss, layout.to_layers(g)
      continue
    swapped = swapped_stacks(model.params)
    assert [len(s.pinned_host) for s in swapped] == [n for _, n in layout.swap]
    assert len(layout.swap) == {0: 0, 2: 1, 4: 2}[swap]
    assert all(h.sharding.memory_kind == "pinned_host" for s in swapped for h in s.pinned_host)
    assert all(a.sharding.memory_kind == "device" for s in swapped for a in jax.tree.leaves(s.device))
    grads = train.grad_fn(model, config)
    results[remat, swap, scan_layers] = jax.jit(grads)(*args)
    temps[remat, swap] = jax.jit(grads).lower(*args).compile().memory_analysis().temp_size_in_bytes
    # each swapped layer is copied to the device twice, forward and backward, as one buffer:
    # never kept
    copies = [v for eqn in equations(jax.make_jaxpr(grads)(*args).jaxpr) for v in eqn.outvars
              if eqn.primitive.name == "device_put" and eqn.params["devices"] == (jax.memory.Space.Device,)]
    buffers = [h for s in swapped for h in s.pinned_host]
    assert len(copies) == 2 * len(buffers), (len(copies), len(buffers))
  # one swapped layer at a time on the device (its buffer and its weights), not all of them
  # (`swapped`, `buffers`: the last run's, 4 blocks)
  layer_bytes = max(h.nbytes for s in swapped for h in s.pinned_host)
  assert temps["block", 4] - temps["block", 0] < 2 * layer_bytes < sum(h.nbytes for h in buffers), temps
  loss, want = results["block", 0, True]
  for key, (value, got) in results.items():
    np.testing.assert_allclose(value, loss, rtol=1e-5, err_msg=str(key))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max()), key
  # created in place (random init): the same weights, split the same way; the forward pass
  # of unrolled layers runs as programs per block
  cfg = models.checkpoint_config("flux", path)
  plain, split, unrolled = (models.init_random(
      "flux", cfg, jax.random.key(3), scan_layers=scan_layers,
      layout=sharding.make_layout(mesh, flux, cfg, 1, swap, scan_layers))
      for swap, scan_layers in ((0, True), (4, True), (4, False)))
  assert len(split.params["transformer_blocks"].pinned_host) == 1
  inputs = flux.random_inputs(cfg, 1, 4, 4, 6)
  for model in (split, unrolled):
    np.testing.assert_allclose(model(**inputs), plain(**inputs), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="the model has 5 blocks"):
    sharding.make_layout(mesh, flux, cfg, 1, 6)
  with pytest.raises(ValueError, match="blocks_to_swap needs pipeline_stages=1"):
    models.remat_policy("block", pipelined=True, swapped=True)


def test_two_processes_train_as_one_process_with_two_devices(tmp_path):
  """A multi-host launch (2 processes, 1 CPU device each, gloo collectives) runs the same steps
  as one process with 2 devices: process 0 caches and exports, both checkpoint into one run."""
  args = ["--config.epochs=2", "--config.micro_batch_size_per_gpu=1", "--config.checkpoint_every_n_steps=4"]
  reference = run_main(tmp_path, *args, output="one", devices=2)
  assert reference.returncode == 0, reference.stdout
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "main.py"), "--config", os.path.join(ROOT, "configs", "flux.py") + ":tiny",
       f"--config.output_dir={tmp_path}/two", *args, f"--coordinator_address=localhost:{port}",
       "--num_processes=2", f"--process_id={i}"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  (run_one,) = glob.glob(str(tmp_path / "one" / "*"))
  (run_two,) = glob.glob(str(tmp_path / "two" / "*"))  # one run directory for both processes
  np.testing.assert_allclose([m["loss"] for m in read_metrics(run_two)],
                             [m["loss"] for m in read_metrics(run_one)], rtol=1e-5)
  assert os.path.isdir(os.path.join(run_two, "global_step4")) and os.path.isdir(os.path.join(run_two, "epoch2"))
