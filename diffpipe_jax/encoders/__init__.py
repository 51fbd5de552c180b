"""The PyTorch side of caching: a model family's frozen VAE and text encoders (`Encoders`), one
module per family (`encoders/<family>.py`, with its `TORCH_SIDE`), imported only to cache a
dataset or write tiny models, so that training never imports torch."""
import contextlib
import hashlib
import json
import logging
import os

import numpy as np
from tqdm import tqdm

# transformers warns, once diffusers' pipeline modules import its image processors, that they
# fall back to PIL without torchvision: no family uses an image processor, so it says nothing
TORCHVISION_FALLBACK = "requires torchvision (not installed); falling back to"
logging.getLogger("transformers.utils.import_utils").addFilter(
    lambda record: TORCHVISION_FALLBACK not in record.getMessage())


def default_device():
  import torch
  return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def library_bars_off():
  """Turns off diffusers' and transformers' loading bars ("Loading weights", "Loading checkpoint
  shards") for a while: encoders load inside the cache's own bar, and a bar opened inside another
  nests, which fills a log file with cursor-up escape codes and a terminal with stray lines."""
  from diffusers.utils import logging as diffusers_logging
  from transformers.utils import logging as transformers_logging
  on = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
  for lib in on:
    lib.disable_progress_bar()
  try:
    yield
  finally:
    for lib in on:
      lib.enable_progress_bar()


def files_digest(paths):
  """Hashes a component's files: small ones (configs, tokenizers) by content, weights by name and
  size, so a different checkpoint with the same config still changes the fingerprint."""
  h = hashlib.sha256()
  for full in paths:
    size = os.path.getsize(full)
    h.update(f"{os.path.basename(full)}:{size}\n".encode())
    if size < (1 << 20):
      with open(full, "rb") as f:
        h.update(f.read())
  return h.hexdigest()[:16]


def folder_files(path):
  """The files directly in a folder, sorted."""
  return [full for full in (os.path.join(path, name) for name in sorted(os.listdir(path)))
          if os.path.isfile(full)]


def find_source(keys, rows):
  """The first (key, folder or file) of `rows` ((config key, subpath), ...) that exists, `keys`
  being the config's values of those keys; None if none does."""
  for key, sub in rows:
    path = os.path.join(keys[key], sub) if keys[key] and sub else keys[key]
    if path and os.path.exists(path):
      return key, path
  return None


