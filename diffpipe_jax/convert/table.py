"""The reversible mapping between our Flax parameters and PyTorch checkpoint keys.

Two layers, each usable in both directions (loading, and exporting LoRAs or tiny test files):

1. Flax <-> diffusers is a naming rule. Module names mirror diffusers, so the path
   `transformer_blocks/attn/to_q/kernel` of a stacked block is the diffusers key
   `transformer_blocks.{i}.attn.to_q.weight` for layer i, with the kernel transposed (torch Linear
   weights are (out, in)). `bias` and norm `weight` carry over as they are.
2. diffusers <-> an original single-file layout (BFL Flux, ...) is a table of `Row`s: one
   single-file module holds one or more diffusers modules stacked along the output rows (fused
   qkv, `linear1`), optionally with its two halves swapped.
"""
import dataclasses
import re
from typing import Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from diffpipe_jax.convert.tensorfile import CheckpointError

# ------------------------------------------------------------------------------------------------
# Flax <-> diffusers names.
# ------------------------------------------------------------------------------------------------


def diffusers_key(path: Sequence[str], layer=None) -> str:
  """Flax param path (a tuple of names) -> diffusers key; `layer` indexes a stacked block."""
  *module, leaf = path
  if layer is not None:
    module = [module[0], str(layer), *module[1:]]
  return ".".join([*module, "weight" if leaf == "kernel" else leaf])


def matches(name: str, patterns: Sequence[str]) -> bool:
  """Policies (LoRA targets, float8 storage) are full-match regexes over dotted module names."""
  return any(re.fullmatch(p, name) for p in patterns)


def is_stacked(path, stacked) -> bool:
  return path[0] in stacked


def torch_shapes(abstract: Mapping, stacked: Sequence[str]) -> Dict[str, Tuple[int, ...]]:
  """diffusers key -> torch shape for every tensor of an abstract (eval_shape) parameter tree."""
  out = {}
  for path, leaf in flatten(abstract).items():
    shape = tuple(leaf.shape)
    layers = [None]
    if is_stacked(path, stacked):
      layers, shape = range(shape[0]), shape[1:]
    for i in layers:
      out[diffusers_key(path, i)] = shape[::-1] if path[-1] == "kernel" else shape
  return out


