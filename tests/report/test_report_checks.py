"""Every verdict the report can print, run: each check of each built-in experiment, agreeing and disagreeing.

The checks are data (the ``[[checks]]`` of each experiment's TOML); these tests write small summary.json
files for the experiment's real runs and assert the sentence the report states.
"""

from __future__ import annotations

import json

import pytest

from normlab.report import Results
from normlab.report import claims as _verdicts
from normlab.sweep import load_experiment

H = 3.33  # the unigram entropy of the fake runs


def _results(tmp_path, name: str, values: dict, statuses: dict | None = None) -> Results:
    """Results of built-in experiment ``name`` whose runs ended at ``values`` (a loss, or a dict of metrics)."""
    exp = load_experiment(name)
    runs = []
    for r in exp.runs:
        meta = {k: v for k, v in r.items() if k not in ("name", "label", "set")}
        v = values.get(r["name"])
        for seed, one in enumerate(v if isinstance(v, list) else [v]):  # a list: one value per seed
            run_id = f"{name}-{r['name']}-s{seed}"
            runs.append(
                {"name": r["name"], "label": r.get("label", r["name"]), "seed": seed, "run_id": run_id, "meta": meta}
            )
            summary = {"status": (statuses or {}).get(r["name"], "completed"), "unigram_entropy": H}
            summary.update(one if isinstance(one, dict) else {"final_val_loss": one})
            (tmp_path / "runs" / run_id).mkdir(parents=True)
            (tmp_path / "runs" / run_id / "summary.json").write_text(json.dumps(summary))
    d = {"name": exp.name, "runs": runs, "baseline": exp.baseline, "checks": exp.checks, "guard": exp.guard}
    return Results(d, tmp_path)


def _claims(res: Results) -> list[str]:
    return [str(v) for v in _verdicts(res)]


POINTWISE = ["dyt", "dyt_hardtanh", "dyt_sigmoid", "derf", "dyt_per_channel", "tanh_fixed"]


def test_pointwise_agrees(tmp_path):
    values = {**{n: H + 0.01 * i for i, n in enumerate(POINTWISE)}, "rms_norm": 2.5, "layer_scale": None}
    lines = _claims(_results(tmp_path, "pointwise", values, {"layer_scale": "diverged"}))
    assert lines == [
        "**agrees**: the point-wise variants span 0.050 nats and sit at most 0.050 from the unigram entropy 3.330",
        "**agrees**: RMSNorm reaches 2.500, 0.83 below the best point-wise variant",
        "**agrees**: LayerScale (linear): status diverged (the dissection: diverged), loss -",
    ]


def test_pointwise_disagrees(tmp_path):
    values = {**{n: 2.6 + 0.2 * i for i, n in enumerate(POINTWISE)}, "rms_norm": 2.5, "layer_scale": 2.7}
    lines = _claims(_results(tmp_path, "pointwise", values))
    assert lines == [
        "**disagrees**: the point-wise variants span 1.000 nats and sit at most 0.730 from the unigram entropy 3.330",
        "**disagrees**: RMSNorm reaches 2.500, 0.10 below the best point-wise variant",
        "**disagrees**: LayerScale (linear): status completed (the dissection: diverged), loss 2.700",
    ]


def test_an_untrained_baseline_makes_every_guarded_check_inconclusive(tmp_path):
    lines = _claims(_results(tmp_path, "pointwise", dict.fromkeys([*POINTWISE, "rms_norm", "layer_scale"], H)))
    assert len(lines) == 1 and lines[0].startswith("**inconclusive**: RMSNorm's loss 3.330 is not below")


@pytest.mark.parametrize("wide_gap, verdict", [(0.2, "agrees"), (0.9, "disagrees")])
def test_width(tmp_path, wide_gap, verdict):
    values = {"narrow_rms_norm": 2.0, "narrow_dyt": 3.0, "wide_rms_norm": 2.0, "wide_dyt": 2.0 + wide_gap}
    assert _claims(_results(tmp_path, "width", values)) == [
        f"**{verdict}**: DyT's gap to RMSNorm is 1.000 narrow vs {wide_gap:.3f} wide (the dissection: 4.33 vs 0.61)"
    ]


