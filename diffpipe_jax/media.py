"""Media on disk: scanning dataset directories (images, videos, same-stem .txt captions, masks),
decoding frames at the model's frame rate, and diffusion-pipe's dataset settings (dataset.toml or
our ml_collections config) with their per-directory overrides.

Scanning reads headers only; pixels are decoded when cached. An item's fingerprint hashes file
content as well as name, size and mtime: an edited image with the same name invalidates its cache.
"""
import dataclasses
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import av
import numpy as np
from PIL import Image, ImageOps

from diffpipe_jax import buckets
from diffpipe_jax.errors import UserError
from diffpipe_jax.files import read_toml

log = logging.getLogger(__name__)

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp"}
VIDEO_EXTS = {".mp4", ".webm", ".mov"}
CLIP_MODES = ("single_beginning", "single_middle", "multiple_overlapping")
_HASH_CHUNK = 1 << 20
_MAX_NAMES = 20  # file names listed in one warning


class MediaError(UserError):
  """A dataset file or directory that cannot be used; the message names it."""


def content_hash(path: str) -> str:
  """sha1 of the size and the first and last MiB: catches edits without reading whole videos."""
  size = os.path.getsize(path)
  h = hashlib.sha1(str(size).encode())
  with open(path, "rb") as f:
    h.update(f.read(_HASH_CHUNK))
    if size > _HASH_CHUNK:
      f.seek(max(_HASH_CHUNK, size - _HASH_CHUNK))
      h.update(f.read())
  return h.hexdigest()


@dataclass(frozen=True)
class Item:
  """One image or video as scanned. caption has the prefix applied, tags not shuffled; for videos
  num_frames and fps are the source's (see frames_at_fps); images have num_frames 1, fps None."""
  path: str
  caption: str
  mask_path: Optional[str]
  kind: str
  width: int
  height: int
  num_frames: int
  fps: Optional[float]
  size: int
  mtime_ns: int

  def fingerprint(self) -> str:
    """Identity of what gets cached: path, size, mtime, content (read now), caption and mask."""
    mask = self.mask_path and f"{self.mask_path}:{content_hash(self.mask_path)}"
    parts = (self.path, self.size, self.mtime_ns, content_hash(self.path), self.caption, mask)
    return hashlib.sha1(repr(parts).encode()).hexdigest()


def _image_size(path: str) -> tuple:
  """(width, height) as displayed: EXIF orientations 5-8 (phone portraits) swap the axes."""
  with Image.open(path) as img:
    w, h = img.size
    transposed = img.getexif().get(0x0112) in (5, 6, 7, 8)
  return (h, w) if transposed else (w, h)


def _video_stream(container):
  if not container.streams.video:
    raise MediaError("no video stream")
  stream = container.streams.video[0]
  stream.thread_type = "AUTO"
  return stream


def _video_info(path: str) -> tuple:
  """(width, height, source frames, fps); decodes one frame so a broken file fails here."""
  with av.open(path) as c:
    stream = _video_stream(c)
    next(c.decode(stream))
    rate = stream.average_rate or stream.guessed_rate
    info = [stream.codec_context.width, stream.codec_context.height, stream.frames, float(rate)]
  if not info[2]:  # no frame count in the header (webm): count packets, no decoding
    with av.open(path) as c:
      info[2] = sum(1 for p in c.demux(c.streams.video[0]) if p.size)
  return tuple(info)


def _find_mask(mask_dir: str, stem: str) -> Optional[str]:
  for ext in sorted(IMAGE_EXTS):
    path = os.path.join(mask_dir, stem + ext)
    if os.path.isfile(path):
      return path
  return None


def _read_caption(path: str) -> Optional[str]:
  """The stripped same-stem .txt caption, None when there is none."""
  txt = os.path.splitext(path)[0] + ".txt"
  if not os.path.isfile(txt):
    return None
  with open(txt, encoding="utf-8") as f:
    return f.read().strip()


