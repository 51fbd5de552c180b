"""The reversible mapping between our Flax parameters and PyTorch checkpoint keys.

Two layers, each usable in both directions (loading, and exporting LoRAs or tiny test files):

1. Flax <-> our export names is a naming rule. Module names mirror a family's export format
   (diffusers' for Flux and LTX-Video, Tencent's for HunyuanVideo), so the path
   `transformer_blocks/attn.to_q/kernel` of a stacked block is the key
   `transformer_blocks.{i}.attn.to_q.weight` for layer i, with the kernel transposed (torch
   Linear weights are (out, in): torch order). `bias` and norm `weight` carry over as they are.
2. Our names <-> another format's (BFL's Flux file, a diffusers HunyuanVideo folder) is a table
   of `Row`s: one fused module holds several others stacked along the output rows (qkv,
   `linear1`), optionally with its two halves swapped; either side may be the checkpoint's.
"""
import dataclasses
import re
from typing import Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
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
  a leaf's temporary copies (bfloat16 before float8, torch order before transposing) come while
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
# Our names <-> other formats'.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
  """One module `single` holding the `parts`, concatenated along the output rows: a single
  file's fused module and the diffusers modules it holds (Flux), or our fused module and the
  diffusers ones (HunyuanVideo).

  `{i}` in the names stands for the block index; "" is the model itself (its own parameters,
  such as LTX-Video's `scale_shift_table`). `params` maps the parts' parameter names to the
  single module's (BFL's norms: "weight" -> "scale"). `swap_halves`: the single module stores
  the two halves of the rows in the other order.
  """
  single: str
  parts: Tuple[str, ...]
  swap_halves: bool = False
  params: Tuple[Tuple[str, str], ...] = (("weight", "weight"), ("bias", "bias"))


def _expand(rows: Sequence[Row], keys, by: str) -> List[Tuple[str, Tuple[str, ...], bool]]:
  """Concrete (fused key, part keys, swap) triples for the `keys` present on one side of the
  rows: `by="parts"` matches the parts' names, `by="single"` the fused module's."""
  out = []
  join = lambda module, param: f"{module}.{param}" if module else param
  for row in rows:
    name = row.parts[0] if by == "parts" else row.single
    params = dict(row.params if by == "parts" else (p[::-1] for p in row.params))
    module = re.escape(name).replace(r"\{i\}", r"(\d+)")
    pattern = re.compile((module + r"\." if module else "") + r"(\w+)$")
    for key in keys:
      m = pattern.match(key)
      if not m:
        continue
      i, param = (m.group(1), m.group(2)) if "{i}" in name else (None, m.group(1))
      if param not in params:
        continue
      parts_param, single_param = (param, params[param]) if by == "parts" else (params[param], param)
      fmt = lambda name: name.format(i=i) if i is not None else name
      out.append((join(fmt(row.single), single_param),
                  tuple(join(fmt(p), parts_param) for p in row.parts), row.swap_halves))
  return out


def row_sources(rows: Sequence[Row], shapes: Mapping[str, Tuple[int, ...]], checkpoint: str):
  """Our key -> the checkpoint's pieces [(key, (start, stop) or None: all rows)] that,
  concatenated along the rows, make it. `checkpoint` says which side of the rows the checkpoint
  names: "single" (it holds the fused modules, ours are their row ranges: BFL's qkv for Flux's
  to_q/k/v) or "parts" (ours are fused, each its parts joined: HunyuanVideo's img_attn_qkv from
  diffusers' to_q/k/v). `shapes` are the torch shapes of our keys (see `torch_shapes`): they
  give each part's row count, so no model size is written down anywhere."""
  sources = {}
  for single, parts, swap in _expand(rows, shapes, "parts" if checkpoint == "single" else "single"):
    if checkpoint == "single":
      start = 0
      for part in parts:
        n = shapes[part][0]
        sources[part] = [(single, (start, start + n))]
        start += n
      ours, source, rows_total = parts[0], single, start
    else:
      sources[single] = [(part, None) for part in parts]
      ours, source, rows_total = single, parts[0], shapes[single][0]
    if swap:
      half = rows_total // 2
      sources[ours] = [(source, (half, rows_total)), (source, (0, half))]
  return sources


def single_file_parts(keys, rows: Sequence[Row]) -> Dict[str, Tuple[Tuple[str, ...], bool]]:
  """Keys named by the rows' parts -> {fused key: (its part keys, halves swapped)}: the names
  `to_single_file` gives, worked out from the names alone (so a full-size file can be planned
  from shapes, without its tensors). Every key must be some row's part."""
  out, used = {}, set()
  for single, parts, swap in _expand(rows, keys, "parts"):
    out[single] = (parts, swap)
    used.update(parts)
  unmapped = sorted(set(keys) - used)
  if unmapped:
    raise ValueError(f"no single-file row for: {unmapped[:10]}")
  return out


def part_names(keys, rows: Sequence[Row]) -> Dict[str, Tuple[str, ...]]:
  """Keys named by the rows' fused modules -> {key: its part keys}: `single_file_parts` from the
  other side, by names alone; keys no row names are left out."""
  return {single: parts for single, parts, _ in _expand(rows, keys, "single")}


