"""The record of a conversion: one ``Site`` per replaced norm (what replaced it, with what, the fit and its
notes), and the ``ConversionRecord`` of a model, written beside a saved model as normlab_conversion.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Site", "ConversionRecord", "POOR_FIT", "fit_status"]

POOR_FIT = 0.2  # a calibrated site whose fit explains less than this fraction of its target's variance is "poor"


def fit_status(fit: dict | None) -> str:
    """'ok', 'poor fit (explains N%)', 'FLAGGED' (the fit did not converge, or is degenerate), or for a site that
    was not calibrated 'not calibrated (default init)': nothing vouches for it, so it is never called ok."""
    if fit is None:
        return "not calibrated (default init)"
    f = fit
    if not f.get("converged", True):
        return "FLAGGED"
    explained = f.get("explained")
    if explained is not None and explained < POOR_FIT:
        return f"poor fit (explains {max(explained, 0.0):.0%})"
    return "ok"


@dataclass
class Site:
    name: str
    source: str  # class name of the module replaced
    kind: str  # layer_norm | rms_norm | rms_norm_offset
    dim: int
    eps: float
    kwargs: dict  # what the replacement was built with
    copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fit: dict | None = None
    first_token: bool = False  # the first token has its own replacement (normlab.conversion.calibrate.FirstToken)


@dataclass
class ConversionRecord:
    target: str
    per: str
    sites: list[Site]
    skipped: list[dict]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format": "normlab-conversion-1", "target": self.target, "per": self.per,
                "sites": [asdict(s) for s in self.sites], "skipped": self.skipped, "notes": self.notes}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> ConversionRecord:
        if d.get("format") != "normlab-conversion-1":
            raise ValueError("not a normlab conversion record (format normlab-conversion-1)")
        return cls(d["target"], d["per"], [Site(**s) for s in d["sites"]], d["skipped"], d.get("notes", []))

    def table(self, markdown: bool = False) -> str:
        from normlab._table import format_table

        rows = []
        for s in self.sites:
            f = s.fit or {}
            param = f.get("param_name", "-")
            value = f.get("value", "-")
            explained = f.get("explained")
            explains = f"{explained:.0%}" if explained is not None else "-"
            rows.append([s.name, s.source, self.target, param, value, f.get("rel_error", "-"), explains,
                         "; ".join([fit_status(s.fit)] + s.notes)])
        headers = ["site", "replaced", "with", "param", "value", "fit rel. error", "explains", "status and notes"]
        out = format_table(headers, rows, markdown)
        if self.notes:
            out += "\n" + "\n".join(self.notes)
        if self.skipped:
            out += "\nnot converted: " + "; ".join(f"{s['name']} ({s['class']}): {s['reason']}" for s in self.skipped)
        return out
