"""The feature matrix (normlab.features): read from the code, kept in docs/norms.md, and each claim that a norm runs
without normlab checked by running it so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import normlab
from conftest import load_without_normlab, tiny_lm
from normlab.features import (
    BEGIN,
    END,
    FAMILY_BEGIN,
    FAMILY_END,
    family_features,
    family_markdown,
    markdown,
    measured,
    norm_features,
)

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_hold_the_current_matrix():
    page = (REPO / "docs" / "norms.md").read_text()
    assert BEGIN in page and END in page
    kept = BEGIN + page.split(BEGIN, 1)[1].split(END, 1)[0] + END
    assert kept == markdown(), "docs/norms.md's feature matrix is stale: python -m normlab.features --write"


def test_a_family_is_measured_by_its_jobs_newest_rows(tmp_path):
    """A job measured again replaces its earlier row, even a better one; the best of the jobs' newest rows is shown."""
    table = tmp_path / "usable.csv"
    head = "job,model,command,sites,held_same_top1,held_gap_worst,minutes\n"
    rows = ["walk,qwen-coder,c,9,0.82,1.27,14.6", "heal,qwen-coder,c,9,0.78,0.30,37.2"]
    rows.append("walk,qwen-coder,c,9,0.80,1.28,14.2")
    table.write_text(head + "\n".join(rows) + "\n")
    want = "Qwen2.5-Coder-0.5B-Instruct: 9 sites converted, 80% same top-1, worst sequence +1.28 (`walk`, 14.2 min)"
    assert measured(table) == {"Qwen2": want}
    table.write_text(head + "\n".join(rows[:2]) + "\n")
    assert "82% same top-1" in measured(table)["Qwen2"]
    table.write_text(head + "\n".join([*rows, "lin,qwen-coder,normlab convert --to fixed_scale,4,0.95,0.1,9"]) + "\n")
    assert measured(table) == {"Qwen2": want}  # another target's row is not DyISRU's conversion
    study = tmp_path / "study_usable.csv"  # the usable study's rows, read after the script's
    rows = ["usable,walk,qwen-coder,dyisru,9,0.81,1.2,14.04", "usable,lin,qwen-coder,fixed_scale,4,0.99,0.1,9"]
    study.write_text("study,cell,model,to,sites,held_same_top1,held_gap_worst,minutes\n" + "\n".join(rows) + "\n")
    assert "81% same top-1, worst sequence +1.20 (`walk`, 14.0 min)" in measured((table, study))["Qwen2"]


def test_the_conversion_guide_holds_the_current_family_matrix():
    pytest.importorskip("transformers")
    page = (REPO / "docs" / "models.md").read_text()
    kept = FAMILY_BEGIN + page.split(FAMILY_BEGIN, 1)[1].split(FAMILY_END, 1)[0] + FAMILY_END
    assert kept == family_markdown(), "docs/models.md's family matrix is stale: python -m normlab.features --write"


def test_the_family_matrix_says_what_export_onnx_does():
    """A family the matrix calls refused is refused by export_onnx itself, before any work, with that reason."""
    pytest.importorskip("onnx")
    from normlab.features import tiny_causal_lm

    rows = family_features()
    assert rows["Qwen3"]["sites"] == "4 per block + 1"  # input, post-attention and the per-head q/k norms
    refused = [f for f, row in rows.items() if row["onnx"] != "yes"]
    assert "Gemma3" in refused and "Llama" not in refused
    for family in refused:
        reason = rows[family]["onnx"].removeprefix("refused: ")
        with pytest.raises(ValueError, match=reason):
            normlab.export_onnx(tiny_causal_lm(family, 2), REPO / "never-written.onnx")


def test_the_matrix_reads_the_code():
    rows = norm_features()
    assert set(rows) == set(normlab.list_norms())
    assert rows["dyisru"]["calibrates"] == "log_beta" and rows["dyt"]["calibrates"] == "alpha"
    assert rows["eln"]["cpu"] and not rows["eln"]["triton"]  # normlab.kernels.eln has no Triton path
    assert rows["rms_norm"]["triton"] and not rows["tanh_fixed"]["cpu"]
    assert not rows["rms_ema"]["portable"]  # its running mean is a buffer the modeling file does not rebuild


@pytest.mark.slow
def test_every_norm_said_to_run_without_normlab_does(tmp_path):
    """A tiny Llama converted to each such norm (its default init), saved, and loaded by transformers alone in a
    process that cannot import normlab: the same logits."""
    pytest.importorskip("transformers")
    cases = []
    for name, row in norm_features().items():
        if not row["portable"]:
            continue
        model = tiny_lm("Llama", seed=0)
        record = normlab.convert_norms(model, name)
        folder = tmp_path / name
        normlab.save_converted(model, record, folder)
        x = torch.randint(0, 100, (2, 12))
        with torch.no_grad():
            torch.save({"x": x, "y": model(x).logits}, folder / "case.pt")
        cases.append((str(folder), "AutoModelForCausalLM", "logits"))
    got = load_without_normlab(cases, tmp_path)
    assert not got.pop("normlab_imported", False)
    for folder, _, _ in cases:
        assert got[folder]["diff"] <= 1e-5, (Path(folder).name, got[folder])
