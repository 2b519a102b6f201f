"""Which GPU kernels run side by side in a profiled step, by where they were launched.

`memory.profile_step: N` (or `tools/bench_memory.py --profile`) writes the step's trace as
profile_step<N>.trace.json.gz. Its breakdown sums kernel time per row; when kernels of several streams overlap, those
sums exceed the wall time and cannot say what stretched. This reads the trace and, per row (the innermost
`longdpo:` label around the launch: forward:attention, recompute:mlp, ...), reports the kernel time, how much of it
ran while a kernel of another stream was running, and the rows (and streams) of those other kernels.

    python tools/analyze_trace.py profiles/layer-liger-chunked8-head-offload_65536.trace.json.gz [--out overlap.md]

Kernels are charged as the step's breakdown charges them (the same reading of the trace,
longdpo/training/profiling.py): backward kernels to the autograd node that launched them (backward:attention,
backward:matmul, ... by the node's name) unless a label sits inside it (a checkpoint's recompute); device<->host copies
are their own row (`offload copies`), so the table shows how much of them ran beside compute.

`--kernels ROW` lists instead which kernels make up one row (backward:other, say): per kernel name (and, in backward
rows, the autograd node that launched it), its total ms and how many times it ran, largest first.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from longdpo.training.profiling import load_trace as load
from longdpo.training.profiling import trace_kernels as kernels


def overlaps(ks: list[dict]) -> dict:
    """Per row: kernel ms, ms of it during which another stream's kernel ran (the union over those kernels), and
    pairwise overlap ms with each other (row, stream)."""
    rows = defaultdict(lambda: {"kernel_ms": 0.0, "overlapped_ms": 0.0, "with": defaultdict(float)})
    ks = sorted(ks, key=lambda k: k["start"])
    covered: list[list[tuple]] = [[] for _ in ks]
    active: list[int] = []  # kernels still running at the current start: about one per stream
    for i, k in enumerate(ks):
        active = [j for j in active if ks[j]["end"] > k["start"]]
        for j in active:
            a = ks[j]
            if a["stream"] == k["stream"]:
                continue
            lo, hi = k["start"], min(k["end"], a["end"])
            covered[i].append((lo, hi))
            covered[j].append((lo, hi))
            rows[k["row"]]["with"][(a["row"], a["stream"])] += (hi - lo) / 1e3
            rows[a["row"]]["with"][(k["row"], k["stream"])] += (hi - lo) / 1e3
        active.append(i)
    for k, spans in zip(ks, covered):
        rows[k["row"]]["kernel_ms"] += (k["end"] - k["start"]) / 1e3
        rows[k["row"]]["overlapped_ms"] += _union(spans) / 1e3
    return rows


def _union(intervals: list[tuple]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def render(rows: dict, top: int = 3) -> str:
    lines = [
        "| row | kernel ms | overlapped by other streams (ms) | overlapping most (row @ stream: ms) |",
        "|---|---|---|---|",
    ]
    for row, r in sorted(rows.items(), key=lambda kv: -kv[1]["kernel_ms"]):
        partners = sorted(r["with"].items(), key=lambda kv: -kv[1])[:top]
        named = ", ".join(f"{p} @ {s}: {ms:.0f}" for (p, s), ms in partners) or "-"
        lines.append(f"| {row} | {r['kernel_ms']:.1f} | {r['overlapped_ms']:.1f} | {named} |")
    return "\n".join(lines) + "\n"


def row_kernels(ks: list[dict], row: str, top: int = 20) -> str:
    """The kernels launched under `row`, per name (after the autograd node that launched it, in backward rows): total ms
    and count, largest first (kernel names cut to 100 characters)."""
    by_name = defaultdict(lambda: [0.0, 0])
    for k in ks:
        if k["row"] == row:
            name = f"{k['node']}: {k['name'][:100]}" if k["node"] else k["name"][:100]
            by_name[name][0] += (k["end"] - k["start"]) / 1e3
            by_name[name][1] += 1
    lines = [f"| kernel under {row} | ms | launches |", "|---|---|---|"]
    for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name}` | {ms:.1f} | {n} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a profile_step<N>.trace.json.gz written by longdpo/training/profiling.py")
    p.add_argument("--out", help="also write the table here")
    p.add_argument("--kernels", metavar="ROW", help="list the kernels of this row instead (e.g. backward:other)")
    args = p.parse_args(argv)
    try:
        ks = kernels(load(args.trace))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {args.trace} is not a readable torch.profiler trace ({e}).")
    if not ks:
        sys.exit(f"error: {args.trace} holds no GPU kernels (a CPU-only run): nothing runs side by side.")
    rows = overlaps(ks)
    if args.kernels and args.kernels not in rows:
        sys.exit(f"error: no kernels under {args.kernels!r}; the rows of this trace: {', '.join(sorted(rows))}.")
    table = row_kernels(ks, args.kernels) if args.kernels else render(rows)
    print(table, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return rows


if __name__ == "__main__":
    main()
