"""Reading a sweep root: the runs of one experiment grouped by name, with their values over seeds.

Losses at different scales and vocabularies are not comparable in absolute terms (the dissection's attractor is
7.54 nats over GPT-2 tokens; ours is the byte-level unigram entropy, ~3.33), so each loss is also placed on
the scale from RMSNorm (0) to the attractor (1):

    frac = (loss - loss_RMSNorm) / (unigram_entropy - loss_RMSNorm)

and the paper's numbers are placed on the same scale with its own RMSNorm (3.21) and attractor (7.54).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from normlab.errors import NormlabError
from normlab.lab.runs import METRICS, SUMMARY, RunFolder, escape_step, read_summary

PAPER_RMS, PAPER_ATTRACTOR = 3.21, 7.54
__all__ = ["Results", "PAPER_RMS", "PAPER_ATTRACTOR", "frac", "untrained", "fmt"]


class Results:
    """Runs of one experiment grouped by name: status, values per seed, links. Each run's summary, metrics and
    config are read from disk once, on first use, and kept.

    Args:
        exp: The experiment (its TOML as a dict).
        root: The folder of its runs.
        profile: The budget they ran at, named in figures.
    """

    def __init__(self, exp: dict, root: Path, profile: str = "") -> None:
        self.exp, self.root, self.profile = exp, root, profile
        self.groups: dict[str, list[dict]] = {}
        self.sweeps: dict[str, list[str]] = {}  # a run swept over learning rates: its variants, by rate
        for r in exp["runs"]:
            self.groups.setdefault(r["name"], []).append(r)
            base = r.get("meta", {}).get("sweep")
            if base is not None and r["name"] not in self.sweeps.setdefault(base, []):
                self.sweeps[base].append(r["name"])
        self._read: dict[tuple[str, str], object] = {}

    def best(self, name: str, metric: str = "final_val_loss") -> str | None:
        """The variant of a learning-rate sweep with the lowest mean ``metric`` over seeds (validation loss by
        default), among those whose every seed completed; None while none has."""
        done = []
        for v in self.sweeps[name]:
            vals = self.values(v, metric)
            if vals and len(vals) == len(self.groups[v]):
                done.append((statistics.fmean(vals), v))
        return min(done)[1] if done else None

    def at_edge(self, name: str) -> bool:
        """Whether a sweep's best rate is the lowest or the highest of its grid (the grid should be widened)."""
        best = self.best(name)
        return best is not None and best in (self.sweeps[name][0], self.sweeps[name][-1])

    def resolve(self, name: str) -> str:
        """A run name as the checks mean it: a swept run stands for its variant at the best learning rate."""
        if name in self.sweeps:
            return self.best(name) or self.sweeps[name][0]
        return name

    def run_dir(self, run: dict) -> Path:
        return self.root / "runs" / run["run_id"]

    def _once(self, run: dict, what: str, read):
        key = (run["run_id"], what)
        if key not in self._read:
            self._read[key] = read(self.run_dir(run))
        return self._read[key]

    def summary(self, run: dict) -> dict:
        return self._once(run, "summary", lambda d: checked(read_summary(d) or {}, d / SUMMARY, SUMMARY_FIELDS))

    def rows(self, run: dict) -> list[dict]:
        def read(d: Path) -> list[dict]:
            rows = RunFolder(d).metrics()
            for i, r in enumerate(rows):
                checked(r, d / f"{METRICS}, line {i + 1}", ROW_FIELDS)
            return rows

        return self._once(run, "metrics", read)

    def config(self, run: dict) -> dict | None:
        return self._once(run, "config", lambda d: RunFolder(d).config())

    def value(self, run: dict, metric: str = "final_val_loss") -> float | None:
        """A completed run's ``metric``: from its summary, else the last logged value."""
        s = self.summary(run)
        if s.get("status") != "completed":
            return None
        if s.get(metric) is not None:
            return float(s[metric])
        rows = [r for r in self.rows(run) if metric in r]
        return float(rows[-1][metric]) if rows else None

    def values(self, name: str, metric: str = "final_val_loss") -> list[float]:
        name = self.resolve(name)
        return [v for r in self.groups.get(name, []) if (v := self.value(r, metric)) is not None]

    def mean(self, name: str, metric: str = "final_val_loss") -> float | None:
        v = self.values(name, metric)
        return statistics.fmean(v) if v else None

    def spread(self, *names: str, metric: str = "final_val_loss") -> float:
        """The largest standard deviation over seeds among ``names`` (0 with one seed each)."""
        sds = [statistics.stdev(v) for n in names if len(v := self.values(n, metric)) > 1]
        return max(sds, default=0.0)

    def status(self, name: str) -> str:
        name = self.resolve(name)
        sts = [self.summary(r).get("status", "missing") for r in self.groups[name]]
        return sts[0] if len(set(sts)) == 1 else ", ".join(sts)

    def baseline(self, metric: str = "final_val_loss") -> float | None:
        """The mean of the experiment's baseline run (its TOML's ``baseline``), the reference of *frac*."""
        name = self.exp.get("baseline")
        return self.mean(name, metric) if name in self.groups else None

    def label(self, name: str) -> str:
        if name in self.sweeps:
            best = self.best(name)
            lr = "" if best is None else f" (best {self.meta(best)['lr_field']} {self.meta(best)['lr']:g})"
            return self.groups[self.sweeps[name][0]][0]["label"].rsplit(", ", 1)[0] + lr
        return self.groups[name][0]["label"]

    def meta(self, name: str) -> dict:
        return self.groups[self.resolve(name)][0]["meta"]

    def flagged(self, flag: str) -> list[str]:
        """The runs whose TOML entry sets ``flag`` (e.g. pointwise = true)."""
        return [n for n in self.groups if self.meta(n).get(flag)]

    def entropy(self) -> float | None:
        for runs in self.groups.values():
            for r in runs:
                s = self.summary(r)
                if "unigram_entropy" in s:
                    return s["unigram_entropy"]
        return None

    def escape(self, name: str) -> str:
        """Each seed's escape step (the first evaluation 0.1 nats below the unigram entropy), or 'never'."""
        name = self.resolve(name)
        h, steps = self.entropy(), []
        for r in self.groups[name]:
            s = self.summary(r)
            if s.get("status") != "completed":
                steps.append("-")
                continue
            step = s["escape_step"] if "escape_step" in s else escape_step(self.rows(r), h)
            steps.append("never" if step is None else str(step))
        return ", ".join(steps)

    def cell(self, name: str, metric: str = "final_val_loss", fmt: str = "{:.3f}") -> str:
        """'2.451 ± 0.012' linked to the run directories (one link per seed)."""
        name = self.resolve(name)
        runs = self.groups[name]
        vals = self.values(name, metric)
        status = self.status(name)
        links = [f"[s{r['seed']}](runs/{r['run_id']}/)" for r in runs]
        if not vals:
            return f"**{status}** ({', '.join(links)})"
        text = fmt.format(statistics.fmean(vals))
        if len(vals) > 1:
            text += " ± " + fmt.format(statistics.stdev(vals))
        if len(runs) == 1:
            return f"[{text}](runs/{runs[0]['run_id']}/)"
        return f"{text} ({', '.join(links)})"


