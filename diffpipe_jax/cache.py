"""Pre-computed VAE latents and text embeddings, encoded once in PyTorch so training is pure JAX.

Encoders are a table of rows (`ENCODERS`), one per model family, each an `Encoders` subclass that
loads from a diffusers folder and turns pixels into packed latents and captions into the
embeddings its transformer reads. LTX-Video (T5 only, video VAE) and HunyuanVideo (LLaMA with a
prompt template + CLIP) are new rows with the same five methods.

Format, in `<dataset dir>/cache/<model>/`:

  manifest.json                     identity, and per bucket: its shard, keys, latent grid
  <bucket>/<shard>.<field>.npy      one fixed-shape array per field, a row per item
  <bucket>/<shard>.json             the shard's sidecar: fingerprints and keys of its rows
  empty/<shard>.*                   the empty-caption embeddings (for caption dropout)

Why: plain `.npy` opens with `np.load(mmap_mode='r')`, so a training step reads just its rows
from the page cache with no decoding and no copy, and every bucket's items share one shape. Each
encoded batch becomes its own shard whose sidecar is renamed into place last: that rename is the
shard's commit, so an interrupted run keeps every finished batch and a rerun skips them, at a cost
per batch that does not grow with the dataset. Once all items are encoded each bucket is compacted
into a single shard in key order, then `manifest.json` (the only thing readers open) is renamed
into place and files it does not name are deleted; nothing half-written is ever read.

Position ids are left to the caller: they are the same for every item of a bucket, so they are
not stored; `Cache.grid(bucket)` gives the latent grid (Flux: `flux.image_ids(*cache.grid(b))`).
"""
import hashlib
import json
import os
import shutil
import uuid

import numpy as np
from tqdm import tqdm

from diffpipe_jax.files import atomic_write

MANIFEST = "manifest.json"
EMPTY = "empty"


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
  implement `load` (settings only), `load_models`, `encode_media`, `encode_text`, `latent_grid`."""
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


class FluxEncoders(Encoders):
  """FLUX.1: AutoencoderKL latents 2x2-packed; T5 last hidden state and CLIP pooled output."""
  components = {"vae": ("vae", "AutoencoderKL"), "tokenizer": ("clip_tokenizer", "CLIPTokenizer"),
                "text_encoder": ("clip", "CLIPTextModel"),
                "tokenizer_2": ("t5_tokenizer", "T5TokenizerFast"),
                "text_encoder_2": ("t5", "T5EncoderModel")}

  @classmethod
  def load(cls, path, device=None, dtype=None, max_sequence_length=512):
    """The encoders of a diffusers FLUX folder (loaded when first needed); float32 on CPU,
    bfloat16 on CUDA unless told."""
    import torch
    missing = [sub for sub in cls.components if not os.path.isdir(os.path.join(path, sub))]
    if missing:
      raise FileNotFoundError(f"{path} lacks the encoder folder(s) {missing}: model.diffusers_path "
                              "must be a diffusers FLUX.1 pipeline folder (with vae/, text_encoder/, ...)")
    device = device or default_device()
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return cls(path, device, dtype, dict(max_sequence_length=max_sequence_length))

  def load_models(self):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    sub = lambda name: os.path.join(self.path, name)
    model = lambda cls, name: cls.from_pretrained(sub(name), dtype=self.dtype).to(self.device).eval()
    self.vae = AutoencoderKL.from_pretrained(sub("vae"), torch_dtype=self.dtype).to(self.device).eval()
    self.clip_tokenizer = CLIPTokenizer.from_pretrained(sub("tokenizer"))
    self.clip = model(CLIPTextModel, "text_encoder")
    self.t5_tokenizer = T5TokenizerFast.from_pretrained(sub("tokenizer_2"))
    self.t5 = model(T5EncoderModel, "text_encoder_2")

  @property
  def spatial_factor(self):
    return 2 ** (len(self.config("vae")["block_out_channels"]) - 1)

  @property
  def pixel_multiple(self):
    """Bucket sides must be multiples of this: the VAE factor, then 2x2 packing."""
    return 2 * self.spatial_factor

  def latent_grid(self, frames, height, width):
    """Packed token grid (rows, columns) of a bucket: VAE factor, then 2x2 patches."""
    return (height // self.pixel_multiple, width // self.pixel_multiple)

  def encode_images(self, pixels):
    """[B, 3, H, W] in [-1, 1] -> packed latents [B, (h/2)*(w/2), 4*C], as FluxPipeline packs.

    The posterior mean, not a sample: the cache is then reproducible, and a sample drawn once
    would freeze one fixed perturbation per item anyway (Flux's posterior std is tiny)."""
    import torch
    cfg = self.vae.config
    with torch.no_grad():
      z = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mean
    z = (z - cfg.shift_factor) * cfg.scaling_factor
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)

  def encode_media(self, pixels):
    """np [B, F, H, W, 3] (F = 1) -> np float32 packed latents."""
    import torch
    if pixels.shape[1] != 1:
      raise ValueError(f"Flux encodes images only, got {pixels.shape[1]} frames")
    x = torch.from_numpy(np.ascontiguousarray(pixels[:, 0].transpose(0, 3, 1, 2)))
    return self.encode_images(x).float().cpu().numpy()

  def encode_text(self, captions):
    """Captions -> dict(text=[B, T, D] T5 last hidden state, pooled=[B, D'] CLIP pooled output),
    tokenised as FluxPipeline.encode_prompt does (padded to max length, truncated, no mask)."""
    import torch
    captions = list(captions)
    tokens = lambda tok, n: tok(captions, padding="max_length", max_length=n, truncation=True,
                                return_tensors="pt").input_ids.to(self.device)
    with torch.no_grad():
      pooled = self.clip(tokens(self.clip_tokenizer, self.clip_tokenizer.model_max_length),
                         output_hidden_states=False).pooler_output
      text = self.t5(tokens(self.t5_tokenizer, self.options["max_sequence_length"]),
                     output_hidden_states=False)[0]
    return dict(text=text.float().cpu().numpy(), pooled=pooled.float().cpu().numpy())


