"""Read a budget-walk trace (one JSON object per line) back into its steps: each site tried, the validation
cross-entropy after it, kept or passed; and each refit of all the kept sites.

    python bench/walk_trace/walksteps.py bench/walk_trace/8c977a9.jsonl
"""

from __future__ import annotations

import json
import sys


def _next_not_swap(events: list[dict], k: int) -> int:
    while k < len(events) and "swap" in events[k]:
        k += 1
    return k


def steps(path: str) -> tuple[float, list[dict]]:
    """The first validation cross-entropy of the walk and its steps, in order."""
    with open(path) as f:
        events = [json.loads(line) for line in f]
    start = next(k for k, e in enumerate(events) if "costs" in e)
    costs, events = events[start]["costs"], events[start + 1 :]
    ce0 = next(e["ce"] for e in events if "ce" in e)
    out, k = [], 0
    while k < len(events):
        e = events[k]
        if "refit" in e:
            j = _next_not_swap(events, k + 1)
            if j < len(events) and "ce" in events[j]:
                m = _next_not_swap(events, j + 1)
                if m < len(events) and "refit_all" in events[m]:  # the last site refitted by a refit of all
                    k = m
                    continue
                name, after = e["refit"], events[j + 1] if j + 1 < len(events) else {}
                back = after.get("swap") == name and after.get("new") == "LlamaRMSNorm"  # put back: passed
                out.append({"site": name, "ce": events[j]["ce"], "kept": not back, "cost": costs.get(name)})
                k = j + 1
                continue
        if "refit_all" in e:
            out.append({"refit_all": e["refit_all"], "before": e["before"], "after": e["after"]})
        k += 1
    return ce0, out


def main() -> None:
    ce0, out = steps(sys.argv[1])
    kept = 0
    for s in out:
        if "site" in s:
            kept += s["kept"]
            what = "kept  " if s["kept"] else "passed"
            rise = s["ce"] - ce0
            print(f"{kept:3d} {what} {s['site']:45s} cost {s['cost']:+.4f} ce {s['ce']:.4f} (+{rise:.3f})")
        else:
            print(f"    refit all at {s['refit_all']}: {s['before']:.4f} -> {s['after']:.4f}")


if __name__ == "__main__":
    main()