def to_single_file(tensors: Mapping[str, np.ndarray], rows: Sequence[Row]) -> Dict[str, np.ndarray]:
  """Tensors named by the rows' parts (torch order) -> named by their fused modules (diffusers
  -> BFL for Flux, diffusers -> Tencent for HunyuanVideo): the inverse of `row_sources`."""
  out = {}
  for single, (parts, swap) in single_file_parts(tensors, rows).items():
    value = np.concatenate([tensors[p] for p in parts], axis=0)
    if swap:
      half = value.shape[0] // 2
      value = np.concatenate([value[half:], value[:half]], axis=0)
    out[single] = value
  return out


# ------------------------------------------------------------------------------------------------
# Loading a checkpoint into a parameter tree.
# ------------------------------------------------------------------------------------------------


def as_linear(shape) -> Tuple[int, ...]:
  """A torch weight's shape as a Linear's: a convolution whose window is its stride (a patch
  embedding, (out, in, t, h, w)) is a Linear over the flattened patch, (out, in * t * h * w)."""
  return tuple(shape) if len(shape) <= 2 else (shape[0], int(np.prod(shape[1:])))


def sources(abstract: Mapping, stacked: Sequence[str], files, rows: Sequence[Row] = None,
            checkpoint: str = "single"):
  """For every Flax leaf and layer: the checkpoint pieces to read (see `row_sources`; without
  rows the checkpoint's names are ours).

  Checks the whole checkpoint against the model before anything is read, and raises one
  `CheckpointError` listing every missing, unexpected and mis-shaped tensor.
  """
  expected = torch_shapes(abstract, stacked)
  if rows is None:
    found = {k: [(k, None)] for k in expected}
  else:
    found = row_sources(rows, expected, checkpoint)
  unmapped = sorted(set(expected) - set(found))
  wanted = {key for pieces in found.values() for key, _ in pieces}
  missing = sorted(k for k in wanted if k not in files)
  unexpected = sorted(set(files.keys()) - wanted)
  misshaped = []
  for key, pieces in sorted(found.items()):
    if key in expected and all(k in files for k, _ in pieces):
      got = _assembled_shape(files, pieces)
      want = expected[key]
      if got is None or not (got == want or (len(want) == 2 and as_linear(got) == want)):
        names = "+".join(dict.fromkeys(k for k, _ in pieces))
        misshaped.append(f"{names}: file {got or tuple(files.shape(pieces[0][0]))}, "
                         f"model {want}")
  if unmapped or missing or unexpected or misshaped:
    lines = [f"{name} ({len(v)}): {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}"
             for name, v in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", sorted(set(misshaped))),
                             ("not in the conversion table", unmapped))
             if v]
    raise CheckpointError("the checkpoint does not match the model:\n  " + "\n  ".join(lines))
  return found


def _assembled_shape(files, pieces):
  """The shape the pieces make, concatenated along the rows; None if they do not fit."""
  rows, rest = 0, None
  for key, span in pieces:
    shape = tuple(files.shape(key))
    if span is not None:
      if span[1] > shape[0]:
        return None
      shape = (span[1] - span[0],) + shape[1:]
    if rest is not None and shape[1:] != rest:
      return None
    rows, rest = rows + shape[0], shape[1:]
  return (rows,) + rest


def read_tensor(files, pieces) -> np.ndarray:
  """One of our tensors (torch order) from its planned pieces."""
  values = [files[key] if span is None else files[key][span[0]:span[1]] for key, span in pieces]
  return values[0] if len(values) == 1 else np.concatenate(values, axis=0)


def load_leaves(abstract: Mapping, stacked: Sequence[str], files, sources, dtype, put,
                keeps_float8=lambda path: False):
  """Yields (path, array) for every leaf, largest first: its layers are copied from the
  memory-mapped files into one preallocated host buffer of the target dtype, in torch order
  (contiguous copies), which `put(path, buffer)` places (e.g. on a mesh) before the next leaf is
  read; kernels are then transposed on the device. Host memory holds one leaf at a time beside
  the file's page cache; the device, one leaf's torch-order copy beside what is loaded.
  A leaf whose checkpoint tensors are float8 stays float8 where `keeps_float8(path)` (a float8
  base from a float8 file: no high-precision copy on the way)."""
  for path, leaf in largest_first(flatten(abstract)):
    torch_shape = leaf.shape[:-2] + leaf.shape[:-3:-1] if path[-1] == "kernel" else leaf.shape
    layers = range(leaf.shape[0]) if is_stacked(path, stacked) else [None]
    leaf_sources = [sources[diffusers_key(path, i)] for i in layers]
    file_dtypes = {np.dtype(files[key].dtype) for pieces in leaf_sources for key, _ in pieces}
    float8 = file_dtypes == {np.dtype(ml_dtypes.float8_e4m3fn)} and keeps_float8(path)
    buf = np.empty(torch_shape, ml_dtypes.float8_e4m3fn if float8 else dtype)
    for i, pieces in zip(layers, leaf_sources):
      target = buf[... if i is None else i]
      target[...] = read_tensor(files, pieces).reshape(target.shape)
    value = put(path, buf)
    del buf
    if path[-1] == "kernel":
      value = _swap_last_axes(value)  # the torch-order copy is freed, not kept beside it
    yield path, value
    del value  # before the next leaf is placed


@jax.jit
def _swap_last_axes(x):
  return jnp.swapaxes(x, -1, -2)
