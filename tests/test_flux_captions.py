"""Captions longer than Flux's text encoders read are cut (as FluxPipeline cuts them): said once
per cache with their count, not silent and not once per batch."""
import logging

import numpy as np
import pytest

from conftest import load_encoders
from diffpipe_jax import cache


@pytest.fixture(scope="module")
def encoders(tiny_pipelines):
  """The tiny T5 reads 16 tokens here."""
  enc = load_encoders("flux", tiny_pipelines("flux"), max_sequence_length=16)
  yield enc
  enc.release()


def build(path, captions, encoders):
  black = lambda: np.zeros((1, 32, 32, 3), np.float32)
  items = [dict(key=str(i), caption=c, bucket=(32, 32, 1), load_pixels=black)
           for i, c in enumerate(captions)]
  return cache.build_cache(str(path), items, encoders, batch_size=2)


def test_truncated_captions_are_said_once_per_cache_with_their_count(encoders, caplog, tmp_path):
  fits = "abcdefghijklmn"  # the tiny T5 is character level: a word mark, 14 letters, </s>
  assert len(encoders.t5_tokenizer(fits).input_ids) == 16
  long = "a cat " * 20  # 120 bytes: past CLIP's 77 as well
  captions = ["a cat", fits, fits + "o", "", fits + "op", long]  # cut in three batches of 2
  with caplog.at_level(logging.WARNING):
    build(tmp_path / "cache", captions, encoders)
  assert [r.getMessage() for r in caplog.records] == [
      f"{tmp_path / 'cache'}: 3 of 5 captions are longer than T5's 16 tokens (max_sequence_length) "
      "and were truncated: their end is not trained on (first: \"abcdefghijklmno\")",
      f"{tmp_path / 'cache'}: 1 of 5 captions are longer than CLIP's 77 tokens and were truncated "
      f"for CLIP, as FluxPipeline truncates them; T5 reads up to 16 (first: \"{long[:60]}...\")"]
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    build(tmp_path / "other", ["a cat", fits], encoders)  # the tally starts again
  assert caplog.records == []
