"""The training update: the flow-matching loss of the model with a LoRA, averaged over the step's
micro-batches inside one jitted update: one micro-batch after another on each device, or all of
them at once as the microbatches of a pipeline over the mesh's 'stage' axis; with the layers
unrolled, as programs per block (`programs`). Pure JAX: `train.run` drives it, and the GPU
benchmarks run it without the data stack.
"""
import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from diffpipe_jax import axes, flow, lora, programs, sequence, stacks


EVAL_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def model_inputs(batch, key, *, model, config, quantile=None):
  """(model inputs, flow-matching target, loss mask [B, L] or None, dropout key) for a
  micro-batch of cached samples. With `quantile`, t is that quantile of the timestep
  distribution for every sample (evals)."""
  m = config.model
  latents = batch["latents"]
  k_t, k_noise, k_dropout, k_condition = jax.random.split(key, 4)
  if quantile is None:
    t = flow.sample_timesteps(k_t, latents.shape[0], m.timestep_sample_method, m.sigmoid_scale)
  else:
    t = jnp.full((latents.shape[0],), flow.quantile_timesteps(quantile, m.timestep_sample_method,
                                                              m.sigmoid_scale))
  t = m.min_t + (m.max_t - m.min_t) * t  # diffusion-pipe's timestep range, before the shift
  t = model.family.shift_timesteps(m, t, latents)
  noise = jax.random.normal(k_noise, latents.shape, latents.dtype)
  noisy, mask = flow.noisy_latents(latents, noise, t), batch.get("mask")
  if model.family.condition is not None:
    noisy, t, kept = model.family.condition(m, model.config, k_condition, batch, noisy, t)
    mask = kept if mask is None or kept is None else mask * kept
  inputs = model.family.training_inputs(m, model.config, batch, noisy, t)
  return inputs, noise - latents, mask, k_dropout


def _flow_loss(config):
  """The config's loss, (pred, target, mask=None) -> scalar: MSE, Huber or smooth L1."""
  return functools.partial(flow.loss, pointwise=flow.pointwise_loss(config.huber_delta,
                                                                    config.smooth_l1_beta))


def _predict(adapter, params, inputs, dropout_key, *, model, config, train, runtime):
  module = model.module.clone(lora_dropout=config.adapter.dropout if train else 0.0)
  return runtime.apply(module, {"params": params, "lora": adapter}, **inputs,
                       rngs={"dropout": dropout_key})


def loss_fn(adapter, params, batch, key, *, model, config, quantile=None):
  """Flow-matching loss of one micro-batch (through a pipeline as a single microbatch);
  differentiated with respect to `adapter` only."""
  inputs, target, mask, k_dropout = model_inputs(batch, key, model=model, config=config,
                                                 quantile=quantile)
  pred = _predict(adapter, params, inputs, k_dropout, model=model, config=config,
                  train=quantile is None, runtime=model.runtime.single_microbatch())
  return _flow_loss(config)(pred, target, mask)


def pipelined_loss(adapter, params, batches, keys, *, model, config):
  """The mean of `loss_fn` over a [microbatches, micro batch, ...] stack (same samples, same
  noise), computed in one pass through the runtime's pipeline with the microbatches in flight
  together."""
  inputs, targets, masks, k_dropout = jax.vmap(functools.partial(
      model_inputs, model=model, config=config))(batches, keys)
  merge = lambda x: x.reshape(-1, *x.shape[2:])  # [M, micro, ...] -> [M * micro, ...]
  inputs = {k: None if v is None else v[0] if k in model.family.shared_inputs else merge(v)
            for k, v in inputs.items()}
  pred = _predict(adapter, params, inputs, k_dropout[0], model=model, config=config, train=True,
                  runtime=model.runtime)
  pred = pred.reshape(targets.shape[:2] + pred.shape[1:])
  return jax.vmap(_flow_loss(config))(pred, targets, *([masks] if masks is not None else [])).mean()


