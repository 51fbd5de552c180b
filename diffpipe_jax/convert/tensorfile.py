"""Memory-mapped reading of safetensors checkpoints: single files, sharded folders with an index.

Tensors are numpy views into a read-only memory map, so taking a slice (one layer, the q rows of
a fused qkv) reads only those pages, and nothing is copied until the caller converts it. The
header is validated against the file size first: reading past the end of a truncated file
through a memory map would crash the process instead of raising.
"""
import functools
import json
import os
import struct
from typing import Dict, Iterable, Tuple

import ml_dtypes
import numpy as np

from diffpipe_jax.errors import UserError
from diffpipe_jax.files import atomic_write

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer "header" is another format
TORCH_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# What torch pickles keep their state dict under: Tencent's transformer file `module`, and
# `state_dict` the VAE files its loader takes
STATE_DICT_WRAPPERS = ("module", "state_dict")


class CheckpointError(UserError):
  """A checkpoint that cannot be used as given; the message says what is wrong and what to do."""


def read_header(path: str) -> Tuple[dict, int]:
  """Returns (tensor entries, byte offset of the data region), checking the file is complete."""
  return read_header_and_metadata(path)[:2]


def read_header_and_metadata(path: str) -> Tuple[dict, int, dict]:
  """`read_header` and the file's string metadata (Lightricks' files keep their config there)."""
  if not os.path.isfile(path):
    raise CheckpointError(f"checkpoint file not found: {path}")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
      raise CheckpointError(f"{path} is not a safetensors file (its first bytes are no "
                            "safetensors header)")
    if n > size - 8:
      raise CheckpointError(f"{path} is truncated: its header claims {n} bytes but the file "
                            f"holds {size}; copy or download it again")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path} is not a safetensors file (bad header: {e})") from None
  metadata = header.pop("__metadata__", None) or {}
  data_end = max((e["data_offsets"][1] for e in header.values()), default=0)
  if 8 + n + data_end > size:
    raise CheckpointError(
        f"{path} is truncated: its header describes {8 + n + data_end} bytes but the file holds "
        f"{size}; the copy or download was interrupted, fetch it again")
  for key, e in header.items():
    if e["dtype"] not in DTYPES:
      raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {e['dtype']}")
  return header, 8 + n, metadata


class TensorFiles:
  """A read-only mapping from tensor name to a memory-mapped numpy array, over one or more files.
  Keys that start with one of `skip` (another model's tensors in the same file) are left out;
  `metadata` holds the files' string metadata."""

  def __init__(self, paths: Iterable[str], strip_prefix: str = "", skip: Tuple[str, ...] = ()):
    self._entries: Dict[str, Tuple[str, dict, int]] = {}
    self._maps: Dict[str, np.memmap] = {}
    self.metadata: Dict[str, str] = {}
    for path in paths:
      header, offset, metadata = read_header_and_metadata(path)
      self.metadata.update(metadata)
      for key, entry in header.items():
        if key.startswith(skip):
          continue
        name = key[len(strip_prefix):] if strip_prefix and key.startswith(strip_prefix) else key
        self._entries[name] = (path, entry, offset)

  def keys(self):
    return self._entries.keys()

  def __contains__(self, key):
    return key in self._entries

  def shape(self, key) -> Tuple[int, ...]:
    return tuple(self._entries[key][1]["shape"])

  def shapes(self) -> Dict[str, Tuple[int, ...]]:
    return {k: self.shape(k) for k in self._entries}

  def __getitem__(self, key) -> np.ndarray:
    path, entry, offset = self._entries[key]
    if path not in self._maps:
      self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
    start, stop = entry["data_offsets"]
    raw = self._maps[path][offset + start:offset + stop]
    return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def torch_state_dict(path: str) -> dict:
  """The torch tensors of a torch pickle (a `STATE_DICT_WRAPPERS` wrapper taken off), read as
  torch loads it safely: `weights_only=True` (no code runs from the file) and memory-mapped
  (`mmap=True`: nothing is read until a tensor is used)."""
  import torch
  try:
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
  except (RuntimeError, EOFError, ValueError) as e:  # torch's own for a bad or truncated file
    raise CheckpointError(f"{path} is not a readable torch checkpoint ({_first_line(e)}); copy "
                          "or download it again, or give the .safetensors format") from None
  if isinstance(state, dict):
    state = next((state[w] for w in STATE_DICT_WRAPPERS if w in state), state)
  if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
    raise CheckpointError(f"{path} holds no state dict of tensors (at its top, or under "
                          f"{' or '.join(map(repr, STATE_DICT_WRAPPERS))})")
  return state


