"""Training data: media directories -> size/frame buckets -> cached latents and text -> batches.

Every batch comes from one bucket. An epoch's order is a pure function of (seed, epoch): each
bucket is shuffled, cut into global batches (the remainder dropped), and the batches shuffled.
The data position is therefore just (epoch, batch index), which the checkpoint stores through
the step, and a resumed run sees exactly the batches it would have seen. grain serves them with
prefetching threads; each process loads only its rows of a global batch (multi-host).
"""
import collections
import dataclasses
import logging
import os
from typing import List, Optional, Sequence, Tuple

import grain
import numpy as np

from diffpipe_jax import buckets, cache, media
from diffpipe_jax.errors import UserError


# Up to 2x (a 512 pixel photo in a 1024 bucket) is common and Lanczos keeps it sharp enough;
# beyond it each source pixel spreads over more than 2x2 bucket pixels and the blur shows.
MAX_UPSCALE = 2.0


@dataclasses.dataclass(frozen=True)
class CachedDirectory:
  cache: cache.Cache
  num_repeats: int


def dataset_settings(dataset_config) -> media.DatasetSettings:
  """Our config's dataset section, or a diffusion-pipe dataset.toml given as `toml_path`."""
  d = dict(dataset_config)
  toml_path = d.pop("toml_path", "")
  settings = media.settings_from_toml(toml_path) if toml_path else media.settings_from_dict(d)
  if settings.shuffle_tags:
    raise UserError("shuffle_tags needs the text encoded at every step, but text embeddings are "
                     "cached once: set shuffle_tags = false")
  masked = [d.path for d in settings.directories if d.mask_path]
  if masked:
    raise UserError(f"mask_path (set for {masked}) is not supported yet: masks are not cached "
                     "or applied to the loss; remove mask_path")
  return settings


def config_as_run(config, settings: media.DatasetSettings):
  """A copy of `config` whose dataset keys hold what the run uses: those of a dataset TOML
  (`toml_path`) instead of the values it leaves unused, so that the run's config.json (and W&B,
  and a resume's comparison with it) shows them."""
  run = config.copy_and_resolve_references()
  for key in run.dataset.keys():
    if hasattr(settings, key):
      run.dataset[key] = getattr(settings, key)
  return run


def upscale_warning(path: str, assigned: Sequence[tuple]) -> Optional[str]:
  """One warning for the files of a directory that are upscaled more than MAX_UPSCALE to cover
  their largest bucket (a 1x1 or 64x64 image in a 512 bucket trains the model on a blur), None
  when there are none. `assigned`: [(Item, [Bucket, ...])]."""
  blurry = []
  for item, bs in assigned:
    scale, worst = max(((buckets.upscale(item.width, item.height, b.width, b.height), b)
                        for b in bs), default=(0, None))
    if scale > MAX_UPSCALE:
      blurry.append(f"{os.path.basename(item.path)} {item.width}x{item.height} -> "
                    f"{worst.width}x{worst.height}")
  if not blurry:
    return None
  return (f"dataset {path}: {len(blurry)} of {len(assigned)} files are upscaled more than "
          f"{MAX_UPSCALE:g}x to fit their bucket ({media.listed(blurry)}); they will look blurry")


def takes_videos(encoders) -> bool:
  """Whether the encoders' family trains on videos; a family of images skips them, as
  diffusion-pipe does, so that a dataset of both trains an image model on its images."""
  return encoders.frame_rate is not None


def check_frame_buckets(directory: media.DirectorySettings, frames: Sequence[int], encoders):
  """Every frame bucket of a video family is one its encoders take: 1 (images), or
  1 + k * `frames_per_latent`. A family of images leaves the clip lengths empty."""
  if not takes_videos(encoders):
    return
  step = encoders.frames_per_latent
  bad = [f for f in frames if f > 1 and (f - 1) % step]
  if bad:
    raise UserError(f"frame_buckets={list(frames)} for {directory.path}: {bad} cannot be encoded; "
                    f"frame counts must be 1 or 1 + a multiple of {step} (1, {1 + step}, "
                    f"{1 + 2 * step}, ...)")


def item_buckets(item: media.Item, sizes: dict, frames: Sequence[int], encoders) -> list:
  """The buckets an item trains in: [] for a video that the family skips or that is shorter
  than every frame bucket of videos."""
  if item.kind == "video" and not takes_videos(encoders):
    return []
  return buckets.assign(item.width, item.height, media.frames_at_fps(item, encoders.frame_rate),
                        sizes, frames)