def _scan_file(path: str, caption_prefix: str, mask_dir: Optional[str]) -> tuple:
  """(Item, caption found, mask found) for one media file; raises on an unreadable one."""
  ext = os.path.splitext(path)[1].lower()
  if ext in IMAGE_EXTS:
    kind, (w, h), frames, fps = "image", _image_size(path), 1, None
  else:
    kind, (w, h, frames, fps) = "video", _video_info(path)
  caption = _read_caption(path)
  mask = mask_dir and _find_mask(mask_dir, os.path.splitext(os.path.basename(path))[0])
  st = os.stat(path)
  item = Item(path=path, caption=caption_prefix + (caption or ""), mask_path=mask, kind=kind,
              width=w, height=h, num_frames=frames, fps=fps, size=st.st_size,
              mtime_ns=st.st_mtime_ns)
  return item, caption is not None, mask is not None


def listed(texts: list) -> str:
  """The first _MAX_NAMES of `texts` (file names, or names with details), and how many more."""
  more = len(texts) - _MAX_NAMES
  return ", ".join(texts[:_MAX_NAMES]) + (f" and {more} more" if more > 0 else "")


def _names(paths: list) -> str:
  return listed([os.path.basename(p) for p in paths])


def scan_directory(path: str, caption_prefix: str = "", mask_path: Optional[str] = None,
                   on_error: str = "warn") -> list:
  """Items for the images and videos directly in `path` (not subfolders: the cache lives there),
  sorted by name. A missing caption means an empty one; a missing mask trains on the whole frame;
  both are warned about. An unreadable file is skipped with a warning, or raises when
  on_error="raise"."""
  if on_error not in ("warn", "raise"):
    raise UserError(f"on_error={on_error!r}; use 'warn' or 'raise'")
  if not os.path.isdir(path):
    raise MediaError(f"dataset directory {path!r} does not exist or is not a directory")
  if mask_path is not None and not os.path.isdir(mask_path):
    raise MediaError(f"mask directory {mask_path!r} (for {path!r}) does not exist")
  exts = sorted(IMAGE_EXTS | VIDEO_EXTS)
  files = sorted(os.path.join(os.path.abspath(path), n) for n in os.listdir(path)
                 if os.path.splitext(n)[1].lower() in exts)
  if not files:
    raise MediaError(f"no images or videos ({', '.join(exts)}) in dataset directory {path!r}")
  items, uncaptioned, unmasked = [], [], []
  for f in files:
    try:
      item, has_caption, has_mask = _scan_file(f, caption_prefix, mask_path)
    except (OSError, ValueError, av.FFmpegError, StopIteration) as e:
      if on_error == "raise":
        raise MediaError(f"cannot read {f}: {e}") from e
      log.warning("skipping unreadable media file %s: %s", f, e)
      continue
    items.append(item)
    uncaptioned += [] if has_caption else [f]
    unmasked += [] if has_mask or mask_path is None else [f]
  if uncaptioned:
    log.warning("%d file(s) in %s have no same-stem .txt caption, using an empty caption: %s",
                len(uncaptioned), path, _names(uncaptioned))
  if unmasked:
    log.warning("%d file(s) in %s have no mask in %s, training on the whole frame: %s",
                len(unmasked), path, mask_path, _names(unmasked))
  if not items:
    raise MediaError(f"none of the {len(files)} media files in {path!r} could be read")
  return items


