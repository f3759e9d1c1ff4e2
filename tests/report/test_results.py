"""What the report reads from run folders: summaries, metrics and indexes that are not normlab's are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import write_experiment
from normlab.cli import main
from normlab.sweep import load_experiment


def test_report_inputs_that_are_not_normlabs(corpus, tmp_path, capsys):
    from normlab.lab.runs import read_summary
    from normlab.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("[1, 2]")
    with pytest.raises(Exception, match=r"summary\.json is not a JSON object"):
        read_summary(run)
    root = tmp_path / "root"
    root.mkdir()
    (root / "index.json").write_text('{"profile": "tiny", "experi')
    with pytest.raises(Exception, match=r"index\.json is unreadable or not JSON"):
        write_report(root)
    assert (
        main(
            [
                "sweep",
                str(write_experiment(tmp_path, corpus, 5, runs=("rms_norm",))),
                "--profile",
                "tiny",
                "--jobs",
                "1",
                "--root",
                str(tmp_path / "a"),
                "--no-progress",
            ]
        )
        == 0
    )
    other = tmp_path / "b"
    other.mkdir()
    (other / "index.json").write_text(json.dumps({"profile": "tiny", "experiments": [{"name": "else", "runs": []}]}))
    assert main(["report", "--root", str(tmp_path / "a"), "--compare", str(other)]) == 2
    assert "holds none of this root's experiments" in capsys.readouterr().err


def test_defect_7_a_report_refuses_an_index_whose_name_escapes(tmp_path):
    from normlab.errors import NormlabError
    from normlab.report import write_report

    root = tmp_path / "r"
    root.mkdir()
    exp = {"name": "../../escape", "title": "t", "source": "", "claim": "", "runs": [], "figures": ["loss"]}
    (root / "index.json").write_text(json.dumps({"profile": "tiny", "experiments": [exp]}))
    with pytest.raises(NormlabError, match=r"index\.json: experiment name '\.\./\.\./escape' must be one path segment"):
        write_report(root)
    assert not list(tmp_path.rglob("escape*"))


def _report_root(tmp_path) -> tuple[Path, Path]:
    """A sweep root with one finished tiny run (trained for real)."""
    from normlab.sweep import expand, run_sweep, write_index

    toml = tmp_path / "one.toml"
    toml.write_text(
        'name = "one"\nseeds = [0]\n[[runs]]\nname = "a"\nset = { "model.norm" = "rms_norm", '
        '"steps" = 4, "eval_every" = 2, "metrics_every" = 2 }\n'
    )
    exp = load_experiment(str(toml))
    root = tmp_path / "root"
    specs = expand(exp, "tiny", root)
    write_index([exp], "tiny", root)
    run_sweep(specs, progress=False)
    return root, Path(specs[0].config.out)


@pytest.mark.slow
def test_fuzz_every_summary_and_metrics_field_the_report_reads(tmp_path, capsys):
    from normlab.report.results import ROW_FIELDS, SUMMARY_FIELDS

    root, run = _report_root(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["report", "--root", str(root)]) == 0
    capsys.readouterr()
    for field, kinds in SUMMARY_FIELDS.items():
        for wrong in ("junk", [1], {"a": 1}):
            if isinstance(wrong, kinds):
                continue
            (run / "summary.json").write_text(json.dumps({**summary, field: wrong}))
            rc = main(["report", "--root", str(root)])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and len(err.splitlines()) == 1, (field, wrong, err)
            assert "summary.json" in err and field in err, err
    (run / "summary.json").write_text(json.dumps(summary))
    rows = [json.loads(line) for line in metrics.splitlines()]
    for field in ROW_FIELDS:
        at = next(i for i, r in enumerate(rows) if field in r)
        bad = [dict(r) for r in rows]
        bad[at][field] = "junk"
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
        rc = main(["report", "--root", str(root)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "metrics.jsonl" in err and field in err, (field, err)
    (run / "metrics.jsonl").write_text("[1, 2]\nnot json\n42\n" + metrics)  # junk lines: skipped
    assert main(["report", "--root", str(root)]) == 0
