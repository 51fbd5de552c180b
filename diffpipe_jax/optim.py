"""optax optimizer and learning-rate schedule from the config (diffusion-pipe's keys)."""
import jax
import optax

OPTIMIZERS = ("adamw",)
# After the warm-up: lr -> schedule over the decay steps.
SCHEDULES = {"constant": lambda lr, steps: optax.constant_schedule(lr),
             "linear": lambda lr, steps: optax.linear_schedule(lr, 0.0, steps),
             "cosine": lambda lr, steps: optax.cosine_decay_schedule(lr, steps)}


def schedule(lr, warmup_steps, total_steps, kind="constant"):
  """Linear warm-up from 0, then constant, linear decay to 0, or cosine decay to 0."""
  after = SCHEDULES[kind](lr, max(1, total_steps - warmup_steps))
  if warmup_steps <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def make(config, total_steps):
  """AdamW (no weight decay on 1-D parameters) after global-norm clipping; returns (tx, lr_fn)."""
  o = config.optimizer
  lr = schedule(o.lr, config.warmup_steps, total_steps, config.lr_scheduler)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  adamw = optax.adamw(lr, b1=o.betas[0], b2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay,
                      mask=decay_mask)
  clip = [optax.clip_by_global_norm(config.gradient_clipping)] if config.gradient_clipping > 0 else []
  return optax.chain(*clip, adamw), lr