def write_video(path, frames, fps):
  """Encodes uint8 frames [F, H, W, 3] at `fps` with PyAV: H.264 (MPEG-4 part 2 without x264)
  for .mp4, VP9 (VP8) for .webm; bit-exact, so the same frames always give the same file (the
  cache keys files by content). x264 gets a constant quantiser: with its default rate control
  the same frames encoded differently once a VP9 encode had run in the process."""
  mp4 = str(path).endswith(".mp4")
  codec = next(c for c in (("libx264", "mpeg4") if mp4 else ("libvpx-vp9", "libvpx"))
               if c in av.codecs_available)
  options = {"threads": "1", **({"qp": "20"} if codec == "libx264" else {})}
  with av.open(str(path), "w", options={"fflags": "+bitexact"}) as container:
    stream = container.add_stream(codec, rate=fps, options=options)
    stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
    stream.codec_context.flags |= av.codec.context.Flags.bitexact
    for k, pixels in enumerate(frames):
      frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
      frame.pts, frame.time_base = k, Fraction(1, fps)
      container.mux(stream.encode(frame))
    container.mux(stream.encode())
  return path


# What `write_media` writes, by the path's extension (the first: a folder's samples)
IMAGE_OUT = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_OUT = (".mp4", ".webm")


def write_media(path, pixels, fps=24):
  """Pixels [F, H, W, 3] in [-1, 1] -> `path`: an image of one frame, else a video at `fps`, in
  the format of the extension (`IMAGE_OUT`, `VIDEO_OUT`), written under a temporary name and
  renamed into place."""
  frames = np.round((np.clip(pixels, -1, 1) + 1) * 127.5).astype(np.uint8)
  stem, ext = os.path.splitext(path)
  tmp = f"{stem}.tmp{ext}"
  if len(frames) == 1:
    Image.fromarray(frames[0]).save(tmp, quality=95)  # JPEG's and WebP's defaults blur detail
  else:
    write_video(tmp, frames, fps)
  os.replace(tmp, path)
  return path


def frames_at_fps(item: Item, fps: Optional[float] = None) -> int:
  """Frames the item has once resampled to `fps` (all source frames when fps is None; images 1)."""
  if item.kind == "image":
    return 1
  if fps is None or not item.fps:
    return item.num_frames
  return max(1, math.floor(item.num_frames * fps / item.fps + 1e-6))


def _rgb(img: Image.Image) -> np.ndarray:
  """uint8 [H, W, 3]. PIL opens 16-bit greyscale PNGs as mode I;16 (I on older Pillows), whose
  convert("RGB") clips 0..65535 at 255, nearly all white: scale them down to 0..255 instead."""
  if img.mode.startswith("I"):
    grey = np.rint(np.asarray(img, np.float64) / 257)
    img = Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8))
  return np.asarray(img.convert("RGB"))


def read_image(path: str) -> np.ndarray:
  """An image file as one frame: uint8 [1, H, W, 3], upright (EXIF orientation applied)."""
  with Image.open(path) as img:
    return _rgb(ImageOps.exif_transpose(img))[None]


