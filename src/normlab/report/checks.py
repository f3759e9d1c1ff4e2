"""The verdicts: each check of an experiment's TOML ``[[checks]]``, applied by its kind, returns ``Verdict``
values (the status, the numbers it rests on, the sentence), never strings to be parsed back."""

from __future__ import annotations

from dataclasses import dataclass, field

from normlab.report.results import Results, fmt, frac, untrained

__all__ = ["Verdict", "CHECKS", "claims", "verdict", "seeded", "register_check"]

_WORDS = {True: "agrees", False: "disagrees", None: "inconclusive"}


@dataclass(frozen=True)
class Verdict:
    """One line of the report. ``ok``: True (agrees), False (disagrees), None (inconclusive); ``finding``: a
    result with no published number to agree with. ``numbers``: what the sentence states, for scripts."""

    ok: bool | None
    text: str
    numbers: dict = field(default_factory=dict)
    finding: bool = False

    @property
    def word(self) -> str:
        return "finding" if self.finding else _WORDS[self.ok]

    def __str__(self) -> str:
        if self.finding:
            return f"finding (no published number to compare): {self.text}"
        return f"**{self.word}**: {self.text}"


def verdict(ok: bool | None, text: str, **numbers) -> Verdict:
    return Verdict(ok, text, numbers)


def seeded(res: Results, ok: bool, diff: float, names, text: str, metric: str = "final_val_loss") -> Verdict:
    """A verdict only when the difference it rests on exceeds the spread over seeds; else inconclusive."""
    spread = res.spread(*names, metric=metric)
    if spread > 0 and abs(diff) <= spread:
        return Verdict(
            None,
            f"{text}; the difference {abs(diff):.3g} is within the spread over seeds {spread:.3g}",
            {"difference": abs(diff), "spread": spread},
        )
    return Verdict(ok, text, {"difference": diff, "spread": spread})


def _check_band(res: Results, c: dict) -> list[Verdict]:
    vals = [v for n in res.flagged(c["where"]) if (v := res.mean(n)) is not None]
    h = res.entropy()
    if not vals or h is None:
        return [verdict(None, f"{c['what']}: runs missing")]
    spread, dist = max(vals) - min(vals), max(abs(v - h) for v in vals)
    return [
        verdict(
            spread < c["spread"] and dist < c["near_entropy"],
            f"{c['what']} span {spread:.3f} nats and sit at most {dist:.3f} from the unigram entropy {h:.3f}",
        )
    ]


def _check_below(res: Results, c: dict) -> list[Verdict]:
    vals = [v for n in res.flagged(c["where"]) if (v := res.mean(n)) is not None]
    base = res.baseline()
    if not vals or base is None:
        return [verdict(None, f"{c['what']}: runs missing")]
    names = [res.exp["baseline"], *res.flagged(c["where"])]
    return [
        seeded(
            res,
            base < min(vals) - c["margin"],
            min(vals) - base,
            names,
            f"{res.label(res.exp['baseline'])} reaches {base:.3f}, {min(vals) - base:.2f} below {c['what']}",
        )
    ]


def _check_status(res: Results, c: dict) -> list[Verdict]:
    got = res.status(c["run"])
    return [
        verdict(
            got == c["status"],
            f"{res.label(c['run'])}: status {got} (the dissection: {c['status']}), "
            f"loss {fmt(res.mean(c['run']), '{:.3f}')}",
        )
    ]


def _check_gap_shrinks(res: Results, c: dict) -> list[Verdict]:
    (a1, b1), (a2, b2) = c["pairs"]
    g1, g2 = _diff(res.mean(a1), res.mean(b1)), _diff(res.mean(a2), res.mean(b2))
    if g1 is None or g2 is None:
        return [verdict(None, f"{c['what']}: runs missing")]
    p1, p2 = (res.meta(a)["paper"] - res.meta(b)["paper"] for a, b in c["pairs"])
    n1, n2 = c["names"]
    return [
        seeded(
            res,
            g2 < c["ratio"] * g1,
            g1 - g2,
            [a1, b1, a2, b2],
            f"{c['what']} is {g1:.3f} {n1} vs {g2:.3f} {n2} (the dissection: {p1:.2f} vs {p2:.2f})",
        )
    ]


def _check_fraction(res: Results, c: dict) -> list[Verdict]:
    """Each run's place between the baseline (0) and the attractor (1): below ``works_below`` if it works in
    the dissection, above ``fails_above`` if it fails there."""
    out, base, h = [], res.baseline(), res.entropy()
    for n in res.groups:
        f = frac(res.mean(n), base, h)
        if n == res.exp["baseline"] or f is None:
            continue
        works = res.meta(n).get("works", False)
        ok = f < c["works_below"] if works else f > c["fails_above"]
        out.append(
            seeded(
                res,
                ok,
                res.mean(n) - base,
                [n, res.exp["baseline"]],
                f"{res.label(n)}: "
                f"{'works' if works else 'fails'} in the dissection; here it is at {f:.2f} of the way from "
                "RMSNorm to the attractor",
            )
        )
    return out


