"""Reconstruct a budget walk from its trace: each step's site, the validation CE after it, kept or passed; and the
refits of all kept sites."""
import json, sys

def steps(path):
    ev = [json.loads(l) for l in open(path)]
    i = next(k for k, e in enumerate(ev) if "costs" in e)
    costs = ev[i]["costs"]
    ev = [e for e in ev[i + 1:]]
    out, k = [], 0
    ce0 = next(e["ce"] for e in ev if "ce" in e)
    while k < len(ev):
        e = ev[k]
        if "refit" in e:
            name = e["refit"]
            j = k + 1
            while j < len(ev) and "swap" in ev[j]:
                j += 1
            if j < len(ev) and "ce" in ev[j]:
                m = j + 1
                while m < len(ev) and "swap" in ev[m]:
                    m += 1
                if m < len(ev) and "refit_all" in ev[m]:
                    k = m
                    continue
                back = j + 1 < len(ev) and ev[j + 1].get("swap") == name and ev[j + 1].get("new") == "LlamaRMSNorm"
                out.append({"site": name, "ce": ev[j]["ce"], "kept": not back, "cost": costs.get(name), "t": ev[j]["t"]})
                k = j + 1
                continue
        if "refit_all" in e:
            out.append({"refit_all": e["refit_all"], "before": e["before"], "after": e["after"], "t": e["t"]})
        k += 1
    return ce0, out

if __name__ == "__main__":
    ce0, out = steps(sys.argv[1])
    kept = 0
    for s in out:
        if "site" in s:
            kept += s["kept"]
            print(f"{kept:3d} {'kept  ' if s['kept'] else 'passed'} {s['site']:45s} cost {s['cost']:+.4f} ce {s['ce']:.4f} (+{s['ce'] - ce0:.3f})")
        else:
            print(f"    refit all at {s['refit_all']}: {s['before']:.4f} -> {s['after']:.4f}")
