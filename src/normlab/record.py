"""The record of a conversion: one ``Site`` per replaced norm (what replaced it, with what, the fit and its
notes), and the ``ConversionRecord`` of a model, written beside a saved model as normlab_conversion.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Site", "ConversionRecord", "RECORD_FILE", "PER", "POOR_FIT", "CALIBRATION_PATHS", "fit_status"]

#: The record's file in a saved folder (`normlab.save_converted`, `normlab.load_converted`).
RECORD_FILE = "normlab_conversion.json"
#: How many fitted parameters a site has: one ("global") or one per channel; ConvertConfig.per takes these.
PER = ("global", "channel")

POOR_FIT = 0.2  # a calibrated site whose fit explains less than this fraction of its target's variance is "poor"


def fit_status(fit: dict | None) -> str:
    """'ok', 'poor fit (explains N%)', 'FLAGGED' (the fit did not converge, or is degenerate), or for a site that
    was not calibrated 'not calibrated (default init)': nothing vouches for it, so it is never called ok.

    Args:
        fit: A site's fit record (its error, the share it explains, its flags), or None where it was not calibrated.
    """
    if fit is None:
        return "not calibrated (default init)"
    f = fit
    if not f.get("converged", True):
        return "FLAGGED"
    explained = f.get("explained")
    if explained is not None and explained < POOR_FIT:
        return f"poor fit (explains {max(explained, 0.0):.0%})"
    return "ok"


CALIBRATION_PATHS = ("blocks", "prefix", "original")  # how calibration took the sites' inputs (calibrate._path)

# the JSON kinds of a record's fields: (types, required)
_RECORD_FIELDS = {"target": ((str,), True), "per": ((str,), True), "sites": ((list,), True),
                  "skipped": ((list,), True), "notes": ((list,), False),
                  "calibration": ((dict,), False), "embed_scale": ((list,), False)}  # fmt: skip
_SITE_FIELDS = {"name": ((str,), True), "source": ((str,), True), "kind": ((str,), True), "dim": ((int,), True),
                "eps": ((int, float), True), "kwargs": ((dict,), True), "copied": ((list,), False),
                "notes": ((list,), False), "fit": ((dict, type(None)), False),
                "massive": ((dict, type(None)), False)}  # fmt: skip


def _fields(d: dict, spec: dict, prefix: str) -> None:
    for key, (kinds, required) in spec.items():
        if key not in d:
            if required:
                raise ValueError(f"{prefix}{key} is missing")
            continue
        v = d[key]
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{prefix}{key} must be {names}, got {v!r}")


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
    massive: dict | None = None  # massive tokens' own copy: its channels and threshold (conversion.massive.Detector)


@dataclass
class ConversionRecord:
    target: str
    per: str
    sites: list[Site]
    skipped: list[dict]
    notes: list[str] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)  # how calibration ran: its path ("blocks", "prefix" or
    # "original"), why, its cached inputs' memory and its seconds (normlab.conversion.calibrate.sites.calibrate_sites)
    embed_scale: list[str] = field(default_factory=list)  # the embedding tables given the papers' learnable scalar
    # (normlab.embed_scale.ScaledEmbedding), by replace_norms(init="dyt_paper" or "derf_paper")

    @property
    def spec(self):
        """The target's registry entry (`normlab.registry.NormSpec`)."""
        from normlab.registry import norm_spec

        return norm_spec(self.target)

    def to_dict(self) -> dict:
        return {
            "format": "normlab-conversion-1",
            "target": self.target,
            "per": self.per,
            "sites": [asdict(s) for s in self.sites],
            "skipped": self.skipped,
            "notes": self.notes,
            "calibration": self.calibration,
            **({"embed_scale": self.embed_scale} if self.embed_scale else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ConversionRecord:
        """A record from its JSON form; a missing field or a value of the wrong kind is a ValueError that names
        the field (``sites[3].dim``), what was expected and what was given."""
        if d.get("format") != "normlab-conversion-1":
            raise ValueError("not a normlab conversion record (format normlab-conversion-1)")
        _fields(d, _RECORD_FIELDS, "")
        if d["per"] not in PER:
            raise ValueError(f"per must be {' or '.join(map(repr, PER))}, got {d['per']!r}")
        from normlab.registry import norm_spec

        try:
            norm_spec(d["target"])
        except ValueError as e:
            raise ValueError(f"target: {e}") from None
        calibration = d.get("calibration", {})
        if calibration and calibration.get("path") not in CALIBRATION_PATHS:
            raise ValueError(
                f"calibration.path must be one of {', '.join(CALIBRATION_PATHS)}, got {calibration.get('path')!r}"
            )
        sites = []
        for i, s in enumerate(d["sites"]):
            if not isinstance(s, dict):
                raise ValueError(f"sites[{i}] must be an object, got {s!r}")
            if s.get("first_token"):
                raise ValueError(
                    f"sites[{i}].first_token: this conversion gave position 0 its own copy (normlab < 0.4), a rule "
                    "that breaks on left-padded batches, chunks after a KV cache and massive tokens after position 0; "
                    "convert the model again"
                )
            s = {k: v for k, v in s.items() if k != "first_token"}
            _fields(s, _SITE_FIELDS, f"sites[{i}].")
            unknown = sorted(set(s) - set(_SITE_FIELDS))
            if unknown:
                raise ValueError(f"sites[{i}].{unknown[0]}: not a field of a site ({', '.join(_SITE_FIELDS)})")
            sites.append(Site(**s))
        scaled = d.get("embed_scale", [])
        if not all(isinstance(n, str) for n in scaled):
            raise ValueError(f"embed_scale must be a list of module names, got {scaled!r}")
        return cls(d["target"], d["per"], sites, d["skipped"], d.get("notes", []), calibration, list(scaled))

    def table(self, markdown: bool = False) -> str:
        from normlab.table import format_table

        rows = []
        for s in self.sites:
            f = s.fit or {}
            param = f.get("param_name", "-")
            value = f.get("value", "-")
            explained = f.get("explained")
            explains = f"{explained:.0%}" if explained is not None else "-"
            rows.append(
                [
                    s.name,
                    s.source,
                    self.target,
                    param,
                    value,
                    f.get("rel_error", "-"),
                    explains,
                    "; ".join([fit_status(s.fit)] + s.notes),
                ]
            )
        headers = ["site", "replaced", "with", "param", "value", "fit rel. error", "explains", "status and notes"]
        out = format_table(headers, rows, markdown)
        if self.notes:
            out += "\n" + "\n".join(self.notes)
        if self.skipped:
            out += "\nnot converted: " + "; ".join(f"{s['name']} ({s['class']}): {s['reason']}" for s in self.skipped)
        return out