ENCODERS = {"flux": FluxEncoders}


def fingerprint(identity, item) -> str:
  """The cache key of an item: the caller's key (file identity and content), its caption and
  bucket, and the encoders' identity."""
  blob = json.dumps([identity, item["key"], item["caption"], list(item["bucket"])])
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


def bucket_name(bucket):
  return "x".join(str(v) for v in bucket)


def write_json(path, obj):
  atomic_write(path, lambda f: f.write(json.dumps(obj).encode()))


def write_shard(folder, arrays, meta):
  """Writes one shard: its arrays first, its sidecar last (the commit). Returns the shard id."""
  os.makedirs(folder, exist_ok=True)
  sid = uuid.uuid4().hex[:12]
  for field, value in arrays.items():
    atomic_write(os.path.join(folder, f"{sid}.{field}.npy"), lambda f: np.save(f, value))
  write_json(os.path.join(folder, f"{sid}.json"), meta)
  return sid


def open_field(folder, sid, field):
  return np.load(os.path.join(folder, f"{sid}.{field}.npy"), mmap_mode="r")


def committed_shards(cache_dir):
  """Every committed shard on disk: (folder name, shard id, sidecar)."""
  out = []
  for name in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []:
    folder = os.path.join(cache_dir, name)
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
      if entry.endswith(".json") and ".tmp" not in entry:
        with open(os.path.join(folder, entry)) as f:
          out.append((name, entry[:-len(".json")], json.load(f)))
  return out


def encode_batch(encoders, batch):
  """A batch's arrays (the media's latents, the captions' embeddings) and its (F, H, W)."""
  pixels = np.stack([item["load_pixels"]() for item in batch]).astype(np.float32)
  return dict(latents=encoders.encode_media(pixels),
              **encoders.encode_text([item["caption"] for item in batch])), pixels.shape[1:4]


def compact(cache_dir, name, live, rows, shards):
  """One shard holding bucket `name`'s live items in key order, written by streaming rows from
  the existing shards; reused as is when one shard (of `shards`) already holds exactly them."""
  fps = [fp for _, fp in live]
  for folder, sid, meta in shards:
    if folder == name and meta["fingerprints"] == fps:
      return sid, meta
  folder = os.path.join(cache_dir, name)
  first = rows[fps[0]]
  meta = dict(fingerprints=fps, keys=[key for key, _ in live], bucket=first[2]["bucket"],
              grid=first[2]["grid"])
  fields = [f.split(".")[1] for f in os.listdir(folder)
            if f.startswith(first[0] + ".") and f.endswith(".npy")]
  sid = uuid.uuid4().hex[:12]
  for field in fields:
    src = open_field(folder, first[0], field)
    path = os.path.join(folder, f"{sid}.{field}.npy")
    tmp = path + ".tmp"
    out = np.lib.format.open_memmap(tmp, "w+", src.dtype, (len(fps),) + src.shape[1:])
    for i, fp in enumerate(fps):
      shard, row, _ = rows[fp]
      out[i] = open_field(folder, shard, field)[row]
    out.flush()
    del out
    os.replace(tmp, path)
  write_json(os.path.join(folder, f"{sid}.json"), meta)
  return sid, meta


def collect_garbage(cache_dir, manifest):
  """Deletes every file and folder the manifest does not name (stale shards, temporaries)."""
  keep = {(name, b["shard"]) for name, b in manifest["buckets"].items()}
  keep.add((EMPTY, manifest["empty"]))
  for name in os.listdir(cache_dir):
    folder = os.path.join(cache_dir, name)
    if not os.path.isdir(folder):
      if name != MANIFEST:
        os.remove(folder)
      continue
    for entry in os.listdir(folder):
      if entry.endswith(".tmp") or (name, entry.split(".")[0]) not in keep:
        os.remove(os.path.join(folder, entry))
    if not os.listdir(folder):
      os.rmdir(folder)


