"""Pre-computed VAE latents and text embeddings, encoded once in PyTorch so training is pure JAX.

The encoders are a model family's (`encoders.Encoders`, from its torch side): they turn pixels
into the latents and captions into the embeddings its transformer reads, and say what they are
(`identity`) and how a bucket's latents are laid out (`latent_grid`). This module only stores.

Format, in `<dataset dir>/cache/<model>/`:

  manifest.json                     identity, and per bucket: its shard, keys, latent grid and
                                    empty-caption shard
  <bucket>/<shard>.<field>.npy      one fixed-shape array per field, a row per item
  <bucket>/<shard>.json             the shard's sidecar: fingerprints and keys of its rows
  empty/<shard>.*                   the empty caption's embeddings (for caption dropout), one
                                    shard per frame count of the buckets

Why: plain `.npy` opens with `np.load(mmap_mode='r')`, so a training step reads just its rows
from the page cache with no decoding and no copy, and every bucket's items share one shape. Each
encoded batch becomes its own shard whose sidecar is renamed into place last: that rename is the
shard's commit, so an interrupted run keeps every finished batch and a rerun skips them, at a cost
per batch that does not grow with the dataset. The media are encoded first, the VAE alone on the
device, each batch's shard committed with its latents only; then the text encoders alone add
each shard's text embeddings and commit it again, whole (a GPU of 24 GB holds an 8B text
encoder or a video VAE's activations, not both). Once all items are encoded each bucket is compacted
into a single shard in key order, then `manifest.json` (the only thing readers open) is renamed
into place and files it does not name are deleted; nothing half-written is ever read. A build
holds `<cache dir>.lock` (beside the cache, which keeps only what the manifest names), so a second
run caching the same dataset waits, then finds every item committed, instead of deleting the
first one's temporaries.

Position ids are left to the caller: they are the same for every item of a bucket, so they are
not stored; `Cache.grid(bucket)` gives the latent grid (a family's `position_ids(grid)`).
"""
import hashlib
import logging
import json
import os
import shutil
import uuid

import numpy as np
from tqdm import tqdm

from diffpipe_jax import locks
from diffpipe_jax.files import atomic_write

MANIFEST = "manifest.json"
EMPTY = "empty"
TEXT_DONE = "text"  # a sidecar's flag, False while its shard holds latents only


def fingerprint(identity, item) -> str:
  """The cache key of an item: the caller's key (file identity and content), its caption and
  bucket, and the encoders' identity."""
  blob = json.dumps([identity, item["key"], item["caption"], list(item["bucket"])])
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


def bucket_name(bucket):
  return "x".join(str(v) for v in bucket)


def write_json(path, obj):
  atomic_write(path, lambda f: f.write(json.dumps(obj).encode()))


def write_shard(folder, arrays, meta, sid=None):
  """Writes one shard: its arrays first, its sidecar last (the commit); with `sid`, adds the
  arrays to that shard and commits its new sidecar. Returns the shard id."""
  os.makedirs(folder, exist_ok=True)
  sid = sid or uuid.uuid4().hex[:12]
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


def committed_rows(shards):
  """fingerprint -> (shard id, row, sidecar) of every row of `shards`."""
  return {fp: (sid, row, meta) for _, sid, meta in shards for row, fp in enumerate(meta["fingerprints"])}


def captioned(shards):
  """The shards that hold their rows' text embeddings, not only their latents."""
  return [shard for shard in shards if shard[2].get(TEXT_DONE, True)]


def awaiting_text(cache_dir, wanted):
  """The shards of latents whose text the text pass has not encoded yet, where every row is
  still `wanted` (the others are collected as garbage and their wanted items encoded anew)."""
  return [shard for shard in committed_shards(cache_dir) if not shard[2].get(TEXT_DONE, True)
          and set(shard[2]["fingerprints"]) <= wanted.keys()]


def encode_latents(cache_dir, todo, encoders, batch_size, bar):
  """The media pass: each batch of `todo` (bucket name -> [(fingerprint, item)]) encoded by the
  VAE (`encode_fields`) into a shard of latents, committed without its text (its sidecar says so)."""
  for name, pending in todo.items():
    for start in range(0, len(pending), batch_size):
      chunk = pending[start:start + batch_size]
      pixels = np.stack([item["load_pixels"]() for _, item in chunk]).astype(np.float32)
      meta = dict(fingerprints=[fp for fp, _ in chunk], keys=[it["key"] for _, it in chunk],
                  bucket=list(chunk[0][1]["bucket"]),
                  grid=list(encoders.latent_grid(*pixels.shape[1:4])), **{TEXT_DONE: False})
      write_shard(os.path.join(cache_dir, name), encoders.encode_fields(pixels), meta)
      bar.update(len(chunk))


def encode_captions(cache_dir, shards, captions, encoders, bar):
  """The text pass: each shard of latents gains its captions' embeddings (`captions`:
  fingerprint -> caption), encoded as media of its frame count are, and is committed whole."""
  for name, sid, meta in shards:
    texts = [captions[fp] for fp in meta["fingerprints"]]
    meta = {k: v for k, v in meta.items() if k != TEXT_DONE}
    write_shard(os.path.join(cache_dir, name), encoders.encode_text(texts, frames=meta["bucket"][-1]),
                meta, sid=sid)
    bar.update(len(texts))


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
  keep |= {(EMPTY, b["empty"]) for b in manifest["buckets"].values()}
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


