"""Datasets end to end: scan -> buckets -> cache -> bucketed, seeded, resumable batches."""
import glob
import os
import re
import types

import numpy as np
import pytest
from PIL import Image

import test_media
from conftest import FAMILIES, family_config, load_encoders
from diffpipe_jax import data, family as family_lib, media, tiny, train
from diffpipe_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  return family_lib.get(request.param)


@pytest.fixture(scope="module")
def encoders(family, tiny_pipelines):
  return load_encoders(family.type, tiny_pipelines(family.type))


# What cache_items asks of a family's encoders: an image model's, and a video model's that takes
# clips of 1 + 4k frames at 12 frames per second.
IMAGE_ENCODERS = types.SimpleNamespace(pixel_multiple=16, frame_rate=None, frames_per_latent=None)
VIDEO_ENCODERS = types.SimpleNamespace(pixel_multiple=16, frame_rate=12, frames_per_latent=4)


def resolution(encoders):
  """32 pixels, or the smallest side that gives the tiny image set's three aspect buckets (a
  square and two wider) where the model's pixel multiple is larger (LTX-Video's 32)."""
  return max(32, 2 * encoders.pixel_multiple)


def cached(folder, encoders, **settings):
  s = media.settings_from_dict(dict(path=str(folder), resolutions=(resolution(encoders),), **settings))
  return data.cache_dataset(s, "test", encoders, batch_size=4)


def test_batches_are_bucketed_seeded_and_resumable(tmp_path, family, encoders, capsys):
  folder = tiny.write_image_dataset(str(tmp_path / "img"))
  dirs = cached(folder, encoders)
  # what each bucket got, said once
  assert re.findall(rf"dataset {folder}: items per bucket \(width x height x frames\): (.*)",
                    capsys.readouterr().out) == [", ".join(f"{w}x{h}x1: 4" for (w, h, _), _ in
                                                            sorted(dirs[0].cache.buckets()))]
  batches = data.Batches(dirs, 2, seed=0, position_ids=family.position_ids)
  assert sorted(n for _, n in dirs[0].cache.buckets()) == [4, 4, 4]  # three aspect buckets
  assert batches.steps_per_epoch == 6
  epoch0, epoch1 = batches.epoch(0), batches.epoch(1)
  assert epoch0 != epoch1 and epoch0 == data.Batches(dirs, 2, 0, family.position_ids).epoch(0)
  full = list(batches.iterate(0))
  ids = () if family.position_ids is None else ("position_ids",)  # for models of packed latents
  for b in full:  # one bucket a batch: one latent shape, and matching position ids
    assert b["latents"].shape[0] == 2
    assert not ids or b["position_ids"].shape[:2] == b["latents"].shape[:2]
    assert set(b) == {*ids, *encoders.encode_text(["x"]), "latents"}  # every field
  resumed = list(batches.iterate(0, start=4))
  assert len(resumed) == 2
  for a, b in zip(full[4:], resumed):
    np.testing.assert_array_equal(a["latents"], b["latents"])
  halves = [batches.load(epoch0[0], p, 2) for p in (0, 1)]  # per-process shares of one batch
  np.testing.assert_array_equal(np.concatenate([h["latents"] for h in halves]), full[0]["latents"])


def test_empty_buckets_are_a_clear_error(tmp_path, family, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)
  side = resolution(encoders)
  with pytest.raises(ValueError, match=rf"no bucket holds a full global batch.*{side}x{side}x1: 4 \(batch 8\)"):
    data.Batches(dirs, 8, seed=0, position_ids=family.position_ids)


def test_batches_per_resolution_and_for_images_as_diffusion_pipe_sizes_them():
  size = data.micro_batch_sizes(((512, 4), (1024, 1)))
  assert [size((512, 512, 1)), size((704, 368, 1)), size((1024, 1024, 33)), size((1216, 832, 1))] == [4, 4, 1, 1]
  assert data.micro_batch_sizes(2, image_micro_batch_size_per_gpu=8)((64, 64, 1)) == 8
  assert data.micro_batch_sizes(2, image_micro_batch_size_per_gpu=8)((64, 64, 9)) == 2


def test_batch_size_per_bucket_counts_steps_and_examples(tmp_path, family, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)  # 3 buckets of 4
  widest = max(b for b, _ in dirs[0].cache.buckets())
  batches = data.Batches(dirs, lambda b: 4 if b == widest else 2, seed=0, position_ids=family.position_ids)
  assert batches.steps_per_epoch == 1 + 2 + 2 and batches.examples_per_epoch == 12
  for (bucket, rows), loaded in zip(batches.epoch(0), batches.iterate(0)):
    assert len(rows) == loaded["latents"].shape[0] == (4 if bucket == widest else 2)
  sizes = [len(rows) for _, rows in batches.epoch(1)]
  assert [batches.examples_seen(s) for s in (0, 2, 5, 7)] == [0, *np.cumsum(
      [len(rows) for _, rows in batches.epoch(0)])[[1, 4]], 12 + sum(sizes[:2])]


