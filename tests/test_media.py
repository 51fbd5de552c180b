import logging
import math
import os
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from diffpipe_jax import buckets, media, tiny


def _image(path, w, h, colour=(200, 30, 30), seed=0):
  pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
  pixels[h // 4:3 * h // 4, w // 4:3 * w // 4] = colour
  Image.fromarray(pixels).save(path)
  return pixels


def write_grey_ramp_video(path, frames=24, fps=24, w=64, h=48):
  """Frame k is a flat grey of value 10k, so a decoded frame tells which source frame it was."""
  media.write_video(path, np.stack([np.full((h, w, 3), 10 * k, np.uint8) for k in range(frames)]),
                   fps)


def source_index(frames):
  return [int(round(f.mean() / 10)) for f in frames]


def test_ar_buckets_geometric():
  ars = buckets.ar_buckets(0.5, 2.0, 5)
  assert ars[0] == pytest.approx(0.5) and ars[-1] == pytest.approx(2.0)
  assert ars[2] == pytest.approx(1.0)
  assert np.allclose(np.diff(np.log(ars)), math.log(4) / 4)


def test_size_buckets_rounded_with_area_near_resolution():
  sizes = buckets.size_buckets([512, 1024], buckets.ar_buckets(0.5, 2.0, 7), 16)
  assert list(sizes) == [512, 1024]
  for res, group in sizes.items():
    assert len(group) == 7 and len(set(group)) == 7
    assert (res, res) in group
    ars = [w / h for w, h in group]
    assert ars == sorted(ars)
    for w, h in group:
      assert w % 16 == 0 and h % 16 == 0
      assert abs(w * h / res ** 2 - 1) < 0.05
  assert buckets.size_buckets([512], [1.0], 32) == {512: [(512, 512)]}


def test_frame_buckets_always_hold_one():
  assert buckets.frame_buckets([33, 17, 33]) == [1, 17, 33]
  assert buckets.frame_buckets([]) == [1]


def test_assign_nearest_ar_and_longest_frame_bucket():
  sizes = buckets.size_buckets([256, 512], buckets.ar_buckets(0.5, 2.0, 7), 16)
  frames = buckets.frame_buckets([17, 33])
  wide = buckets.assign(1920, 1080, 40, sizes, frames)
  assert [b.frames for b in wide] == [33, 33]
  for b, group in zip(wide, sizes.values()):
    best = min(abs(math.log(w / h) - math.log(16 / 9)) for w, h in group)
    assert abs(math.log(b.width / b.height) - math.log(16 / 9)) == best
    assert b.width > b.height
  assert buckets.assign(500, 1000, 1, sizes, frames)[1][:2] == (368, 720)
  assert [b.frames for b in buckets.assign(64, 64, 20, sizes, frames)] == [17, 17]
  assert buckets.assign(64, 64, 10, sizes, frames) == []  # a clip never becomes a still
  assert buckets.assign(64, 64, 1, sizes, frames)[0].frames == 1


def test_resize_and_crop_is_a_centre_crop():
  img = np.zeros((1, 100, 300, 3), np.uint8)
  img[:, :, 100:200] = 255  # the centre third is white
  out = buckets.resize_and_crop(img, 64, 64)
  assert out.shape == (1, 64, 64, 3) and out.dtype == np.uint8
  assert out[0, :, 4:60].min() > 240
  tall = buckets.resize_and_crop(np.repeat(img, 3, axis=0), 48, 32)
  assert tall.shape == (3, 32, 48, 3)
  # source columns 75..225 kept: white (100..200) lands on output columns 8..40
  assert tall[:, :, :6].max() < 15 and tall[:, :, 11:37].min() > 240 and tall[:, :, 43:].max() < 15


def test_scan_directory_skips_broken_and_warns(tmp_path, caplog):
  _image(tmp_path / "a.jpg", 64, 48)
  _image(tmp_path / "b.png", 32, 64)
  _image(tmp_path / "c.webp", 40, 40)
  (tmp_path / "broken.jpg").write_bytes(np.random.default_rng(0).bytes(500))
  (tmp_path / "notes.md").write_text("not media")
  for stem in ("a", "c", "broken"):
    (tmp_path / f"{stem}.txt").write_text(f"  {stem} caption\n")
  with caplog.at_level(logging.WARNING):
    items = media.scan_directory(str(tmp_path), caption_prefix="style, ")
  assert [os.path.basename(i.path) for i in items] == ["a.jpg", "b.png", "c.webp"]
  assert [i.caption for i in items] == ["style, a caption", "style, ", "style, c caption"]
  assert [(i.width, i.height, i.kind, i.num_frames) for i in items] == [
      (64, 48, "image", 1), (32, 64, "image", 1), (40, 40, "image", 1)]
  assert "broken.jpg" in caplog.text and "b.png" in caplog.text
  assert media.read_frames(items[1]).shape == (1, 64, 32, 3)
  with pytest.raises(media.MediaError, match="broken.jpg"):
    media.scan_directory(str(tmp_path), on_error="raise")


def test_scan_directory_errors_name_the_path(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(media.MediaError, match="no images or videos.*empty"):
    media.scan_directory(str(tmp_path / "empty"))
  with pytest.raises(media.MediaError, match="missing"):
    media.scan_directory(str(tmp_path / "missing"))


def test_scan_finds_masks(tmp_path, caplog):
  (tmp_path / "masks").mkdir()
  _image(tmp_path / "a.png", 16, 16)
  _image(tmp_path / "b.png", 16, 16)
  _image(tmp_path / "masks" / "a.png", 16, 16)
  with caplog.at_level(logging.WARNING):
    items = media.scan_directory(str(tmp_path), mask_path=str(tmp_path / "masks"))
  assert items[0].mask_path.endswith(os.path.join("masks", "a.png")) and items[1].mask_path is None
  assert "no mask" in caplog.text and "b.png" in caplog.text


def test_video_resampled_and_clipped(tmp_path):
  write_grey_ramp_video(tmp_path / "clip.mp4")
  (item,) = media.scan_directory(str(tmp_path))
  assert (item.kind, item.width, item.height) == ("video", 64, 48)
  assert (item.num_frames, item.fps) == (24, 24)
  assert media.frames_at_fps(item, 12) == 12 and media.frames_at_fps(item) == 24
  every = media.read_frames(item)
  assert every.shape == (24, 48, 64, 3) and source_index(every) == list(range(24))
  half = media.read_frames(item, fps=12)
  assert half.shape[0] == 12 and source_index(half) == list(range(0, 24, 2))
  begin = media.read_frames(item, fps=12, max_frames=4)
  middle = media.read_frames(item, fps=12, max_frames=4,
                             start=media.clip_starts(media.frames_at_fps(item, 12), 4, "single_middle")[0])
  assert source_index(begin) == [0, 2, 4, 6] and source_index(middle) == [8, 10, 12, 14]
  assert buckets.assign(item.width, item.height, media.frames_at_fps(item, 12),
                        {64: [(64, 48)]}, [1, 9])[0].frames == 9


def test_tiny_video_set_decodes_as_written_and_deterministically(tmp_path):
  """The embedded video set: both containers, its sizes, frame counts and rates, the moving
  pattern (lossy, so close), and the same bytes every time (the cache keys files by content)."""
  folder = tiny.write_video_dataset(str(tmp_path / "a"))
  items = media.scan_directory(folder)
  videos = [i for i in items if i.kind == "video"]
  assert [(os.path.splitext(i.path)[1][1:], i.width, i.height, i.num_frames, i.fps)
          for i in videos] == list(tiny.VIDEO_CLIPS)
  assert [(i.width, i.height) for i in items if i.kind == "image"] == list(tiny.VIDEO_SET_IMAGES)
  assert videos[0].caption == "a red pattern drifting, clip 0"
  for n, item in enumerate(videos):
    frames = media.read_frames(item)
    want = np.stack([tiny.pattern(n, item.width, item.height, t) for t in range(item.num_frames)])
    assert np.abs(frames.astype(float) - want).mean() < 4, item.path
  again = tiny.write_video_dataset(str(tmp_path / "b"))
  assert all(media.content_hash(os.path.join(folder, name)) ==
             media.content_hash(os.path.join(again, name)) for name in os.listdir(folder))


@pytest.mark.parametrize("total,length,mode,starts", [
    (12, 5, "single_beginning", [0]), (12, 5, "single_middle", [3]),
    (12, 5, "multiple_overlapping", [0, 4, 7]), (10, 5, "multiple_overlapping", [0, 5]),
    (4, 5, "multiple_overlapping", [0]), (1, 1, "multiple_overlapping", [0])])
def test_clip_starts(total, length, mode, starts):
  assert media.clip_starts(total, length, mode) == starts


def test_fingerprint_tracks_content(tmp_path):
  a, b = tmp_path / "a.png", tmp_path / "b.png"
  for path in (a, b):  # uncompressed: an edit keeps the file size
    Image.fromarray(_image(path, 32, 32)).save(path, compress_level=0)
  before = media.scan_directory(str(tmp_path))
  fingerprints = [i.fingerprint() for i in before]
  st = os.stat(a)
  pixels = np.asarray(Image.open(a)).copy()
  pixels[0, 0] ^= 1
  Image.fromarray(pixels).save(a, compress_level=0)
  os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # same name, size and mtime: only pixels differ
  after = media.scan_directory(str(tmp_path))
  assert after == before  # the scan alone cannot tell
  assert [i.fingerprint() for i in after] != fingerprints
  assert after[1].fingerprint() == fingerprints[1]
  (tmp_path / "b.txt").write_text("new caption")
  assert media.scan_directory(str(tmp_path))[1].fingerprint() != fingerprints[1]


def _png16(path, pixels):
  """A 16-bit PNG written by hand (PIL writes no 16-bit colour): uint16 [H, W] grey or [H, W, 3]."""
  h, w = pixels.shape[:2]
  colour = 2 if pixels.ndim == 3 else 0
  rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in pixels)
  chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data +
                              struct.pack(">I", zlib.crc32(kind + data)))
  header = struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, 0)
  path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                   + chunk(b"IEND", b""))