def empty_caption(cache_dir, encoders, identity, frames, rows) -> str:
  """The shard of the empty caption encoded as the captions of media of `frames` frames are (a
  family may prompt its text encoder differently for images and videos), written if missing: a
  cache of an earlier version (one empty caption, for images, keyed without frames) gains them."""
  fp = fingerprint(identity, dict(key="", caption="", bucket=(frames,)))
  if fp not in rows:
    sid = write_shard(os.path.join(cache_dir, EMPTY), encoders.encode_text([""], frames=frames),
                      dict(fingerprints=[fp], keys=[""], bucket=[frames], grid=[]))
    rows[fp] = (sid, 0, None)
  return rows[fp][0]


def build_cache(cache_dir, items, encoders, batch_size, regenerate=False) -> "Cache":
  """Encodes the items not already cached, drops the ones no longer listed, and returns the cache.

  `items`: dicts with `key` (the caller's fingerprint of the file and its settings), `caption`,
  `bucket` ((width, height, frames)) and `load_pixels()` -> float32 [F, H, W, 3]
  in [-1, 1] at the bucket's size. Items with equal fingerprints are encoded and stored once."""
  with locks.waiting(os.path.normpath(cache_dir) + ".lock", what=f"the dataset cache {cache_dir}"):
    return update_cache(cache_dir, items, encoders, batch_size, regenerate)


def update_cache(cache_dir, items, encoders, batch_size, regenerate) -> "Cache":
  """`build_cache`'s work, while it holds the cache's lock."""
  if regenerate and os.path.isdir(cache_dir):
    shutil.rmtree(cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  identity = encoders.identity()
  wanted = {}  # fingerprint -> item, deduplicated, in input order
  for item in items:
    wanted.setdefault(fingerprint(identity, item), item)
  # Two passes, the VAE alone then the text encoders alone, each freed before the next loads
  # (`device_memory`); a shard of latents whose rows are all still wanted waits for its text.
  started = committed_rows(captioned(committed_shards(cache_dir)) + awaiting_text(cache_dir, wanted))
  todo = {}
  for fp, item in wanted.items():
    if fp not in started:
      todo.setdefault(bucket_name(item["bucket"]), []).append((fp, item))
  if todo:
    with tqdm(total=sum(map(len, todo.values())), desc="caching latents", unit="item") as bar:
      encode_latents(cache_dir, todo, encoders, batch_size, bar)
    encoders.release(encoders.media_components)
  order = {fp: i for i, fp in enumerate(wanted)}  # the captions' order, as given
  uncaptioned = sorted(awaiting_text(cache_dir, wanted), key=lambda s: order[s[2]["fingerprints"][0]])
  if uncaptioned:
    with tqdm(total=sum(len(s[2]["fingerprints"]) for s in uncaptioned), desc="caching captions",
              unit="item") as bar:
      encode_captions(cache_dir, uncaptioned, {fp: it["caption"] for fp, it in wanted.items()},
                      encoders, bar)
  for note in encoders.truncation_notes():  # once per cache, not once per batch
    logging.warning("%s: %s", cache_dir, note)
  shards = captioned(committed_shards(cache_dir))
  rows = committed_rows(shards)
  by_bucket = {}
  for fp, item in wanted.items():
    by_bucket.setdefault(bucket_name(item["bucket"]), []).append((item["key"], fp))
  buckets = {}
  for name, live in sorted(by_bucket.items()):
    sid, meta = compact(cache_dir, name, sorted(live), rows, shards)
    empty = empty_caption(cache_dir, encoders, identity, meta["bucket"][-1], rows)
    buckets[name] = dict(shard=sid, bucket=meta["bucket"], grid=meta["grid"], keys=meta["keys"],
                         empty=empty)
  manifest = dict(version=2, identity=identity, buckets=buckets)
  write_json(os.path.join(cache_dir, MANIFEST), manifest)
  collect_garbage(cache_dir, manifest)
  return Cache(cache_dir)


class Cache:
  """A finished cache, memory-mapped: buckets, their items in key order, their empty caption."""

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
    """The latent grid of a bucket (as the encoders' `latent_grid` gave it), for position ids."""
    return tuple(self.entries[tuple(bucket)][1]["grid"])

  def get(self, bucket, index):
    """Item `index` (int or index array) of a bucket: every field the encoders made (latents
    and the text embeddings), as read-only memory-mapped views."""
    name, b = self.entries[tuple(bucket)]
    return {k: v[index] for k, v in self._fields(name, b["shard"]).items()}

  def empty_text(self, bucket):
    """The empty caption's embeddings (every text field) as a bucket's captions were encoded,
    for caption dropout."""
    shard = self.entries[tuple(bucket)][1]["empty"]
    return {k: v[0] for k, v in self._fields(EMPTY, shard).items()}

  def __len__(self):
    return sum(len(b["keys"]) for _, b in self.entries.values())
