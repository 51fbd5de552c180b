"""How JAX and PyTorch share a GPU (`device_memory`): the fractions that keep both within
`max_device_memory_gib`. (On the CPU there is no pool to share: the full-size job on a GPU,
benchmarks/full_job.py --card 24, checks it; BENCHMARKS.md#full-job has its figures.)"""
import os

import pytest

from diffpipe_jax import device_memory

GIB = 2**30


def test_both_frameworks_stay_within_the_cap_in_each_phase():
  card, cap = 79.2 * GIB, 24 * GIB
  f = device_memory.fractions(cap, card)
  context = device_memory.CONTEXT_BYTES
  assert f["torch_caching"] * card + context == pytest.approx(cap)  # caching: no JAX array yet
  # training: PyTorch beside JAX's pool and both frameworks' contexts
  assert (f["jax"] + f["torch_training"]) * card + 2 * context == pytest.approx(cap)
  assert f["jax"] * card == pytest.approx(18 * GIB)  # JAX's usual 75%, as of a 24 GiB card


def test_no_cap_or_no_gpu_changes_nothing(monkeypatch):
  monkeypatch.delenv(device_memory.JAX_FRACTION_VARIABLE, raising=False)
  for cap in (0, 24):  # this machine has no GPU
    sharing = device_memory.Sharing(cap)
    sharing.training()
    assert sharing.fractions is None and device_memory.JAX_FRACTION_VARIABLE not in os.environ