def test_16_bit_images_keep_their_levels(tmp_path):
  ramp = np.linspace(0, 65535, 6).astype(np.uint16)  # black, four greys, white
  Image.fromarray(np.tile(ramp, (4, 1))).save(tmp_path / "grey.png")
  assert Image.open(tmp_path / "grey.png").mode.startswith("I;16")
  _png16(tmp_path / "colour.png", np.full((4, 6, 3), [32768, 16384, 65535], np.uint16))
  colour, grey = map(media.read_frames, media.scan_directory(str(tmp_path)))  # by name
  assert colour.shape == (1, 4, 6, 3) and (colour == [128, 64, 255]).all()
  assert grey.shape == (1, 4, 6, 3) and grey.dtype == np.uint8
  np.testing.assert_array_equal(grey[0, 0, :, 0], [0, 51, 102, 153, 204, 255])
  assert (grey == grey[..., :1]).all()
  # mode I: how older Pillows open 16-bit greyscale PNGs
  assert (media._rgb(Image.fromarray(np.full((2, 2), 32768, np.int32))) == 128).all()


def test_shuffle_tags():
  caption = " red hair,  blue   eyes ,smile,,outdoors "
  shuffled = media.shuffle_tags(caption, random.Random(0))
  assert sorted(shuffled.split(", ")) == ["blue eyes", "outdoors", "red hair", "smile"]
  orders = {media.shuffle_tags(caption, np.random.default_rng(s)) for s in range(20)}
  assert len(orders) > 1