def test_uncond_fraction_trains_that_share_on_the_empty_caption(tmp_path, family, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)
  empty = dirs[0].cache.empty_text(dirs[0].cache.buckets()[0][0])  # images only: every bucket's
  batches = lambda p: data.Batches(dirs, 4, 0, family.position_ids, uncond_fraction=p)
  plain, half, resumed = (list(batches(0.0).iterate(0)), list(batches(0.5).iterate(0)),
                          list(batches(0.5).iterate(0, start=1)))
  dropped = 0
  for a, b in zip(plain, half):
    np.testing.assert_array_equal(a["latents"], b["latents"])
    for i in range(4):
      same_as_empty = all(np.array_equal(b[k][i], v) for k, v in empty.items())
      assert same_as_empty or all(np.array_equal(b[k][i], a[k][i]) for k in empty)
      dropped += same_as_empty and not all(np.array_equal(a[k][i], v) for k, v in empty.items())
  assert 2 <= dropped <= 10  # of 12, drawn with p = 0.5
  for a, b in zip(half[1:], resumed):  # the draw is the batch's: a resumed run makes the same
    np.testing.assert_array_equal(a[next(iter(empty))], b[next(iter(empty))])


def test_edited_image_is_the_only_one_recached(tmp_path, encoders, monkeypatch):
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=6)
  cached(folder, encoders)
  path = os.path.join(folder, "002.png")
  pixels = np.array(Image.open(path))
  pixels[0, 0] = 255 - pixels[0, 0]  # same name, same size, other pixels
  stat = os.stat(path)
  Image.fromarray(pixels).save(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
  calls = []
  original = encoders.encode_media
  monkeypatch.setattr(encoders, "encode_media", lambda px: calls.append(len(px)) or original(px))
  (d,) = cached(folder, encoders)
  assert sum(calls) == 1
  assert len(d.cache) == 6


@pytest.mark.parametrize("name", FAMILIES)
def test_cache_only_with_a_diffusion_pipe_toml(tmp_path, monkeypatch, capsys, name):
  images = tiny.write_image_dataset(str(tmp_path / "images"))
  toml = tmp_path / "dataset.toml"
  toml.write_text(f'resolutions = [32]\nenable_ar_bucket = true\n\n[[directory]]\npath = "{images}"\n'
                  'num_repeats = 2\n')
  monkeypatch.chdir(tmp_path)  # the tiny model's default paths
  config = family_config(name)
  config.update_from_flattened_dict({"dataset.toml_path": str(toml), "dataset.path": "",
                                     "output_dir": f"{tmp_path}/out"})
  assert train.run(config, cache_only=True) is None
  assert "cached; exiting" in capsys.readouterr().out
  assert os.path.isfile(os.path.join(images, "cache", name, "manifest.json"))
  # caching alone starts no run (it caches the sample prompts too, in out/.sample_prompts/)
  assert not glob.glob(str(tmp_path / "out" / "*"))
  assert len(glob.glob(str(tmp_path / "out" / ".sample_prompts" / "*.npz"))) == 1


def test_tiny_images_are_warned_about_once_per_directory(tmp_path):
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=4)
  Image.new("RGB", (1, 1), "red").save(os.path.join(folder, "dot.png"))
  Image.new("RGB", (16, 16), "red").save(os.path.join(folder, "small.png"))  # exactly 2x: fine
  s = media.settings_from_dict(dict(path=folder, resolutions=(32,)))
  ((directory, items),) = media.scan_dataset(s)
  entries, warnings = data.cache_items(directory, items, IMAGE_ENCODERS)
  assert len(entries) == 6
  assert warnings == [f"dataset {folder}: 1 of 6 files are upscaled more than 2x to fit their "
                      "bucket (dot.png 1x1 -> 32x32); they will look blurry"]
  assert data.cache_items(directory, [i for i in items if "dot" not in i.path], IMAGE_ENCODERS)[1] == []


@pytest.mark.parametrize("mode,starts", [("single_beginning", [0]), ("single_middle", [1]),
                                         ("multiple_overlapping", [0, 3])])