def build_cache(cache_dir, items, encoders, batch_size, regenerate=False) -> "Cache":
  """Encodes the items not already cached, drops the ones no longer listed, and returns the cache.

  `items`: dicts with `key` (the caller's fingerprint of the file and its settings), `caption`,
  `bucket` (hashable, e.g. (width, height, frames)) and `load_pixels()` -> float32 [F, H, W, 3]
  in [-1, 1] at the bucket's size. Items with equal fingerprints are encoded and stored once."""
  if regenerate and os.path.isdir(cache_dir):
    shutil.rmtree(cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  identity = encoders.identity()
  rows = {}  # fingerprint -> (shard id, row, sidecar) of every committed row
  for _, sid, meta in committed_shards(cache_dir):
    for row, fp in enumerate(meta["fingerprints"]):
      rows[fp] = (sid, row, meta)
  wanted = {}  # fingerprint -> item, deduplicated, in input order
  for item in items:
    wanted.setdefault(fingerprint(identity, item), item)
  todo = {}
  for fp, item in wanted.items():
    if fp not in rows:
      todo.setdefault(bucket_name(item["bucket"]), []).append((fp, item))
  with tqdm(total=sum(map(len, todo.values())), desc="caching", unit="item") as bar:
    for name, pending in todo.items():
      for start in range(0, len(pending), batch_size):
        chunk = pending[start:start + batch_size]
        arrays, (frames, height, width) = encode_batch(encoders, [item for _, item in chunk])
        meta = dict(fingerprints=[fp for fp, _ in chunk], keys=[it["key"] for _, it in chunk],
                    bucket=list(chunk[0][1]["bucket"]),
                    grid=list(encoders.latent_grid(frames, height, width)))
        sid = write_shard(os.path.join(cache_dir, name), arrays, meta)
        rows.update({fp: (sid, row, meta) for row, (fp, _) in enumerate(chunk)})
        bar.update(len(chunk))
  empty_fp = fingerprint(identity, dict(key="", caption="", bucket=()))
  if empty_fp not in rows:
    sid = write_shard(os.path.join(cache_dir, EMPTY), encoders.encode_text([""]),
                      dict(fingerprints=[empty_fp], keys=[""], bucket=[], grid=[]))
    rows[empty_fp] = (sid, 0, None)
  by_bucket = {}
  for fp, item in wanted.items():
    by_bucket.setdefault(bucket_name(item["bucket"]), []).append((item["key"], fp))
  buckets, shards = {}, committed_shards(cache_dir)
  for name, live in sorted(by_bucket.items()):
    sid, meta = compact(cache_dir, name, sorted(live), rows, shards)
    buckets[name] = dict(shard=sid, bucket=meta["bucket"], grid=meta["grid"], keys=meta["keys"])
  manifest = dict(version=1, identity=identity, empty=rows[empty_fp][0], buckets=buckets)
  write_json(os.path.join(cache_dir, MANIFEST), manifest)
  collect_garbage(cache_dir, manifest)
  return Cache(cache_dir)


class Cache:
  """A finished cache, memory-mapped: buckets, their items in key order, the empty caption."""

  def __init__(self, cache_dir):
    with open(os.path.join(cache_dir, MANIFEST)) as f:
      self.manifest = json.load(f)
    self.dir = cache_dir
    self.entries = {tuple(b["bucket"]): (name, b) for name, b in self.manifest["buckets"].items()}
    self.arrays = {}

  def _fields(self, name, sid):
    if (name, sid) not in self.arrays:
      folder = os.path.join(self.dir, name)
      fields = sorted(f.split(".")[1] for f in os.listdir(folder)
                      if f.startswith(sid + ".") and f.endswith(".npy"))
      self.arrays[name, sid] = {k: open_field(folder, sid, k) for k in fields}
    return self.arrays[name, sid]

  def buckets(self):
    """[(bucket, item count)], buckets as tuples."""
    return [(bucket, len(b["keys"])) for bucket, (_, b) in self.entries.items()]

  def keys(self, bucket):
    """The caller keys of a bucket's items, in index order."""
    return list(self.entries[tuple(bucket)][1]["keys"])

  def grid(self, bucket):
    """The packed latent grid of a bucket (Flux: (rows, columns)), for position ids."""
    return tuple(self.entries[tuple(bucket)][1]["grid"])

  def get(self, bucket, index):
    """Item `index` (int or index array) of a bucket: latents [L, C], text [T, D], pooled [D'];
    read-only memory-mapped views."""
    name, b = self.entries[tuple(bucket)]
    return {k: v[index] for k, v in self._fields(name, b["shard"]).items()}

  def empty_text(self):
    """The empty caption's embeddings (text [T, D], pooled [D']), for caption dropout."""
    return {k: v[0] for k, v in self._fields(EMPTY, self.manifest["empty"]).items()}

  def __len__(self):
    return sum(len(b["keys"]) for _, b in self.entries.values())