class Encoders:
  """One model family's frozen encoders, loaded on first use: a cache that is already complete
  never loads them. Subclasses set `components` (diffusers subfolder -> (attribute, class)) and
  implement `load` (settings only), `load_vae` (returns it), `load_text_encoders` (sets their
  attributes), `encode_media` (np [B, F, H, W, 3] in [-1, 1] -> latents), `decode_media` (its
  inverse: latents of a latent grid -> np [B, F, H, W, 3] in [-1, 1]), `encode_text` (captions, frames=1 -> {field: embeddings}; `frames`, the
  media's frame count, is for a family that prompts its text encoder differently for images
  and videos; the others ignore it), `latent_grid` and `pixel_multiple` (bucket sides are
  multiples of it). `encode_text` tallies the captions a token limit cuts (`count_truncated`);
  the cache says them once it is built. The media pass's components (`media_components`: the
  VAE, and an image encoder where the family conditions on the clip's first frame) load
  together (`load_media_encoders`), the text encoders together after them."""
  components = {}
  media_components = ("vae",)  # attributes of the components the media pass uses
  # whether the model's samples may start from a given first frame (`first_frame_fields`), and
  # whether they must (an image-to-video model: one a prompt; otherwise one a prompt or none)
  takes_first_frame = False
  needs_first_frame = False
  frame_rate = None  # frames per second videos are decoded at; None: the family takes images only
  frames_per_latent = None  # a clip has 1 + k * this many frames (the VAE's temporal factor)

  def __init__(self, path, device, dtype, options):
    self.path, self.device, self.dtype, self.options = path, device, dtype, options
    self.truncated = {}  # what the cut means -> [captions cut, captions read, the first cut]

  def __getattr__(self, name):  # only reached while a component is not loaded yet
    if name in {attr for attr, _ in self.components.values()}:
      media = name in self.media_components
      what = "VAE" if self.media_components == ("vae",) else "media encoders"
      loading = [sub for sub, (attr, _) in self.components.items()
                 if (attr in self.media_components) == media]
      sources = ", ".join(dict.fromkeys(map(self.component_source, loading)))
      # above any open bar (the cache's, when it is the first use), not on its line
      tqdm.write(f"loading the {what if media else 'text encoders'} from {sources} ({self.device})")
      with library_bars_off():
        if media:  # without the text encoders: decoding samples needs the VAE alone
          self.load_media_encoders()
        else:
          self.load_text_encoders()
      return self.__dict__[name]
    raise AttributeError(name)

  def load_media_encoders(self):
    """Loads the media pass's components (`media_components`): the VAE."""
    self.vae = self.load_vae().to(self.device).eval()

  def encode_fields(self, pixels) -> dict:
    """The cache's media fields of a batch (np [B, F, H, W, 3] in [-1, 1]): its `latents`, and,
    for a family that conditions on the clip's first frame, what it conditions on."""
    return dict(latents=self.encode_media(pixels))

  def identity(self) -> str:
    """Class names and file hashes of every component, plus dtype and options: part of every
    fingerprint, so swapping an encoder or a setting re-encodes the cache."""
    parts = [type(self).__name__, str(self.dtype).replace("torch.", ""),
             json.dumps(self.options, sort_keys=True)]
    for sub, (_, class_name) in self.components.items():
      parts.append(f"{sub}={class_name}:{files_digest(self.component_files(sub))}")
    return "|".join(parts)

  def component_source(self, sub) -> str:
    """The folder or file a component loads from: its diffusers subfolder."""
    return os.path.join(self.path, sub)

  def component_files(self, sub):
    """The files a component loads from: its source's."""
    source = self.component_source(sub)
    return folder_files(source) if os.path.isdir(source) else [source]

  def config(self, sub) -> dict:
    """A component's config.json, read without loading the model."""
    with open(os.path.join(self.path, sub, "config.json")) as f:
      return json.load(f)

  def count_truncated(self, meaning, tokenizer, captions, limit):
    """Tallies the (non-empty) captions longer than `limit` tokens of `tokenizer`, special tokens
    included: those that truncation cuts. `meaning` names the limit and what the cut costs."""
    captions = [c for c in captions if c]
    ids = tokenizer(captions, verbose=False).input_ids if captions else []  # we say it ourselves
    cut = [c for c, row in zip(captions, ids) if len(row) > limit]
    tally = self.truncated.setdefault(meaning, [0, 0, None])
    tally[0], tally[1] = tally[0] + len(cut), tally[1] + len(captions)
    tally[2] = tally[2] or (cut[0] if cut else None)

  def truncation_notes(self):
    """One line per limit that cut captions since the last call, and a fresh tally."""
    notes = [f"{cut} of {read} captions {meaning} (first: \"{_beginning(first)}\")"
             for meaning, (cut, read, first) in self.truncated.items() if cut]
    self.truncated = {}
    return notes

  def release(self, attrs=None):
    """Frees models (and their GPU memory): those of `attrs` (e.g. `media_components`, before
    the text encoders load), or all of them (before training starts)."""
    import torch
    for attr in attrs or [attr for attr, _ in self.components.values()]:
      self.__dict__.pop(attr, None)
    if torch.cuda.is_available():
      torch.cuda.empty_cache()

  def posterior_mean(self, pixels, multiple):
    """The VAE's posterior mean, torch [B, C, F', H', W'], of clips np [B, F, H, W, 3] in [-1, 1]
    of 1 + k `frames_per_latent` frames and sides multiples of `multiple` (else a one-line
    ValueError): a video family's latents before its normalisation. The mean, not a sample: the
    cache is then reproducible, and a sample drawn once would freeze one fixed perturbation per
    item anyway."""
    import torch
    _, f, h, w, _ = pixels.shape
    if (f - 1) % self.frames_per_latent or h % multiple or w % multiple:
      raise ValueError(f"{type(self).__name__} encodes 1 + {self.frames_per_latent}k frames with "
                       f"sides multiples of {multiple}, got {f} frames of {w}x{h}")
    x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 4, 1, 2, 3)))
    with torch.no_grad():
      return self.vae.encode(x.to(self.vae.device, self.vae.dtype)).latent_dist.mean

  def first_frame_fields(self, images, frames) -> dict:
    """The conditioning fields of samples of `frames` frames that start from `images` (np [N,
    H, W, 3] in [-1, 1]): a model that `takes_first_frame`."""
    raise NotImplementedError(f"{type(self).__name__} takes no first frame")

  def decode(self, latents, grid):
    """`decode_media` in the GPU memory PyTorch has beside JAX's pool (`device_memory`): where
    that runs out, again with the VAE tiled (diffusers' `enable_tiling`: tiles blended at their
    seams), and where even that does not fit, on the CPU in float32 (slower), saying so once."""
    import torch
    fallbacks = [("with the VAE tiled", lambda: self.vae.enable_tiling()),
                 ("on the CPU", self.move_vae_to_cpu)]
    while True:
      try:
        return self.decode_media(latents, grid)
      except torch.OutOfMemoryError:
        if not fallbacks:
          raise
      torch.cuda.empty_cache()
      how, fallback = fallbacks.pop(0)
      tqdm.write(f"decoding samples: out of GPU memory beside the transformer; decoding {how} from now on")
      fallback()

  def move_vae_to_cpu(self):
    """`decode_media` follows the VAE (its device and dtype)."""
    import torch
    self.vae = self.vae.to("cpu", torch.float32)


def _beginning(caption, n=60):
  return caption if len(caption) <= n else caption[:n] + "..."