def skipped_warning(path: str, assigned: Sequence[tuple], frames: Sequence[int],
                    encoders) -> Optional[str]:
  """One warning for the files of a directory that no bucket takes (all videos), saying why,
  None when there are none. `assigned`: [(Item, [Bucket, ...])]."""
  skipped = [item for item, bs in assigned if not bs]
  if not skipped:
    return None
  names = [os.path.basename(item.path) for item in skipped]
  shortest = min((f for f in frames if f > 1), default=None)
  if not takes_videos(encoders):
    why = "videos, and this model takes images only"
  elif shortest is None:
    why = f"videos, and frame_buckets={list(frames)} has no frame count for them"
  else:
    why = (f"videos shorter than the smallest frame bucket of videos ({shortest} frames at "
           f"{encoders.frame_rate:g} fps)")
    names = [f"{name} ({media.frames_at_fps(item, encoders.frame_rate)} frames)"
             for name, item in zip(names, skipped)]
  return (f"dataset {path}: {len(skipped)} of {len(assigned)} files skipped, {why}: "
          f"{media.listed(names)}")


def bucket_counts(path: str, entries: Sequence[dict]) -> str:
  """What each bucket of a directory got: its cache entries (one per item, resolution and clip)."""
  counts = collections.Counter(entry["bucket"] for entry in entries)
  return (f"dataset {path}: items per bucket (width x height x frames): "
          + ", ".join(f"{w}x{h}x{f}: {n}" for (w, h, f), n in sorted(counts.items())))


def cache_items(directory: media.DirectorySettings, items: Sequence[media.Item], encoders,
                video_clip_mode="single_beginning") -> tuple:
  """(entries, warnings): one cache entry per (item, bucket, clip), its key covering file
  content, caption, bucket and, for a video, where the clip starts at the encoders' frame rate;
  and a line for each thing the user should know of the directory's files (those no bucket
  takes, those upscaled to a blur)."""
  sizes, frames = media.directory_buckets(directory, encoders.pixel_multiple)
  check_frame_buckets(directory, frames, encoders)
  fps = encoders.frame_rate
  assigned = [(item, item_buckets(item, sizes, frames, encoders)) for item in items]
  warnings = [w for w in (skipped_warning(directory.path, assigned, frames, encoders),
                          upscale_warning(directory.path, assigned)) if w]
  entries = []
  for item, bs in assigned:
    # The cache orders a bucket by key: file name first keeps the order stable across edits.
    name = os.path.relpath(item.path, directory.path)
    for b in bs:
      starts = ([0] if item.kind == "image" else
                media.clip_starts(media.frames_at_fps(item, fps), b.frames, video_clip_mode))
      for start in starts:
        load = lambda item=item, b=b, start=start: buckets.resize_and_crop(
            media.read_frames(item, fps, b.frames, start), b.width, b.height
        ).astype(np.float32) / 127.5 - 1
        clip = "" if item.kind == "image" else f"@{start}/{fps}fps"
        entries.append(dict(key=f"{name}|{b.width}x{b.height}x{b.frames}{clip}|{item.fingerprint()}",
                            caption=item.caption, bucket=tuple(b), load_pixels=load))
  return entries, warnings


def cache_dataset(settings: media.DatasetSettings, model_type: str, encoders, batch_size: int,
                  regenerate=False) -> List[CachedDirectory]:
  """Scans and caches every directory into `<directory>/cache/<model_type>/`, bucket sides
  multiples of the encoders' `pixel_multiple`, videos at their `frame_rate`. Says, once per
  directory, what each bucket got and which files none takes; a dataset of which no file fits a
  bucket is an error that says why."""
  planned = [(directory, *cache_items(directory, items, encoders, settings.video_clip_mode))
             for directory, items in media.scan_dataset(settings)]
  if not any(entries for _, entries, _ in planned):
    raise UserError("no file of the dataset fits a bucket: "
                    + "; ".join(w for _, _, warnings in planned for w in warnings))
  out = []
  for directory, entries, warnings in planned:
    for warning in warnings:
      logging.warning(warning)
    print(bucket_counts(directory.path, entries))
    cache_dir = os.path.join(directory.path, "cache", model_type)
    out.append(CachedDirectory(cache.build_cache(cache_dir, entries, encoders, batch_size, regenerate),
                               directory.num_repeats))
  return out


def open_cached_dataset(settings: media.DatasetSettings, model_type: str) -> List[CachedDirectory]:
  """The caches `cache_dataset` built (by another process of a multi-host run), read only."""
  try:
    return [CachedDirectory(cache.Cache(os.path.join(d.path, "cache", model_type)), d.num_repeats)
            for d in map(settings.resolve, settings.directories)]
  except FileNotFoundError as e:
    raise UserError(f"no finished cache where process 0 should have written it ({e}): "
                    "all hosts must see the dataset folders on a shared filesystem") from e


Row = Tuple[int, int]  # (directory index, row in that directory's bucket)
Batch = Tuple[tuple, List[Row]]  # (bucket, rows)


def micro_batch_sizes(micro_batch_size_per_gpu, image_micro_batch_size_per_gpu=0):
  """bucket (width, height, frames) -> micro batch per device: diffusion-pipe's
  `micro_batch_size_per_gpu`, an int or [[resolution, batch], ...] (a bucket takes the batch of
  the listed resolution nearest its area's side), and `image_micro_batch_size_per_gpu` for
  one-frame buckets when set."""
  def size(bucket):
    width, height, frames = bucket
    if frames == 1 and image_micro_batch_size_per_gpu:
      return image_micro_batch_size_per_gpu
    if isinstance(micro_batch_size_per_gpu, int):
      return micro_batch_size_per_gpu
    side = np.sqrt(width * height)
    return min(micro_batch_size_per_gpu, key=lambda rb: abs(np.log(rb[0] / side)))[1]
  return size