def grad_fn(model, config, jit_options=programs.JIT_OPTIONS):
  """(adapter, params, batches [A, micro batch, ...], keys [A]) -> (mean loss, mean gradient),
  as the model's runtime differentiates. Without a pipeline the micro-batches run one after
  another (the memory of one micro-batch): in a scan; or, the layers unrolled, for a caller that
  must not jit it, in a Python loop, each loss and gradient run as programs split at the block
  calls (`programs`), jitted with `jit_options`."""
  runtime = model.runtime
  if runtime.pipeline is not None:
    return runtime.value_and_grad(functools.partial(pipelined_loss, model=model, config=config))
  loss = functools.partial(loss_fn, model=model, config=config)
  add = lambda total, result: jax.tree.map(jnp.add, total, result)
  if runtime.unrolled:
    # each micro-batch's loss divided by their number inside its programs: the sum is the mean
    loss_and_grad = runtime.value_and_grad(lambda adapter, params, batch, key, n: loss(
        adapter, params, batch, key) / n, jit_options)
    # summed in float32, whatever the dtype the adapter (so its gradient) comes in
    add = jax.jit(lambda total, result: jax.tree.map(
        lambda t, r: t.astype(jnp.float32) + r.astype(jnp.float32), total, result), **jit_options)

    def accumulate(adapter, params, batches, keys):
      total = None
      for a in range(len(keys)):
        result = loss_and_grad(adapter, params, *jax.tree.map(lambda x: x[a], (batches, keys)),
                               len(keys))
        total = result if total is None else add(total, result)
      return total
    return accumulate

  loss = runtime.value_and_grad(loss)
  mean = lambda total, n: jax.tree.map(lambda t: t / n, total)

  def accumulate(adapter, params, batches, keys):
    def micro(grads, batch_and_key):
      value, g = loss(adapter, params, *batch_and_key)
      return add(grads, g), value
    grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, adapter), (batches, keys))
    return losses.mean(), mean(grads, len(losses))
  return accumulate


def init_state(key, adapter=None, *, layer_params, config, tx, family):
  """The training state in the stacked form: a new LoRA for the family's targets but
  `adapter.exclude_modules` (or the given one), its optimizer state and the step count."""
  if adapter is None:
    adapter = lora.init(layer_params, family.lora_targets, config.adapter.rank,
                        jnp.dtype(config.adapter.dtype), key, exclude=config.adapter.exclude_modules)
  return dict(lora=adapter, opt_state=tx.init(adapter), step=jnp.zeros((), jnp.int32))


def apply_gradients(state, loss, g, *, tx):
  """The state after one optimizer update with the mean gradient `g`, and the step's metrics
  (with Prodigy, `estim_lr`: the estimate this update used, which multiplies the schedule).
  The (float32) updates are added in float32 and rounded to each LoRA leaf's dtype, which stays."""
  updates, opt_state = tx.update(g, state["opt_state"], state["lora"])
  new_state = dict(lora=optax.apply_updates(state["lora"], updates), opt_state=opt_state,
                   step=state["step"] + 1)
  estimate = optax.tree.get(state["opt_state"], "estim_lr")
  return new_state, dict(loss=loss, grad_norm=optax.tree.norm(g),
                         **({} if estimate is None else {"estim_lr": estimate}))


def train_step(state, params, batches, key, *, grads, update):
  """One optimizer update from a [accumulation, micro_batch, ...] stack of batches; `grads` is
  a `grad_fn`, `update` an `apply_gradients`."""
  n = jax.tree.leaves(batches)[0].shape[0]
  return update(state, *grads(state["lora"], params, batches, jax.random.split(key, n)))


