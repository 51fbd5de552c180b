"""Aspect-ratio and frame-count buckets: the samples of a batch must share one latent shape, so
media are grouped by (width, height, frames) and resized/cropped to their bucket.

A resolution is the side of a square of the same area (512: about 512*512 pixels), so every bucket
of one resolution costs about the same compute whatever its aspect ratio.
"""
import math
from typing import NamedTuple, Sequence

import numpy as np
from PIL import Image

from diffpipe_jax.errors import UserError


class Bucket(NamedTuple):
  width: int
  height: int
  frames: int


def ar_buckets(min_ar: float, max_ar: float, num_ar_buckets: int) -> list:
  """`num_ar_buckets` aspect ratios (w/h) evenly spaced in log space, min_ar and max_ar included:
  portrait and landscape get mirror-image buckets when min_ar = 1/max_ar."""
  if not 0 < min_ar <= max_ar:
    raise UserError(f"need 0 < min_ar <= max_ar, got min_ar={min_ar}, max_ar={max_ar}")
  if num_ar_buckets < 1:
    raise UserError(f"num_ar_buckets={num_ar_buckets}; need at least 1")
  return [float(a) for a in np.geomspace(min_ar, max_ar, num_ar_buckets)]


def explicit_ars(values: Sequence) -> list:
  """An explicit `ar_buckets` list: ratios (1.5) or [width, height] pairs ([768, 512])."""
  ars = [v[0] / v[1] if isinstance(v, (list, tuple)) else float(v) for v in values]
  if not ars or min(ars) <= 0:
    raise UserError(f"ar_buckets={list(values)}; need positive ratios or [width, height] pairs")
  return ars


def _round_to(x: float, multiple: int) -> int:
  return max(multiple, math.floor(x / multiple + 0.5) * multiple)


def size_buckets(resolutions: Sequence[int], ars: Sequence[float], multiple: int) -> dict:
  """{resolution: [(width, height), ...]}: per aspect ratio, w*h ~= res^2 and w/h ~= ar, both sides
  rounded to `multiple` (pixels per latent token: 16 for Flux, 32 LTX); unique, sorted by w/h."""
  out = {}
  for res in resolutions:
    sizes = {(_round_to(res * math.sqrt(ar), multiple), _round_to(res / math.sqrt(ar), multiple))
             for ar in ars}
    out[res] = sorted(sizes, key=lambda s: (s[0] / s[1], s[0]))
  return out


def frame_buckets(values: Sequence[int]) -> list:
  """Sorted unique frame counts; 1 (still images) is always one of them."""
  if any(int(v) < 1 for v in values):
    raise UserError(f"frame_buckets={list(values)}; frame counts must be >= 1")
  return sorted({1, *(int(v) for v in values)})


def frame_bucket(num_frames: int, frames: Sequence[int]):
  """The longest bucket <= num_frames. A clip (num_frames > 1) never falls back to 1, the image
  bucket: a video shorter than every video bucket gets None (skip it) instead of silently
  training as a still."""
  fits = [f for f in frames if f <= num_frames and (f > 1 or num_frames == 1)]
  return max(fits) if fits else None


def nearest_size(width: int, height: int, sizes: Sequence[tuple]) -> tuple:
  """The size whose aspect ratio is closest in log space (2:1 and 1:2 equally far from 1:1)."""
  ar = math.log(width / height)
  return min(sizes, key=lambda s: abs(math.log(s[0] / s[1]) - ar))


def assign(width: int, height: int, num_frames: int, sizes: dict, frames: Sequence[int]) -> list:
  """One Bucket per resolution (an item trains at each), [] when no frame bucket fits."""
  f = frame_bucket(num_frames, frames)
  if f is None:
    return []
  return [Bucket(*nearest_size(width, height, s), f) for s in sizes.values()]


def upscale(width: int, height: int, bucket_width: int, bucket_height: int) -> float:
  """The factor resize_and_crop scales a width x height source by: just enough to cover the
  bucket (above 1: upscaled)."""
  return max(bucket_width / width, bucket_height / height)


def resize_and_crop(frames: np.ndarray, width: int, height: int) -> np.ndarray:
  """uint8 [F, H, W, 3] -> [F, height, width, 3]: scaled (aspect kept) until the bucket is covered,
  then centre-cropped, as one resample of the source's centre region (no padding, no stretch)."""
  _, h, w, _ = frames.shape
  scale = upscale(w, h, width, height)
  src_w, src_h = width / scale, height / scale
  left, top = (w - src_w) / 2, (h - src_h) / 2
  box = (left, top, left + src_w, top + src_h)
  return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS,
                                                        box=box)) for f in frames])