@pytest.mark.parametrize("name", ["denominator", "coupling"])
def test_fraction_checks_agree_and_disagree(tmp_path, name):
    exp = load_experiment(name)
    works = {r["name"]: r.get("works", False) for r in exp.runs if r["name"] != "rms_norm"}
    good = {n: 2.0 + (0.1 if w else 1.2) for n, w in works.items()}  # works: frac 0.08; fails: frac 0.9
    lines = _claims(_results(tmp_path / "good", name, {"rms_norm": 2.0, **good}))
    assert len(lines) == len(works) and all(line.startswith("**agrees**") for line in lines)
    said = any("works in the dissection; here it is at 0.08 of the way" in line for line in lines)
    assert said == any(works.values())
    bad = {n: 2.0 + (1.2 if w else 0.1) for n, w in works.items()}
    lines = _claims(_results(tmp_path / "bad", name, {"rms_norm": 2.0, **bad}))
    assert all(line.startswith("**disagrees**") for line in lines)
    label = next(r["label"] for r in exp.runs if r["name"] != "rms_norm" and not r.get("works"))
    want = (
        f"**disagrees**: {label}: fails in the dissection; here it is at 0.08 of the way from RMSNorm to the attractor"
    )
    assert want in lines


@pytest.mark.parametrize("monotone", [True, False])
def test_coupling_sweep(tmp_path, monotone):
    exp = load_experiment("coupling_sweep")
    lams = {r["name"]: r["lam"] for r in exp.runs}
    values = {n: 3.0 - lam for n, lam in lams.items()} if monotone else {n: 2.5 for n in lams}
    (line,) = _claims(_results(tmp_path, "coupling_sweep", values))
    assert line.startswith("**agrees**" if monotone else "**disagrees**")
    assert line.endswith("; the dissection: monotone degradation from lambda = 1 to 0")
    assert ("lambda=1: 2.000" if monotone else "lambda=1: 2.500") in line


@pytest.mark.parametrize("coupled, verdict", [(True, "agrees"), (False, "disagrees")])
def test_rank(tmp_path, coupled, verdict):
    rms = {"erank_attn_proj": 50.0, "erank_mlp_proj": 60.0, "align_cos": 1e-5 if coupled else 0.2}
    det = {"erank_attn_proj": 20.0 if coupled else 80.0, "erank_mlp_proj": 30.0 if coupled else 90.0,
           "align_cos": -0.3 if coupled else 0.2}  # fmt: skip
    lines = _claims(_results(tmp_path, "rank", {"rms_norm": {"final_val_loss": 2.0, **rms}, "rms_detached": det}))
    a, d = ("RMSNorm (lambda = 1)", "Detached (lambda = 0)")
    assert lines == [
        f"**{verdict}**: erank_attn_proj: {a} 50.0 vs {d} {det['erank_attn_proj']:.1f} "
        "(the dissection at width 1024: 727 vs 158)",
        f"**{verdict}**: erank_mlp_proj: {a} 60.0 vs {d} {det['erank_mlp_proj']:.1f} "
        "(the dissection at width 1024: 936 vs 195)",
        f"**{verdict}**: cos(grad, activation): {a} {rms['align_cos']:.2e} vs {d} {det['align_cos']:.2e} "
        "(seed: 0.0000 vs 0.0084)",
    ]


def test_beyond_states_findings_not_verdicts(tmp_path):
    exp = load_experiment("beyond")
    values = {r["name"]: 2.0 + 0.1 * i for i, r in enumerate(exp.runs)}
    lines = _claims(_results(tmp_path, "beyond", values))
    assert all(line.startswith("finding (no published number to compare): ") for line in lines)
    families = {r["family"] for r in exp.runs if "family" in r}
    assert len(lines) == len(families) + 1
    assert "best DyISRU vs best DyT" in lines[-1] and "RMSNorm 2.000" in lines[-1]


