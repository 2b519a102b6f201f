"""What holds the peak: replay a CUDA memory snapshot's allocation trace and group the allocations alive at the
peak by the code that made them.

    python tools/analyze_snapshot.py outputs/run/memory_snapshot_rank0.pickle [--top 15]

History recording starts at train begin, so the weights (allocated earlier) are not in the trace: the replayed
peak is the memory allocated *during training* (activations, gradients, gathered/temporary buffers).
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict

# Frames from these files say "where" in our terms (the model, TRL, DeepSpeed), not in torch's internals.
_INTERESTING = ("modeling_", "trl/", "deepspeed/", "longdpo/", "checkpoint.py", "trainer.py")


def _site(frames: list[dict]) -> str:
    for fr in frames:
        name = fr.get("filename", "")
        if any(key in name for key in _INTERESTING) and "torch/utils/_" not in name:
            return f"{name.split('site-packages/')[-1]}:{fr.get('line')} {fr.get('name')}"
    return "other (no model/TRL frame)"


def peak_holders(path: str, top: int = 15, device: int = 0) -> dict:
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in events:
        action, addr, size = ev.get("action"), ev.get("addr"), ev.get("size", 0)
        if action == "alloc":
            live[addr] = (size, _site(ev.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_completed",) and addr in live:
            total -= live.pop(addr)[0]
    by_site: dict[str, int] = defaultdict(int)
    for size, site in at_peak.values():
        by_site[site] += size
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    # Single blocks tell what a frameless holder is (e.g. vocab x hidden = an LM-head/embedding gradient).
    largest = sorted(at_peak.values(), key=lambda v: -v[0])[:top]
    return {
        "peak_during_training_gb": round(peak / 1e9, 3),
        "events": len(events),
        "top_holders": [{"gb": round(b / 1e9, 3), "site": s} for s, b in ranked],
        "largest_blocks": [{"bytes": b, "site": s} for b, s in largest],
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    print(json.dumps(peak_holders(a.snapshot, a.top), indent=1))