def test_settings_from_toml(tmp_path):
  for d in ("one", "two", "two_masks"):
    (tmp_path / d).mkdir()
  toml = tmp_path / "dataset.toml"
  toml.write_text(f"""
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 7
frame_buckets = [1, 33, 65]

[[directory]]
path = '{tmp_path / "one"}'
num_repeats = 10

[[directory]]
path = '{tmp_path / "two"}'
mask_path = '{tmp_path / "two_masks"}'
resolutions = [256, 512]
min_ar = 1.0
caption_prefix = "ohwx, "
""")
  s = media.settings_from_toml(str(toml))
  assert s.resolutions == (512,) and s.frame_buckets == (1, 33, 65) and len(s.directories) == 2
  one, two = map(s.resolve, s.directories)
  assert (one.num_repeats, one.resolutions, one.caption_prefix) == (10, (512,), "")
  assert (two.num_repeats, two.resolutions, two.min_ar, two.max_ar) == (1, (256, 512), 1.0, 2.0)
  assert two.mask_path == str(tmp_path / "two_masks") and two.caption_prefix == "ohwx, "
  sizes, frames = media.directory_buckets(two, 16)
  assert list(sizes) == [256, 512] and all(w >= h for w, h in sizes[512]) and frames == [1, 33, 65]

  toml.write_text(toml.read_text().replace("num_ar_buckets = 7", "num_ar_bucket = 7"))
  with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_ar_bucket'\].*num_ar_buckets"):
    media.settings_from_toml(str(toml))


def test_settings_from_dict(tmp_path):
  s = media.settings_from_dict(dict(path=str(tmp_path), resolutions=[256], enable_ar_bucket=False,
                                    ar_buckets=[[768, 512], 1.0]))
  (d,) = map(s.resolve, s.directories)
  assert media.directory_buckets(d, 16)[0] == {256: [(256, 256)]}
  explicit = media.DatasetSettings(directories=s.directories, ar_buckets=((3, 2), 1.0))
  sizes, _ = media.directory_buckets(explicit.resolve(explicit.directories[0]), 16)
  assert sizes == {512: [(512, 512), (624, 416)]}
  with pytest.raises(media.MediaError, match="nowhere"):
    media.settings_from_dict(dict(directories=[dict(path=str(tmp_path / "nowhere"))]))
  with pytest.raises(ValueError, match="bogus"):
    media.settings_from_dict(dict(directories=[dict(path=str(tmp_path), bogus=1)]))
  with pytest.raises(ValueError, match="no dataset directory"):
    media.settings_from_dict(dict(path=""))
