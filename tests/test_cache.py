"""The latent and text-embedding cache, with every family's encoders (`conftest.FAMILIES`):
only new or changed items are encoded, an interrupted run resumes, a complete cache never loads
the encoders. Each family's test file checks its encoders' output against its diffusers pipeline."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import FAMILIES, load_encoders
from tolerances import assert_close
from diffpipe_jax import cache
from diffpipe_jax.errors import UserError

BUCKETS = [(32, 32, 1), (64, 32, 1)]  # (width, height, frames): sides every family takes


@pytest.fixture(scope="module", params=FAMILIES)
def family_pipeline(request, tiny_pipelines):
  return request.param, tiny_pipelines(request.param)


@pytest.fixture(scope="module")
def encoders(family_pipeline):
  enc = load_encoders(*family_pipeline)
  yield enc
  enc.release()


@pytest.fixture
def counted(encoders, monkeypatch):
  """The encoders, counting the media items they encode."""
  calls = []
  original = encoders.encode_media
  monkeypatch.setattr(encoders, "encode_media", lambda px: calls.append(len(px)) or original(px))
  monkeypatch.setattr(encoders, "encoded", lambda: sum(calls), raising=False)
  return encoders


def pixels(seed, bucket):
  width, height, frames = bucket
  rng = np.random.default_rng(seed)
  return rng.uniform(-1, 1, (frames, height, width, 3)).astype(np.float32)


def make_items(n, version=None, fail_after=None):
  """n items over the buckets; `version` overrides some keys (an edited file); loading raises
  once `fail_after` items were loaded (an interrupted run)."""
  loaded = []
  def item(i):
    bucket = BUCKETS[i % len(BUCKETS)]
    def load():
      if fail_after is not None and len(loaded) >= fail_after:
        raise RuntimeError("interrupted")
      loaded.append(i)
      return pixels((i, (version or {}).get(i, 0)), bucket)
    key = f"img{i}.png:{(version or {}).get(i, 0)}"
    return dict(key=key, caption=f"a photo of thing {i}", bucket=bucket, load_pixels=load)
  return [item(i) for i in range(n)]


def test_only_changed_items_reencoded(counted, tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("cache")
  cache.build_cache(str(tmp_path), make_items(6), counted, batch_size=4)
  assert counted.encoded() == 6
  c = cache.build_cache(str(tmp_path), make_items(6, version={3: 1}), counted, batch_size=4)
  assert counted.encoded() == 7 and len(c) == 6
  bucket = BUCKETS[1]
  assert "img3.png:1" in c.keys(bucket) and "img3.png:0" not in c.keys(bucket)
  got = c.get(bucket, c.keys(bucket).index("img3.png:1"))
  fresh = cache.build_cache(str(tmp_path_factory.mktemp("fresh")), make_items(6, version={3: 1}), counted, 4)
  want = fresh.get(bucket, fresh.keys(bucket).index("img3.png:1"))["latents"]
  assert_close(got["latents"], want)  # batching reorders sums

  # img3 edited back (its old rows were deleted with the stale shard) and img5 removed
  c = cache.build_cache(str(tmp_path), make_items(5), counted, batch_size=4)
  assert counted.encoded() == 13 + 1 and len(c) == 5
  # only the manifest and one shard (a .npy per field and a .json) per live bucket remain
  assert sorted(os.listdir(tmp_path)) == ["32x32x1", "64x32x1", "empty", "manifest.json"]
  assert all(len(os.listdir(tmp_path / b)) == len(got) + 1 for b in ("32x32x1", "64x32x1"))


def test_interrupted_run_resumes(counted, tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("cache")
  with pytest.raises(RuntimeError, match="interrupted"):
    cache.build_cache(str(tmp_path), make_items(8, fail_after=5), counted, batch_size=2)
  assert counted.encoded() == 4  # two finished batches, the third failed while loading
  assert not os.path.exists(tmp_path / cache.MANIFEST)  # nothing readable was half-written
  c = cache.build_cache(str(tmp_path), make_items(8), counted, batch_size=2)
  assert counted.encoded() == 8 and len(c) == 8
  ref = cache.build_cache(str(tmp_path_factory.mktemp("ref")), make_items(8), counted, batch_size=3)
  for bucket, n in c.buckets():
    assert c.keys(bucket) == ref.keys(bucket)
    for i in range(n):
      for k, v in c.get(bucket, i).items():
        assert_close(v, ref.get(bucket, i)[k], what=f"{bucket} {i} {k}")


def test_regenerate_rebuilds_all(counted, tmp_path):
  cache.build_cache(str(tmp_path), make_items(4), counted, batch_size=4)
  c = cache.build_cache(str(tmp_path), make_items(4), counted, batch_size=4, regenerate=True)
  assert counted.encoded() == 8 and len(c) == 4
  empty = counted.encode_text([""])
  assert {k: v.shape for k, v in c.empty_text(BUCKETS[0]).items()} == {k: v.shape[1:] for k, v in empty.items()}


def test_a_cache_of_the_previous_format_gains_its_empty_captions(counted, tmp_path):
  """A cache written when the empty caption was encoded once (for images, named by the manifest
  alone) gets one per frame count on its next build, without re-encoding its media."""
  items = make_items(4)
  cache.build_cache(str(tmp_path), items, counted, batch_size=4)
  with open(tmp_path / cache.MANIFEST) as f:
    manifest = json.load(f)
  shutil.rmtree(tmp_path / cache.EMPTY)
  old = cache.write_shard(str(tmp_path / cache.EMPTY), counted.encode_text([""]), dict(
      fingerprints=[cache.fingerprint(counted.identity(), dict(key="", caption="", bucket=()))],
      keys=[""], bucket=[], grid=[]))
  for b in manifest["buckets"].values():
    del b["empty"]
  cache.write_json(str(tmp_path / cache.MANIFEST), dict(manifest, version=1, empty=old))
  c = cache.build_cache(str(tmp_path), items, counted, batch_size=4)
  assert counted.encoded() == 4 and len(c) == 4
  assert not any(f.startswith(old) for f in os.listdir(tmp_path / cache.EMPTY))  # collected
  for field, value in counted.encode_text([""]).items():
    np.testing.assert_array_equal(c.empty_text(BUCKETS[1])[field], value[0])


def test_a_complete_cache_never_loads_the_encoders(family_pipeline, encoders, tmp_path):
  items = make_items(3)
  cache.build_cache(str(tmp_path), items, encoders, batch_size=2)
  fresh = load_encoders(*family_pipeline)
  assert fresh.identity() == encoders.identity() and fresh.pixel_multiple == encoders.pixel_multiple
  c = cache.build_cache(str(tmp_path), items, fresh, batch_size=2)
  assert len(c) == 3
  assert not any(attr in vars(fresh) for attr, _ in fresh.components.values())  # nothing loaded


def test_a_folder_without_encoders_is_a_clear_error(family_pipeline, tmp_path):
  name, pipeline = family_pipeline
  os.symlink(os.path.join(pipeline, "transformer"), tmp_path / "transformer")  # the model alone
  with pytest.raises(UserError, match=f"{tmp_path} lacks the encoder folder"):
    load_encoders(name, str(tmp_path))


def test_encoders_load_inside_the_cache_bar_without_bars_of_their_own(family_pipeline, tmp_path,
                                                                       capsys):
  """The first use loads the encoders under the open "caching" bar: the libraries' own loading
  bars would nest in it, writing cursor-up escape codes into the log."""
  cache.build_cache(str(tmp_path), make_items(2), load_encoders(*family_pipeline), batch_size=2)
  said = capsys.readouterr()
  assert "loading the VAE" in said.out + said.err and "caching" in said.err
  assert "\x1b[" not in said.out + said.err


def test_the_vae_and_the_text_encoders_are_never_loaded_together(family_pipeline, encoders,
                                                                tmp_path, monkeypatch):
  """Caching encodes the media with the VAE alone, frees it, then the captions with the text
  encoders alone (on a 24 GB GPU HunyuanVideo's LLaMA leaves no room for the VAE's work); a
  run stopped in the text pass keeps its latents: the next one encodes no media again, and the
  cache equals one built in a single run."""
  fresh = load_encoders(*family_pipeline)
  vae_loaded, load_text_encoders = [], fresh.load_text_encoders
  monkeypatch.setattr(fresh, "load_text_encoders",
                      lambda: vae_loaded.append("vae" in vars(fresh)) or load_text_encoders())
  encode_text, media_calls = fresh.encode_text, []
  monkeypatch.setattr(fresh, "encode_text", lambda *a, **k: (_ for _ in ()).throw(
      RuntimeError("interrupted")))
  monkeypatch.setattr(fresh, "encode_media", lambda px, f=fresh.encode_media: media_calls.append(len(px)) or f(px))
  items = make_items(5)
  with pytest.raises(RuntimeError, match="interrupted"):
    cache.build_cache(str(tmp_path / "c"), items, fresh, batch_size=2)
  assert sum(media_calls) == 5 and "vae" not in vars(fresh)
  monkeypatch.setattr(fresh, "encode_text", encode_text)
  c = cache.build_cache(str(tmp_path / "c"), items, fresh, batch_size=2)
  assert sum(media_calls) == 5 and vae_loaded == [False]
  ref = cache.build_cache(str(tmp_path / "ref"), items, encoders, batch_size=2)
  for bucket, n in ref.buckets():
    assert c.keys(bucket) == ref.keys(bucket)
    assert_close(c.get(bucket, np.arange(n)), ref.get(bucket, np.arange(n)), what=str(bucket))
