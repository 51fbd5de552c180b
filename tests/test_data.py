"""Datasets end to end: scan -> buckets -> cache -> bucketed, seeded, resumable batches."""
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from diffpipe_jax import cache, data, media, tiny
from diffpipe_jax.models import flux

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("pipe") / "flux")
  tiny.save_flux_pipeline(root)
  return root


@pytest.fixture(scope="module")
def encoders(pipeline):
  return cache.FluxEncoders.load(pipeline, max_sequence_length=16)


def cached(folder, encoders, **settings):
  s = media.settings_from_dict(dict(path=str(folder), resolutions=(32,), **settings))
  return data.cache_dataset(s, "flux", encoders, encoders.pixel_multiple, batch_size=4)


def test_batches_are_bucketed_seeded_and_resumable(tmp_path, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)
  batches = data.Batches(dirs, 2, seed=0, position_ids=flux.position_ids)
  assert sorted(n for _, n in dirs[0].cache.buckets()) == [4, 4, 4]  # three aspect buckets
  assert batches.steps_per_epoch == 6
  epoch0, epoch1 = batches.epoch(0), batches.epoch(1)
  assert epoch0 != epoch1 and epoch0 == data.Batches(dirs, 2, 0, flux.position_ids).epoch(0)
  full = list(batches.iterate(0))
  for b in full:  # one bucket a batch: one latent shape, and matching position ids
    assert b["latents"].shape[0] == 2 and b["img_ids"].shape[:2] == b["latents"].shape[:2]
  resumed = list(batches.iterate(0, start=4))
  assert len(resumed) == 2
  for a, b in zip(full[4:], resumed):
    np.testing.assert_array_equal(a["latents"], b["latents"])
  halves = [batches.load(epoch0[0], p, 2) for p in (0, 1)]  # per-process shares of one batch
  np.testing.assert_array_equal(np.concatenate([h["latents"] for h in halves]), full[0]["latents"])


def test_empty_buckets_are_a_clear_error(tmp_path, encoders):
  dirs = cached(tiny.write_image_dataset(str(tmp_path / "img")), encoders)
  with pytest.raises(ValueError, match=r"no bucket holds a full global batch of 8.*32x32x1: 4"):
    data.Batches(dirs, 8, seed=0, position_ids=flux.position_ids)


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


def test_cached_latents_equal_a_direct_vae_encode(tmp_path, encoders, pipeline):
  import torch
  from diffusers import AutoencoderKL, FluxPipeline
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=1, sizes=((40, 40),))
  (d,) = cached(folder, encoders)
  (bucket, _), = d.cache.buckets()
  vae = AutoencoderKL.from_pretrained(os.path.join(pipeline, "vae")).eval()
  (item,) = media.scan_directory(folder)
  frames = data.cache_items(media.DirectorySettings(path=folder, resolutions=(32,), enable_ar_bucket=True,
                                                    min_ar=0.5, max_ar=2.0, num_ar_buckets=7,
                                                    frame_buckets=(1,)), [item], 4)[0]["load_pixels"]()
  with torch.no_grad():
    z = vae.encode(torch.from_numpy(frames[0]).permute(2, 0, 1)[None]).latent_dist.mean
  z = (z - vae.config.shift_factor) * vae.config.scaling_factor
  packed = FluxPipeline._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]).numpy()[0]
  np.testing.assert_allclose(d.cache.get(bucket, 0)["latents"], packed, rtol=1e-4, atol=1e-5)


def test_cache_only_with_a_diffusion_pipe_toml(tmp_path):
  images = tiny.write_image_dataset(str(tmp_path / "images"))
  toml = tmp_path / "dataset.toml"
  toml.write_text(f'resolutions = [32]\nenable_ar_bucket = true\n\n[[directory]]\npath = "{images}"\n'
                  'num_repeats = 2\n')
  out = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "--config",
                        os.path.join(ROOT, "configs", "flux.py") + ":tiny", "--cache_only",
                        f"--config.dataset.toml_path={toml}", f"--config.output_dir={tmp_path}/out"],
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp_path, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  assert out.returncode == 0, out.stdout
  assert "cached; exiting" in out.stdout
  assert os.path.isfile(os.path.join(images, "cache", "flux", "manifest.json"))
  assert not os.path.exists(tmp_path / "out")  # caching alone starts no run


def test_settings_we_cannot_honour_are_errors(tmp_path):
  folder = tiny.write_image_dataset(str(tmp_path / "img"), num_images=1)
  with pytest.raises(ValueError, match="shuffle_tags"):
    data.dataset_settings(dict(path=folder, shuffle_tags=True))
  with pytest.raises(ValueError, match="mask_path .* is not supported yet"):
    data.dataset_settings(dict(directories=[dict(path=folder, mask_path=folder)]))
