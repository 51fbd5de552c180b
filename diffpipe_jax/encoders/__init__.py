"""The PyTorch side of caching: a model family's frozen VAE and text encoders (`Encoders`), one
module per family (`encoders/<family>.py`, with its `TORCH_SIDE`), imported only to cache a
dataset or write tiny models, so that training never imports torch."""
import hashlib
import json
import os


def default_device():
  import torch
  return "cuda" if torch.cuda.is_available() else "cpu"


def folder_digest(path):
  """Hashes a component folder: small files (configs, tokenizers) by content, weights by name and
  size, so a different checkpoint with the same config still changes the fingerprint."""
  h = hashlib.sha256()
  for name in sorted(os.listdir(path)):
    full = os.path.join(path, name)
    if not os.path.isfile(full):
      continue
    size = os.path.getsize(full)
    h.update(f"{name}:{size}\n".encode())
    if size < (1 << 20):
      with open(full, "rb") as f:
        h.update(f.read())
  return h.hexdigest()[:16]


class Encoders:
  """One model family's frozen encoders, loaded on first use: a cache that is already complete
  never loads them. Subclasses set `components` (diffusers subfolder -> (attribute, class)) and
  implement `load` (settings only), `load_models`, `encode_media` (np [B, F, H, W, 3] in
  [-1, 1] -> latents), `encode_text` (captions -> {field: embeddings}), `latent_grid` and
  `pixel_multiple` (bucket sides are multiples of it)."""
  components = {}

  def __init__(self, path, device, dtype, options):
    self.path, self.device, self.dtype, self.options = path, device, dtype, options

  def __getattr__(self, name):  # only reached while a component is not loaded yet
    if name in {attr for attr, _ in self.components.values()}:
      print(f"loading the encoders from {self.path} ({self.device})")
      self.load_models()
      return self.__dict__[name]
    raise AttributeError(name)

  def identity(self) -> str:
    """Class names and folder hashes of every component, plus dtype and options: part of every
    fingerprint, so swapping an encoder or a setting re-encodes the cache."""
    parts = [type(self).__name__, str(self.dtype).replace("torch.", ""),
             json.dumps(self.options, sort_keys=True)]
    for sub, (_, class_name) in self.components.items():
      parts.append(f"{sub}={class_name}:{folder_digest(os.path.join(self.path, sub))}")
    return "|".join(parts)

  def config(self, sub) -> dict:
    """A component's config.json, read without loading the model."""
    with open(os.path.join(self.path, sub, "config.json")) as f:
      return json.load(f)

  def release(self):
    """Frees the models (and their GPU memory) before training starts."""
    import torch
    for attr, _ in self.components.values():
      self.__dict__.pop(attr, None)
    if torch.cuda.is_available():
      torch.cuda.empty_cache()