def _check_monotone(res: Results, c: dict) -> list[Verdict]:
    by = {res.meta(n)[c["by"]]: res.mean(n) for n in res.groups}
    if any(v is None for v in by.values()):
        return [verdict(None, "runs missing")]
    path = [by[k] for k in c["order"]]
    ok = path[0] == min(by.values()) and all(a < b for a, b in zip(path, path[1:]))
    text = ", ".join(f"{c.get('symbol', c['by'])}={k:g}: {by[k]:.3f}" for k in sorted(by))
    step = min(abs(b - a) for a, b in zip(path, path[1:]))  # the smallest step the ordering rests on
    return [seeded(res, ok, step, list(res.groups), f"{text}; the dissection: {c['seed']}")]


def _check_greater(res: Results, c: dict) -> list[Verdict]:
    m, a, b = c["metric"], res.mean(c["a"], c["metric"]), res.mean(c["b"], c["metric"])
    if a is None or b is None:
        return []
    pa, pb = res.meta(c["a"])["paper"][m], res.meta(c["b"])["paper"][m]
    return [
        seeded(
            res,
            a > b,
            a - b,
            [c["a"], c["b"]],
            f"{m}: {res.label(c['a'])} {a:.1f} vs {res.label(c['b'])} "
            f"{b:.1f} (the dissection at width 1024: {pa:g} vs {pb:g})",
            metric=m,
        )
    ]


def _check_orthogonal(res: Results, c: dict) -> list[Verdict]:
    """|a| below ``below`` and |b| more than ``factor`` times |a|: a gradient orthogonal to its input in a only."""
    m, a, b = c["metric"], res.mean(c["a"], c["metric"]), res.mean(c["b"], c["metric"])
    if a is None or b is None:
        return []
    pa, pb = res.meta(c["a"])["paper"][m], res.meta(c["b"])["paper"][m]
    return [
        verdict(
            abs(a) < c["below"] and abs(b) > c["factor"] * abs(a),
            f"{c['what']}: {res.label(c['a'])} {a:.2e} vs {res.label(c['b'])} {b:.2e} (seed: {pa:.4f} vs {pb:.4f})",
        )
    ]


def _check_families(res: Results, c: dict) -> list[Verdict]:
    """Findings with no published number: each family's best and worst init, and the best of two families."""
    fam = {}
    for n in res.groups:
        if (f := res.meta(n).get("family")) and res.mean(n) is not None:
            fam.setdefault(f, []).append((res.mean(n), res.label(n)))
    out = [
        f"{f}: best {min(rows)[0]:.3f} ({min(rows)[1]}), worst {max(rows)[0]:.3f} ({max(rows)[1]}); "
        f"init sensitivity (range over inits) {max(rows)[0] - min(rows)[0]:.3f} nats"
        for f, rows in fam.items()
    ]
    a, b = c["compare"]
    if a in fam and b in fam:
        va, vb = min(fam[a])[0], min(fam[b])[0]
        out.append(
            f"best {c['names'][0]} vs best {c['names'][1]}: {va:.3f} vs {vb:.3f} "
            f"({c['names'][0] if va < vb else c['names'][1]} ahead by {abs(va - vb):.3f}); "
            f"RMSNorm {fmt(res.baseline(), '{:.3f}')}"
        )
    return [Verdict(None, line, finding=True) for line in out]


CHECKS = {"band": _check_band, "below": _check_below, "status": _check_status, "gap_shrinks": _check_gap_shrinks,
          "fraction": _check_fraction, "monotone": _check_monotone, "greater": _check_greater,
          "orthogonal": _check_orthogonal, "families": _check_families}  # fmt: skip


def register_check(kind: str):
    """Decorator: a check kind that experiments' TOMLs may name (``kind = "..."``)."""

    def deco(fn):
        CHECKS[kind] = fn
        return fn

    return deco


def claims(res: Results) -> list[Verdict]:
    """The verdicts of the experiment's TOML ``[[checks]]``, each applied by its kind.

    Args:
        res: The experiment's runs.
    """
    if res.exp.get("guard", True) and (why := untrained(res)):
        return [verdict(None, why)]
    unknown = [c["kind"] for c in res.exp.get("checks", []) if c["kind"] not in CHECKS]
    if unknown:
        raise ValueError(f"experiment {res.exp['name']}: unknown check kind {unknown[0]!r}; known: {', '.join(CHECKS)}")
    return [line for c in res.exp.get("checks", []) for line in CHECKS[c["kind"]](res, c)]


def _diff(a, b):
    return None if a is None or b is None else a - b