def make_step(model, config, tx, placement):
  """`train_step` (state, params, batches, key) -> (state, metrics) for the model's runtime and
  its placement: one jitted program; or, with the layers unrolled, the loss and its gradient as a
  sequence of programs (`programs`: each stack's block forward and backward programs compile
  once for all its layers), then one jitted update. One program of every unrolled layer would
  take minutes to compile at full size."""
  grads = grad_fn(model, config)
  if not model.runtime.unrolled:
    def step_in_placement(state, *args):
      # The state leaves as it came, in the placement's shardings: left to XLA, sequence
      # parallelism shards the new LoRA's q/k/v outputs over 'seq', and the second step compiles again.
      state, metrics = train_step(state, *args, grads=grads, update=functools.partial(apply_gradients, tx=tx))
      return jax.lax.with_sharding_constraint(state, placement.shardings(state)), metrics
    # Where the Linears are written to read the scanned layers' kernels in place, their matmuls
    # do: unless the dot merger joins (so copies) q's, k's and v's.
    return jax.jit(step_in_placement, donate_argnums=(0,),
                   compiler_options=programs.WITHOUT_DOT_MERGER if model.runtime.kernels_in_place else None)
  compute_dtype = model.module.dtype

  def apply_gradients_stacked(state, loss, g):
    """The update on the stacked LoRA, as the optimizer state is stored; and the new LoRA in
    the compute dtype, which the next step's programs read (`lora.in_dtype`)."""
    adapter = stacks.restack(state["lora"])
    g = jax.tree.map(lambda g, a: g.astype(a.dtype), stacks.restack(g), adapter)
    new, metrics = apply_gradients(dict(state, lora=adapter), loss, g, tx=tx)
    new = dict(new, lora=placement.to_stages(new["lora"]))
    return new, metrics, lora.in_dtype(new["lora"], compute_dtype)
  update = jax.jit(apply_gradients_stacked, donate_argnums=(0,), **programs.JIT_OPTIONS)
  compiling = []  # the update's compilation, started by the first step
  computed = {}  # the LoRA of the last update (its first array) and that LoRA in the compute dtype

  def step(state, params, batches, key):
    n = jax.tree.leaves(batches)[0].shape[0]
    # The update of a LoRA stored per layer, a program of a thousand arrays, is long to compile
    # at full size: it compiles in a thread while the first step's programs do.
    if not compiling:
      specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
      loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(placement.mesh, axes.spec()))
      grad_dtype = compute_dtype if n == 1 else jnp.float32  # (`grad_fn` sums in float32)
      g = jax.tree.map(lambda x: x.update(dtype=grad_dtype), specs["lora"])
      compiling.append(_COMPILER.submit(lambda: compile_in(sequence.parallel(placement.mesh), update, specs, loss, g)))
    first = jax.tree.leaves(state["lora"])[0]
    if computed.get("of") is not first:  # a state that the last update did not return
      computed.update(of=first, adapter=lora.in_dtype(state["lora"], compute_dtype))
    loss, g = grads(computed["adapter"], params, batches, jax.random.split(key, n))
    compiling[0].result()  # (re-raises what failed; jit then finds the update compiled)
    state, metrics, computed["adapter"] = update(state, loss, g)
    computed["of"] = jax.tree.leaves(state["lora"])[0]
    return state, metrics
  return step


_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")


def compile_in(context, fn, *specs):
  """fn compiled for `specs` in `context` (the mesh context of the thread that will call it:
  `sequence.parallel`, which jit's cache keys hold), from another thread."""
  with context:
    return fn.lower(*specs).compile()


def make_eval(model, config):
  """`eval_losses` (adapter, params, batch, key), compiled as the model's runtime compiles."""
  return model.runtime.compile(functools.partial(eval_losses, model=model, config=config))


def eval_losses(adapter, params, batch, key, *, model, config):
  """Losses at the fixed timestep quantiles, with noise fixed by `key` (a [Q] array)."""
  return jnp.stack([loss_fn(adapter, params, batch, key, model=model, config=config, quantile=q)
                    for q in EVAL_QUANTILES])