def test_a_toml_check_naming_a_missing_run_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'name = "x"\nbaseline = "a"\n[[runs]]\nname = "a"\nset = {}\n'
        '[[checks]]\nkind = "status"\nrun = "nope"\nstatus = "diverged"\n'
    )
    with pytest.raises(ValueError, match="names a run that does not exist: 'nope'"):
        load_experiment(str(bad))


def test_escape_step_is_the_first_evaluation_below_the_attractor(tmp_path):
    from normlab.lab.runs import escape_step

    rows = [{"step": 10, "train_loss": 3.0}, {"step": 50, "val_loss": 3.3}, {"step": 100, "val_loss": 3.2},
            {"step": 150, "val_loss": 3.1}]  # fmt: skip
    assert escape_step(rows, H) == 100  # 3.2 <= 3.33 - 0.1; 3.3 at step 50 is not
    assert escape_step(rows, 3.5) == 50
    assert escape_step(rows, 3.0) is None
    res = _results(
        tmp_path,
        "width",
        {
            "narrow_rms_norm": {"final_val_loss": 2.0, "escape_step": 100},
            "narrow_dyt": {"final_val_loss": 3.3, "escape_step": None},
        },
    )
    assert res.escape("narrow_rms_norm") == "100" and res.escape("narrow_dyt") == "never"


def test_a_difference_within_the_spread_over_seeds_is_inconclusive(tmp_path):
    noisy = {
        "narrow_rms_norm": [2.0, 2.0],
        "narrow_dyt": [2.5, 3.5],
        "wide_rms_norm": [2.0, 2.0],
        "wide_dyt": [2.8, 3.0],
    }  # gaps 1.0 and 0.9, but narrow DyT's seeds differ by 1.0 (std 0.71)
    (line,) = _claims(_results(tmp_path / "noisy", "width", noisy))
    assert line == (
        "**inconclusive**: DyT's gap to RMSNorm is 1.000 narrow vs 0.900 wide (the dissection: 4.33 vs "
        "0.61); the difference 0.1 is within the spread over seeds 0.707"
    )
    clear = {**noisy, "narrow_dyt": [2.99, 3.01], "wide_dyt": [2.19, 2.21]}  # gaps 1.0 and 0.2, std 0.014
    (line,) = _claims(_results(tmp_path / "clear", "width", clear))
    assert line.startswith("**agrees**: DyT's gap to RMSNorm is 1.000 narrow vs 0.200 wide")


def test_the_report_states_each_verdict_at_both_budgets(tmp_path):
    from normlab.report import write_report

    def root(profile, values):
        res = _results(tmp_path / profile, "width", values)
        for runs in res.groups.values():  # a loss curve per run
            for r in runs:
                (res.run_dir(r) / "metrics.jsonl").write_text('{"step": 50, "val_loss": 3.0}\n')
        exp = {**res.exp, "title": "Width", "source": "the dissection", "claim": "c", "metrics": ["final_val_loss"],
               "figures": ["loss"]}  # fmt: skip
        (tmp_path / profile / "index.json").write_text(json.dumps({"profile": profile, "experiments": [exp]}))
        return tmp_path / profile

    short = root("default", {"narrow_rms_norm": 2.0, "narrow_dyt": 3.0, "wide_rms_norm": 2.0, "wide_dyt": 2.9})
    long = root("long", {"narrow_rms_norm": 1.8, "narrow_dyt": 3.0, "wide_rms_norm": 1.8, "wide_dyt": 1.9})
    text = write_report(long, compare=short).read_text()
    assert (
        "- **agrees**: DyT's gap to RMSNorm is 1.200 narrow vs 0.100 wide (the dissection: 4.33 vs 0.61) "
        "[at `default`: disagrees]" in text
    )
    assert (long / "figures" / "width_loss.png").stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="no index.json"):
        write_report(long, compare=tmp_path / "nowhere")
