"""Training data. For now a synthetic stand-in of pre-cached samples (the image/video datasets
with buckets and caching replace it): fixed random packed latents and text embeddings, served in
a seeded per-epoch order, so a batch is a pure function of (epoch, index) and resuming needs
only the step."""
import numpy as np


class SyntheticDataset:
  """`num_samples` random cached samples for a model config, latent grid `grid` x `grid`."""

  def __init__(self, family, model_config, num_samples, grid, text_tokens, seed=0):
    samples = [family.random_inputs(model_config, 1, grid, grid, text_tokens, seed=seed + i)
               for i in range(num_samples)]
    cat = lambda k: np.concatenate([s[k] for s in samples])
    self.arrays = dict(latents=cat("hidden_states"), text=cat("encoder_hidden_states"),
                       pooled=cat("pooled_projections"),
                       img_ids=np.stack([s["img_ids"] for s in samples]))
    self.seed = seed

  def __len__(self):
    return len(self.arrays["latents"])

  def batch(self, epoch: int, index: int, size: int) -> dict:
    """Batch `index` of `epoch` (each epoch a fresh seeded permutation, the tail dropped)."""
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
    rows = order[index * size:(index + 1) * size]
    return {k: v[rows] for k, v in self.arrays.items()}