class TorchFiles:
  """`TensorFiles` over a torch pickle (Tencent's `mp_rank_00_model_states.pt`: the weights
  under `module`), read by `torch_state_dict`."""

  def __init__(self, path: str, strip_prefix: str = "", skip: Tuple[str, ...] = ()):
    state = torch_state_dict(path)
    self._tensors = {(k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v
                     for k, v in state.items() if not k.startswith(skip)}
    self.metadata: Dict[str, str] = {}

  def keys(self):
    return self._tensors.keys()

  def __contains__(self, key):
    return key in self._tensors

  def shape(self, key) -> Tuple[int, ...]:
    return tuple(self._tensors[key].shape)

  def shapes(self) -> Dict[str, Tuple[int, ...]]:
    return {k: self.shape(k) for k in self._tensors}

  def __getitem__(self, key) -> np.ndarray:
    value = self._tensors[key].detach()
    views, ints = _torch_views()
    if value.dtype in views:  # a dtype numpy lacks: viewed bit for bit
      return value.view(ints[value.element_size()]).numpy().view(views[value.dtype])
    return value.numpy()


def _first_line(error) -> str:
  return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@functools.lru_cache(maxsize=None)
def _torch_views():
  """torch dtypes numpy lacks -> their ml_dtypes, and the same-size ints to view them through."""
  import torch
  return ({torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
           torch.float8_e5m2: ml_dtypes.float8_e5m2},
          {1: torch.uint8, 2: torch.int16})


def open_tensor_file(path: str, strip_prefix: str = "", skip: Tuple[str, ...] = ()):
  """A single checkpoint file's tensors: safetensors, or a torch pickle (.pt, .pth, .bin)."""
  if path.endswith(TORCH_PICKLE_SUFFIXES):
    return TorchFiles(path, strip_prefix, skip)
  return TensorFiles([path], strip_prefix, skip)


def common_prefix(keys, candidates: Iterable[str]) -> str:
  """The first candidate prefix that every key carries ("" if none does)."""
  keys = list(keys)
  for p in candidates:
    if keys and all(k.startswith(p) for k in keys):
      return p
  return ""


def safetensors_in_folder(folder: str):
  """The weight files of a diffusers/transformers model folder: an index's shards or one file."""
  for index in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")):
    with open(os.path.join(folder, index)) as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
      raise CheckpointError(f"{folder}: the index {index} names shards that are missing: {missing}")
    return [os.path.join(folder, s) for s in shards]
  files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  if len(files) != 1:
    raise CheckpointError(f"{folder}: expected one .safetensors file or an index, found {files or 'none'}")
  return [os.path.join(folder, files[0])]


def write_safetensors(tensors: Dict[str, np.ndarray], path: str, metadata=None):
  """Writes a safetensors file crash-safely (see `files.atomic_write`). `np.require`, not
  `np.ascontiguousarray`, which turns a scalar (LTX's `timestep_scale_multiplier`) into shape [1]."""
  from safetensors.numpy import save
  data = save({k: np.require(v, requirements="C") for k, v in tensors.items()}, metadata=metadata)
  atomic_write(path, lambda f: f.write(data))
