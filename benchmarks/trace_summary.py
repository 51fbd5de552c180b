"""Where a traced step's GPU time goes: one table from the trace `train_step.py --profile` writes.

  python benchmarks/trace_summary.py PROFILE_DIR [--top 25]

Sums the device's kernel and copy events by kind (cuBLAS/Triton matmuls, cuDNN attention, XLA
fusions, copies) and by name (numbered fusions grouped), and compares the time the GPU was busy
with the traced wall time: the gap is launch overhead and host work the GPU waited for. With
`--host N`, the N host events (JAX's and XLA's dispatch, Python) of the longest total time:
where that host work goes (events nest, so totals overlap).
"""
import argparse
import collections
import glob
import gzip
import json
import os
import re

KINDS = (("attention (cuDNN)", r"cudnn|fmha|sdpa|flash"),
         ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|triton_gemm|dot"),
         ("copy", r"memcpy|memset|copy"),
         ("reduction fusion", r"reduce|input_"),
         ("elementwise fusion", r"fusion|loop_|transpose|convert|broadcast"))


def kind(name):
  return next((k for k, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def device_events(trace, on_gpu=True):
  """The complete ('X') events on the GPU timelines of a chrome trace (or, `on_gpu` False, on
  the host's)."""
  gpu = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "M"
         and e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))}
  return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e.get("pid") in gpu) == on_gpu]


def by_name(events):
  """({name: total microseconds}, {name: count}), trailing numbers of names grouped as _N."""
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    name = re.sub(r"[._]?\d+$", "_N", e["name"])
    total[name] += e["dur"]
    count[name] += 1
  return total, count


def busy_time(events):
  """Microseconds covered by at least one event (overlapping streams counted once)."""
  total, end = 0.0, float("-inf")
  for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def main():
  p = argparse.ArgumentParser()
  p.add_argument("folder")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--show", default="", help="print the arguments of a few events of this name")
  p.add_argument("--host", type=int, default=0, help="also list this many host events")
  a = p.parse_args()
  for path in sorted(glob.glob(os.path.join(a.folder, "**", "*.trace.json.gz"), recursive=True)):
    with gzip.open(path) as f:
      trace = json.load(f)
    events = device_events(trace)
    if not events:
      print(f"{path}: no GPU events (was CUPTI available?)")
      continue
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    busy = busy_time(events)
    by_kind = collections.Counter()
    for e in events:
      by_kind[kind(e["name"])] += e["dur"]
    totals, count = by_name(events)
    print(f"\n{os.path.relpath(path, a.folder)}: GPU busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms "
          f"traced ({busy / span:.0%}); {len(events)} device events")
    print("| kind | ms | share of busy |\n|---|---|---|")
    for k, t in by_kind.most_common():
      print(f"| {k} | {t / 1e3:.1f} | {t / busy:.1%} |")
    print("| name | calls | ms | share |\n|---|---|---|---|")
    for name, t in totals.most_common(a.top):
      print(f"| {name[:90]} | {count[name]} | {t / 1e3:.1f} | {t / busy:.1%} |")
    if a.host:
      totals, count = by_name(device_events(trace, on_gpu=False))
      print("| host event | calls | ms | of traced |\n|---|---|---|---|")
      for name, t in totals.most_common(a.host):
        print(f"| {name[:90]} | {count[name]} | {t / 1e3:.1f} | {t / span:.1%} |")
    for e in [e for e in events if a.show and a.show in e["name"]][:3]:
      print(e["name"], e["dur"], e.get("args"))


if __name__ == "__main__":
  main()
