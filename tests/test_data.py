"""Datasets end to end: scan -> buckets -> cache -> bucketed, seeded, resumable batches."""
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import FAMILIES, load_encoders
from diffpipe_jax import data, family as family_lib, media, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  return family_lib.get(request.param)


@pytest.fixture(scope="module")
def encoders(family, tiny_pipelines):
  return load_encoders(family.type, tiny_pipelines(family.type))


def cached(folder, encoders, **settings):
  s = media.settings_from_dict(dict(path=str(folder), resolutions=(32,), **settings))
  return data.cache_dataset(s, "test", encoders, batch_size=4)


def test_batches_are_bucketed_seeded_and_resumable(tmp_path, family, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)
  batches = data.Batches(dirs, 2, seed=0, position_ids=family.position_ids)
  assert sorted(n for _, n in dirs[0].cache.buckets()) == [4, 4, 4]  # three aspect buckets
  assert batches.steps_per_epoch == 6
  epoch0, epoch1 = batches.epoch(0), batches.epoch(1)
  assert epoch0 != epoch1 and epoch0 == data.Batches(dirs, 2, 0, family.position_ids).epoch(0)
  full = list(batches.iterate(0))
  for b in full:  # one bucket a batch: one latent shape, and matching position ids
    assert b["latents"].shape[0] == 2 and b["position_ids"].shape[:2] == b["latents"].shape[:2]
    assert set(b) == {"position_ids", *encoders.encode_text(["x"]), "latents"}  # every field
  resumed = list(batches.iterate(0, start=4))
  assert len(resumed) == 2
  for a, b in zip(full[4:], resumed):
    np.testing.assert_array_equal(a["latents"], b["latents"])
  halves = [batches.load(epoch0[0], p, 2) for p in (0, 1)]  # per-process shares of one batch
  np.testing.assert_array_equal(np.concatenate([h["latents"] for h in halves]), full[0]["latents"])


def test_empty_buckets_are_a_clear_error(tmp_path, family, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)
  with pytest.raises(ValueError, match=r"no bucket holds a full global batch of 8.*32x32x1: 4"):
    data.Batches(dirs, 8, seed=0, position_ids=family.position_ids)


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
def test_cache_only_with_a_diffusion_pipe_toml(tmp_path, name):
  images = tiny.write_image_dataset(str(tmp_path / "images"))
  toml = tmp_path / "dataset.toml"
  toml.write_text(f'resolutions = [32]\nenable_ar_bucket = true\n\n[[directory]]\npath = "{images}"\n'
                  'num_repeats = 2\n')
  out = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "--config",
                        os.path.join(ROOT, "configs", name.replace("-", "_") + ".py") + ":tiny", "--cache_only",
                        f"--config.dataset.toml_path={toml}", f"--config.output_dir={tmp_path}/out"],
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp_path, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  assert out.returncode == 0, out.stdout
  assert "cached; exiting" in out.stdout
  assert os.path.isfile(os.path.join(images, "cache", name, "manifest.json"))
  assert not os.path.exists(tmp_path / "out")  # caching alone starts no run


def test_settings_we_cannot_honour_are_errors(tmp_path):
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=1)
  with pytest.raises(ValueError, match="shuffle_tags"):
    data.dataset_settings(dict(path=folder, shuffle_tags=True))
  with pytest.raises(ValueError, match="mask_path .* is not supported yet"):
    data.dataset_settings(dict(directories=[dict(path=folder, mask_path=folder)]))