def test_video_clips_at_the_model_frame_rate(tmp_path, mode, starts):
  """A 24-frame 24 fps video is 12 frames at the model's 12 fps: one 9-frame clip from its
  beginning or middle, or two overlapping clips that cover every frame; each its own entry."""
  test_media.write_grey_ramp_video(tmp_path / "clip.mp4", frames=24, fps=24)
  s = media.settings_from_dict(dict(path=str(tmp_path), resolutions=(32,), frame_buckets=(1, 5, 9)))
  ((directory, items),) = media.scan_dataset(s)
  entries, _ = data.cache_items(directory, items, VIDEO_ENCODERS, mode)
  assert [e["key"].split("|")[1] for e in entries] == [f"48x32x9@{k}/12fps" for k in starts]
  for entry, start in zip(entries, starts):
    frames = (entry["load_pixels"]() + 1) * 127.5
    assert test_media.source_index(frames) == list(range(2 * start, 2 * start + 18, 2))


def test_frame_buckets_the_model_cannot_encode_are_errors(tmp_path):
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=1)
  s = media.settings_from_dict(dict(path=folder, resolutions=(32,), frame_buckets=(1, 6, 9)))
  ((directory, items),) = media.scan_dataset(s)
  with pytest.raises(UserError, match=r"^frame_buckets=\[1, 6, 9\] for .*: \[6\] cannot be encoded; "
                                      r"frame counts must be 1 or 1 \+ a multiple of 4"):
    data.cache_items(directory, items, VIDEO_ENCODERS)


def short_clip_and_images(folder):
  """Two images and a 24-frame 24 fps clip: 12 frames at the video model's 12 fps."""
  tiny.write_image_dataset(folder, num_images=2, sizes=((32, 32),))
  test_media.write_grey_ramp_video(os.path.join(folder, "clip.mp4"), frames=24, fps=24)
  return folder


def test_an_image_model_skips_the_videos_of_diffusion_pipes_example_dataset(tmp_path):
  """Its frame_buckets = [1, 33] and a folder of images and videos: the images train, the
  videos are skipped, as diffusion-pipe skips them for an image model, in one line."""
  folder = short_clip_and_images(str(tmp_path / "media"))
  s = media.settings_from_dict(dict(path=folder, resolutions=(32,), frame_buckets=(1, 33)))
  ((directory, items),) = media.scan_dataset(s)
  entries, warnings = data.cache_items(directory, items, IMAGE_ENCODERS)
  assert [e["key"].split("|")[:2] for e in entries] == [["000.png", "32x32x1"], ["001.png", "32x32x1"]]
  assert warnings == [f"dataset {folder}: 1 of 3 files skipped, videos, and this model takes "
                      "images only: clip.mp4"]


def test_videos_shorter_than_every_frame_bucket_are_named_and_each_bucket_counted(tmp_path):
  folder = short_clip_and_images(str(tmp_path / "media"))
  s = media.settings_from_dict(dict(path=folder, resolutions=(32,), frame_buckets=(1, 17)))
  ((directory, items),) = media.scan_dataset(s)
  entries, warnings = data.cache_items(directory, items, VIDEO_ENCODERS)
  assert warnings == [f"dataset {folder}: 1 of 3 files skipped, videos shorter than the smallest "
                      "frame bucket of videos (17 frames at 12 fps): clip.mp4 (12 frames)"]
  assert data.bucket_counts(folder, entries) == (
      f"dataset {folder}: items per bucket (width x height x frames): 32x32x1: 2")
  s = media.settings_from_dict(dict(path=folder, resolutions=(32,)))  # no frame bucket of videos
  ((directory, items),) = media.scan_dataset(s)
  assert data.cache_items(directory, items, VIDEO_ENCODERS)[1] == [
      f"dataset {folder}: 1 of 3 files skipped, videos, and frame_buckets=[1] has no frame count "
      "for them: clip.mp4"]


def test_a_dataset_where_no_file_fits_a_bucket_is_an_error_that_says_why(tmp_path):
  folder = str(tmp_path / "clips")
  os.makedirs(folder)
  test_media.write_grey_ramp_video(os.path.join(folder, "clip.mp4"), frames=24, fps=24)
  s = media.settings_from_dict(dict(path=folder, resolutions=(32,), frame_buckets=(1, 17)))
  with pytest.raises(UserError, match=re.escape(
      f"no file of the dataset fits a bucket: dataset {folder}: 1 of 1 files skipped, videos "
      "shorter than the smallest frame bucket of videos (17 frames at 12 fps): clip.mp4 (12 frames)")):
    data.cache_dataset(s, "test", VIDEO_ENCODERS, batch_size=1)
  assert not os.path.exists(os.path.join(folder, "cache"))


def test_settings_we_cannot_honour_are_errors(tmp_path):
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=1)
  with pytest.raises(ValueError, match="shuffle_tags"):
    data.dataset_settings(dict(path=folder, shuffle_tags=True))
  with pytest.raises(ValueError, match="mask_path .* is not supported yet"):
    data.dataset_settings(dict(directories=[dict(path=folder, mask_path=folder)]))