def flatten(tree: Mapping, prefix=()) -> Dict[Tuple[str, ...], object]:
  """Nested dict -> {path tuple: leaf}."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def largest_first(flat: Mapping[Tuple[str, ...], object]) -> List[Tuple[Tuple[str, ...], object]]:
  """(path, leaf) pairs, the largest leaves first: loading or creating weights in this order,
  a leaf's temporary copies (bfloat16 before float8, torch layout before transposing) come while
  little else is on the device, and the peak stays near what the model finally takes."""
  return sorted(flat.items(), key=lambda item: -item[1].size * item[1].dtype.itemsize)


def unflatten(flat: Mapping[Tuple[str, ...], object]) -> dict:
  out = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


# ------------------------------------------------------------------------------------------------
# diffusers <-> single-file layouts.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
  """One single-file module holding the diffusers `parts`, concatenated along the output rows.

  `{i}` in the names stands for the block index; "" is the model itself (its own parameters,
  such as LTX-Video's `scale_shift_table`). `params` maps diffusers parameter names to the
  single file's (norms: "weight" -> "scale"). `swap_halves`: the single file stores the two
  halves of the rows in the other order.
  """
  single: str
  parts: Tuple[str, ...]
  swap_halves: bool = False
  params: Tuple[Tuple[str, str], ...] = (("weight", "weight"), ("bias", "bias"))


def _expand(rows: Sequence[Row], diffusers_keys) -> List[Tuple[str, Tuple[str, ...], bool]]:
  """Concrete (single key, diffusers keys, swap) triples for the keys present on the diffusers side."""
  out = []
  join = lambda module, param: f"{module}.{param}" if module else param
  for row in rows:
    module = re.escape(row.parts[0]).replace(r"\{i\}", r"(\d+)")
    pattern = re.compile((module + r"\." if module else "") + r"(\w+)$")
    for key in diffusers_keys:
      m = pattern.match(key)
      if not m:
        continue
      i, param = (m.group(1), m.group(2)) if "{i}" in row.parts[0] else (None, m.group(1))
      single_param = dict(row.params).get(param)
      if single_param is None:
        continue
      fmt = lambda name: name.format(i=i) if i is not None else name
      out.append((join(fmt(row.single), single_param),
                  tuple(join(fmt(p), param) for p in row.parts), row.swap_halves))
  return out


def single_file_sources(rows: Sequence[Row], shapes: Mapping[str, Tuple[int, ...]]):
  """diffusers key -> (single-file key, list of (start, stop) row ranges to concatenate).

  `shapes` are the torch shapes the model expects (see `torch_shapes`): they give each part's
  row count, so no model size is written down anywhere.
  """
  sources = {}
  for single, parts, swap in _expand(rows, shapes):
    start = 0
    for part in parts:
      n = shapes[part][0]
      sources[part] = (single, [(start, start + n)])
      start += n
    if swap:
      (part,) = parts
      half = start // 2
      sources[part] = (single, [(half, start), (0, half)])
  return sources


def to_single_file(tensors: Mapping[str, np.ndarray], rows: Sequence[Row]) -> Dict[str, np.ndarray]:
  """diffusers-named torch-layout tensors -> the single-file layout (the inverse of loading)."""
  out, used = {}, set()
  for single, parts, swap in _expand(rows, tensors):
    value = np.concatenate([tensors[p] for p in parts], axis=0)
    if swap:
      half = value.shape[0] // 2
      value = np.concatenate([value[half:], value[:half]], axis=0)
    out[single] = value
    used.update(parts)
  unmapped = sorted(set(tensors) - used)
  if unmapped:
    raise ValueError(f"no single-file row for: {unmapped[:10]}")
  return out


# ------------------------------------------------------------------------------------------------
# Loading a checkpoint into a parameter tree.
# ------------------------------------------------------------------------------------------------


def sources(abstract: Mapping, stacked: Sequence[str], files, rows: Sequence[Row] = None):
  """For every Flax leaf and layer: the checkpoint key and row ranges to read.

  Checks the whole checkpoint against the model before anything is read, and raises one
  `CheckpointError` listing every missing, unexpected and mis-shaped tensor.
  """
  expected = torch_shapes(abstract, stacked)
  if rows is None:
    found = {k: (k, None) for k in expected}
    want_shape = dict(expected)
  else:
    found = single_file_sources(rows, expected)
    want_shape = {}  # a fused tensor: the parts' rows stacked, the parts' other dims
    for key, (single, ranges) in found.items():
      rows_so_far = want_shape.get(single, (0,))[0]
      want_shape[single] = (max([rows_so_far] + [b for _, b in ranges]),) + expected[key][1:]
  unmapped = sorted(set(expected) - set(found))
  missing = sorted(k for k in want_shape if k not in files)
  unexpected = sorted(set(files.keys()) - set(want_shape))
  misshaped = sorted(f"{k}: file {files.shape(k)}, model {want_shape[k]}"
                     for k in want_shape if k in files and files.shape(k) != want_shape[k])
  if unmapped or missing or unexpected or misshaped:
    lines = [f"{name} ({len(v)}): {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}"
             for name, v in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", misshaped), ("not in the conversion table", unmapped))
             if v]
    raise CheckpointError("the checkpoint does not match the model:\n  " + "\n  ".join(lines))
  return found


def read_tensor(files, source) -> np.ndarray:
  """One diffusers tensor (torch layout) from its planned source."""
  key, ranges = source
  value = files[key]
  if ranges is None:
    return value
  return np.concatenate([value[a:b] for a, b in ranges], axis=0)


def load_leaves(abstract: Mapping, stacked: Sequence[str], files, sources, dtype, put):
  """Yields (path, array) for every leaf, largest first: its layers are copied from the
  memory-mapped files into one preallocated host buffer of the target dtype, in torch layout
  (contiguous copies), which `put(path, buffer)` places (e.g. on a mesh) before the next leaf is
  read; kernels are then transposed on the device. Host memory holds one leaf at a time beside
  the file's page cache; the device, one leaf's torch-layout copy beside what is loaded."""
  for path, leaf in largest_first(flatten(abstract)):
    torch_shape = leaf.shape[:-2] + leaf.shape[:-3:-1] if path[-1] == "kernel" else leaf.shape
    buf = np.empty(torch_shape, dtype)
    for i in range(leaf.shape[0]) if is_stacked(path, stacked) else [None]:
      buf[... if i is None else i] = read_tensor(files, sources[diffusers_key(path, i)])
    value = put(path, buf)
    del buf
    if path[-1] == "kernel":
      value = _swap_last_axes(value)  # the torch-layout copy is freed, not kept beside it
    yield path, value
    del value  # before the next leaf is placed


@jax.jit
def _swap_last_axes(x):
  return jnp.swapaxes(x, -1, -2)