# what the report reads of a summary and of a metrics row, and their kinds (None allowed where a run may lack one)
_NUM = (int, float)
SUMMARY_FIELDS = {"status": (str,), "final_val_loss": (*_NUM, type(None)), "unigram_entropy": _NUM,
                  "escape_step": (int, type(None)), "tokens_per_s": (*_NUM, type(None)), "steps": (int,)}  # fmt: skip
ROW_FIELDS = {"step": (int,), "val_loss": (*_NUM, type(None)), "train_loss": (*_NUM, type(None))}


def checked(d: dict, where: Path | str, fields: dict) -> dict:
    """``d`` if every field the report reads has its kind; else one clear error naming the file and the field."""
    if not isinstance(d, dict):
        raise NormlabError(f"{where}: not a JSON object; delete the run folder and run the sweep again")
    for key, kinds in fields.items():
        v = d.get(key)
        if key in d and (not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise NormlabError(
                f"{where}: {key} must be {names}, got {v!r} (edited or damaged); delete the run "
                "folder and run the sweep again"
            )
    return d


def frac(loss, rms, top):
    """Position of ``loss`` from RMSNorm (0) to the attractor (1); None when RMSNorm is not below the attractor."""
    if loss is None or rms is None or top is None or top - rms < 0.1:
        return None
    return (loss - rms) / (top - rms)


def untrained(res: Results) -> str | None:
    """Why the claims cannot be judged, when the baseline itself has not learned past the attractor."""
    h, base = res.entropy(), res.baseline()
    if h is not None and base is not None and base > h - 0.1:
        return (
            f"RMSNorm's loss {base:.3f} is not below the unigram entropy {h:.3f}: at this scale nothing has "
            "trained past the attractor, so the claims cannot be judged (use the default or full profile)"
        )
    return None


def fmt(v, spec="{:.2f}"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)