def clip_starts(total: int, length: int, video_clip_mode: str = "single_beginning") -> list:
  """Where the clips of `length` frames taken from `total` start: one at the beginning or the
  middle, or (`multiple_overlapping`) as few as cover every frame, spread evenly from the first
  frame to the last, overlapping where `length` does not divide `total`."""
  if video_clip_mode not in CLIP_MODES:
    raise UserError(f"video_clip_mode={video_clip_mode!r}; use one of {CLIP_MODES}")
  spare = max(0, total - length)
  if video_clip_mode == "single_beginning":
    return [0]
  if video_clip_mode == "single_middle":
    return [spare // 2]
  clips = -(-total // length) if length else 1
  return [math.floor(i * spare / (clips - 1) + 0.5) for i in range(clips)] if clips > 1 else [0]


def _read_video(item: Item, fps, max_frames, start) -> np.ndarray:
  """Target frame k sits at t = k/fps after the first frame and takes the last source frame at or
  before it (with fps None: source frame k). Decoding streams and stops after the clip."""
  total = frames_at_fps(item, fps)
  n = total if max_frames is None else min(max_frames, total)
  start = min(start, total - n)
  target = (lambda k: k / fps) if fps else float
  out, prev, prev_rgb, t0 = [], None, None, None
  with av.open(item.path) as c:
    for i, frame in enumerate(c.decode(_video_stream(c))):
      if not fps:
        t = float(i)
      else:
        t = frame.time if frame.time is not None else i / item.fps
      t0 = t if t0 is None else t0
      while len(out) < n and target(start + len(out)) < t - t0 - 1e-3:
        prev_rgb = prev.to_ndarray(format="rgb24") if prev_rgb is None else prev_rgb
        out.append(prev_rgb)
      if len(out) == n:
        break
      prev, prev_rgb = frame, None
  if prev is None:
    raise MediaError(f"no decodable frame in {item.path}")
  if len(out) < n:  # targets past the last frame hold it
    out += [prev.to_ndarray(format="rgb24") if prev_rgb is None else prev_rgb] * (n - len(out))
  return np.stack(out)


def read_frames(item: Item, fps: Optional[float] = None, max_frames: Optional[int] = None,
                start: int = 0) -> np.ndarray:
  """uint8 [F, H, W, 3]. Images: F = 1. Videos: resampled to `fps` (the model's frame rate; None
  keeps every frame), then `max_frames` of them from frame `start` on (see `clip_starts`)."""
  try:
    if item.kind == "image":
      return read_image(item.path)
    return _read_video(item, fps, max_frames, start)
  except (OSError, av.FFmpegError) as e:
    raise MediaError(f"cannot decode {item.path}: {e}") from e


def shuffle_tags(caption: str, rng, delimiter: str = ",") -> str:
  """Caption tags ("a, b, c") in random order, whitespace normalised; `rng` is a random.Random or
  np.random.Generator. Tag order carries no meaning, so the model should not learn one."""
  tags = [" ".join(t.split()) for t in caption.split(delimiter)]
  tags = [t for t in tags if t]
  rng.shuffle(tags)
  return f"{delimiter} ".join(tags)


# --- dataset settings (diffusion-pipe's dataset.toml keys) ---

_OVERRIDES = ("resolutions", "enable_ar_bucket", "min_ar", "max_ar", "num_ar_buckets", "ar_buckets",
              "frame_buckets", "caption_prefix")
_AR_RANGE = ("min_ar", "max_ar", "num_ar_buckets")


@dataclass(frozen=True)
class DirectorySettings:
  """A `[[directory]]` table; None means "as the dataset" (see DatasetSettings.resolve)."""
  path: str
  mask_path: Optional[str] = None
  num_repeats: Optional[int] = None
  resolutions: Optional[tuple] = None
  enable_ar_bucket: Optional[bool] = None
  min_ar: Optional[float] = None
  max_ar: Optional[float] = None
  num_ar_buckets: Optional[int] = None
  ar_buckets: Optional[tuple] = None
  frame_buckets: Optional[tuple] = None
  caption_prefix: Optional[str] = None


@dataclass(frozen=True)
class DatasetSettings:
  """diffusion-pipe's dataset keys; the defaults are those of its example dataset.toml.
  resolutions are areas (512: 512x512 pixels worth); an explicit ar_buckets (ratios or [w, h]
  pairs) replaces the min_ar..max_ar geometric range."""
  directories: tuple = ()
  resolutions: tuple = (512,)
  enable_ar_bucket: bool = True
  min_ar: float = 0.5
  max_ar: float = 2.0
  num_ar_buckets: int = 7
  ar_buckets: Optional[tuple] = None
  frame_buckets: tuple = (1,)
  num_repeats: int = 1
  caption_prefix: str = ""
  shuffle_tags: bool = False
  video_clip_mode: str = "single_beginning"

  def resolve(self, d: DirectorySettings) -> DirectorySettings:
    """`d` with every unset key taken from the dataset. A directory that sets its own AR range
    drops an inherited explicit ar_buckets, which would otherwise silently win."""
    own = {k: v for k, v in dataclasses.asdict(d).items() if v is not None}
    if any(k in own for k in _AR_RANGE) and "ar_buckets" not in own:
      own["ar_buckets"] = None
    inherited = {k: getattr(self, k) for k in _OVERRIDES + ("num_repeats",)}
    return DirectorySettings(**{**inherited, **own})


def directory_buckets(d: DirectorySettings, multiple: int) -> tuple:
  """(size buckets {res: [(w, h)]}, frame buckets) of a resolved directory."""
  if not d.enable_ar_bucket:
    ars = [1.0]
  elif d.ar_buckets is not None:
    ars = buckets.explicit_ars(d.ar_buckets)
  else:
    ars = buckets.ar_buckets(d.min_ar, d.max_ar, d.num_ar_buckets)
  return buckets.size_buckets(d.resolutions, ars, multiple), buckets.frame_buckets(d.frame_buckets)


def scan_dataset(settings: DatasetSettings, on_error: str = "warn") -> list:
  """[(resolved DirectorySettings, [Item, ...]), ...] in the order of settings.directories."""
  out = []
  for d in map(settings.resolve, settings.directories):
    out.append((d, scan_directory(d.path, d.caption_prefix, d.mask_path, on_error)))
  return out


def _tuples(v):
  """Lists (TOML arrays, ConfigDict lists) -> tuples, so settings are hashable and frozen."""
  return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def _check_keys(d: dict, known: set, where: str):
  unknown = set(d) - known
  if unknown:
    raise UserError(f"unknown key(s) {sorted(unknown)} in {where}; known keys: {sorted(known)}")


def _directory(d: dict, where: str) -> DirectorySettings:
  known = {f.name for f in dataclasses.fields(DirectorySettings)}
  _check_keys(d, known, where)
  if not d.get("path"):
    raise UserError(f"{where} has no path")
  out = DirectorySettings(**{k: _tuples(v) for k, v in d.items()})
  for key in ("path", "mask_path"):
    p = getattr(out, key)
    if p is not None and not os.path.isdir(p):
      raise MediaError(f"{where}: {key} {p!r} does not exist or is not a directory")
  return out


def _validate(s: DatasetSettings, where: str) -> DatasetSettings:
  if not s.directories:
    raise UserError(f"{where} lists no dataset directory")
  if s.video_clip_mode not in CLIP_MODES:
    raise UserError(f"{where}: video_clip_mode={s.video_clip_mode!r}; use one of {CLIP_MODES}")
  for d in map(s.resolve, s.directories):
    if not d.resolutions or any(not isinstance(r, int) or r <= 0 for r in d.resolutions):
      raise UserError(f"{where}: resolutions={d.resolutions} for {d.path!r}; need positive ints")
    if not isinstance(d.num_repeats, int) or d.num_repeats < 1:
      raise UserError(f"{where}: num_repeats={d.num_repeats} for {d.path!r}; need an int >= 1")
    directory_buckets(d, 1)  # AR range and frame bucket errors now, not at caching time
  return s


def _settings(top: dict, directories: list, where: str, dir_where: str) -> DatasetSettings:
  known = {f.name for f in dataclasses.fields(DatasetSettings)} - {"directories"}
  _check_keys(top, known, where)
  dirs = tuple(_directory(dict(d), f"{dir_where} #{i}") for i, d in enumerate(directories))
  s = DatasetSettings(directories=dirs, **{k: _tuples(v) for k, v in top.items()})
  return _validate(s, where)


def settings_from_toml(path: str) -> DatasetSettings:
  """A diffusion-pipe dataset.toml as is: top-level keys plus [[directory]] tables."""
  top = read_toml(path)
  directories = top.pop("directory", [])
  return _settings(top, directories, path, f"{path} [[directory]]")


def settings_from_dict(d: dict) -> DatasetSettings:
  """Our config.dataset as a dict: the same keys, `directories` (a list of directory dicts), and
  `path` as a shortcut for one directory with no overrides."""
  top = dict(d)
  path = top.pop("path", "")
  directories = ([{"path": path}] if path else []) + list(top.pop("directories", None) or [])
  return _settings(top, directories, "config.dataset", "config.dataset.directories")