class Batches:
  """The bucketed, seeded batch schedule over cached directories, and the loading of a batch.
  `global_batch`: the batch of every bucket, or bucket -> its batch. With `uncond_fraction`, that
  fraction of the samples (drawn from the seed and the batch's place) trains on the empty
  caption's embeddings, encoded as their bucket's captions were, instead of theirs."""

  def __init__(self, directories: Sequence[CachedDirectory], global_batch, seed: int,
               position_ids, name="dataset", micro_batches=1, uncond_fraction=0.0):
    self.directories, self.seed, self.uncond_fraction = directories, seed, uncond_fraction
    self.batch_size = global_batch if callable(global_batch) else lambda bucket: global_batch
    self.micro_batches = micro_batches  # a global batch is this many consecutive micro-batches
    self.position_ids = position_ids  # latent grid -> position ids (the model family's), or None
    groups = {}
    for d_idx, d in enumerate(directories):
      for bucket, count in d.cache.buckets():
        rows = [(d_idx, r) for r in range(count)] * d.num_repeats
        groups.setdefault(tuple(bucket), []).extend(rows)
    self.groups = {b: rows for b, rows in sorted(groups.items()) if len(rows) >= self.batch_size(b)}
    dropped = {b: len(rows) for b, rows in groups.items() if b not in self.groups}
    counts = ", ".join(f"{w}x{h}x{f}: {len(rows)} (batch {self.batch_size((w, h, f))})"
                       for (w, h, f), rows in sorted(groups.items()))
    if not self.groups:
      raise UserError(
          f"{name}: no bucket holds a full global batch (micro batch x data parallel x "
          f"accumulation); items per bucket (width x height x frames): {counts or 'none'}. "
          "Add images, raise num_repeats, use fewer resolutions/AR buckets, or lower the batch")
    if dropped:
      logging.warning("%s: buckets smaller than one global batch are not used: %s", name,
                      {b: f"{n} < {self.batch_size(b)}" for b, n in dropped.items()})
    full = {b: len(rows) // self.batch_size(b) for b, rows in self.groups.items()}
    self.steps_per_epoch = sum(full.values())
    self.examples_per_epoch = sum(n * self.batch_size(b) for b, n in full.items())

  def examples_seen(self, step: int) -> int:
    """Training examples in the first `step` batches (diffusion-pipe's `*_every_n_examples`)."""
    epoch, index = divmod(step, self.steps_per_epoch)
    return epoch * self.examples_per_epoch + sum(len(rows) for _, rows in self.epoch(epoch)[:index])

  def epoch(self, epoch: int) -> List[Batch]:
    rng = np.random.default_rng([self.seed, epoch])
    batches = []
    for bucket, rows in self.groups.items():
      order, size = rng.permutation(len(rows)), self.batch_size(bucket)
      n = len(rows) // size * size
      batches += [(bucket, [rows[i] for i in order[s:s + size]]) for s in range(0, n, size)]
    return [batches[i] for i in rng.permutation(len(batches))]

  def load(self, batch: Batch, process_index=0, process_count=1, place=(0, 0)) -> dict:
    """This process's share of a global batch, as numpy arrays with a leading batch axis: its
    slice of each micro-batch, as a [micro-batches, micro batch] array split over 'data' lays
    them out, so that every process count sees the same samples in the same places. `place`:
    (epoch, index) of the batch, which draws its caption dropout."""
    bucket, rows = batch
    uncond = np.random.default_rng([self.seed, *place, 1]).random(len(rows)) < self.uncond_fraction
    per = len(rows) // self.micro_batches // process_count
    mine = [i for m in range(self.micro_batches)
            for i in range(len(rows))[(m * process_count + process_index) * per:][:per]]
    items = []
    for i in mine:
      directory, row = rows[i]
      item = self.directories[directory].cache.get(bucket, row)
      empty = self.directories[directory].cache.empty_text(bucket) if uncond[i] else {}
      items.append({**item, **empty})
    out = {k: np.stack([it[k] for it in items]) for k in items[0]}  # every cached field
    if self.position_ids is not None:
      ids = self.position_ids(self.directories[rows[0][0]].cache.grid(bucket))
      out["position_ids"] = np.broadcast_to(ids, (len(mine),) + ids.shape)
    return out

  def iterate(self, epoch: int, start: int = 0, process_index=0, process_count=1):
    """Batches `start`, `start + 1`, ... of `epoch`, loaded ahead by grain's threads."""
    placed = [(batch, (epoch, i)) for i, batch in enumerate(self.epoch(epoch))]
    ds = grain.MapDataset.source(placed)[start:].map(
        lambda b: self.load(b[0], process_index, process_count, place=b[1]))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)))
