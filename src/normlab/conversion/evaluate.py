"""``normlab evaluate DIR``: a converted folder judged as it will be used (`normlab.conversion.measure.usage`), against
the
original it was made from, on the texts its conversion measured. The result is printed and written to
``DIR/evaluation.json``."""

from __future__ import annotations

import json
from pathlib import Path

from normlab.conversion.config import ConvertConfig
from normlab.conversion.export.saving import RECORD_FILE, load_converted
from normlab.conversion.hf import TextCut, fixture_path, load_model, text_batches, usable_tokenizer
from normlab.conversion.measure.usage import UsageConfig, usage_lines, usage_report
from normlab.conversion.stages import Stages
from normlab.conversion.workflow import CONFIG_FILE, model_fingerprint
from normlab.corpus import DOCS, fetch_docs, fetch_shakespeare
from normlab.owner import hold

__all__ = ["EVALUATION_FILE", "evaluate_folder", "original_of"]

EVALUATION_FILE = "evaluation.json"


def original_of(folder: Path, original: str | None = None) -> str:
    """The original's path of a converted folder: ``original``, or the one its record names; checked to exist.

    Args:
        folder: A converted model's folder (``normlab convert --out``).
        original: The original model's path; None: the one the folder records.
    """
    return _source(Path(folder), original)[0]


def _source(folder: Path, original: str | None) -> tuple[str, dict, ConvertConfig]:
    """The original's path (``original`` or the record's ``made_from.model``), the record and the folder's config;
    every file checked before a model is loaded."""
    where = folder / RECORD_FILE
    if not where.is_file():
        raise FileNotFoundError(
            f"{folder} is not a converted model's folder (no {RECORD_FILE}): give normlab evaluate the --out folder "
            "of `normlab convert`"
        )
    record = json.loads(where.read_text())
    cfg_file = folder / CONFIG_FILE
    cfg = ConvertConfig.from_dict(json.loads(cfg_file.read_text())) if cfg_file.is_file() else ConvertConfig()
    path = original or record.get("made_from", {}).get("model")
    if path is None:
        raise ValueError(f"{where} names no original (made_from.model): pass --original PATH")
    path = fixture_path(path)
    if not Path(path).exists():
        raise FileNotFoundError(
            f"the original {path} ({'--original' if original else f'{RECORD_FILE}: made_from.model'}) does not "
            "exist: pass --original with the model the folder was converted from"
        )
    return path, record, cfg


def evaluate_folder(
    folder: str | Path, original: str | None = None, *, markdown: bool = False, cfg: UsageConfig | None = None
) -> dict:
    """Judge the converted model in ``folder`` against its original (module docstring); returns the report.

    Args:
        folder: A converted model's folder (``normlab convert --out``).
        original: The original model's path; None: the one the folder records.
        markdown: Print the tables as Markdown.
        cfg: What to measure.
    """
    folder = Path(folder)
    path, record, conv_cfg = _source(folder, original)
    stage = Stages(progress=True, prefix="evaluate: ")
    with hold(folder, "the folder"):
        with stage("load the converted model and its original"):
            net, _ = load_converted(folder)
            source, tokenizer = load_model(path, progress=False)
        want = record.get("made_from", {}).get("model_fingerprint")
        if want is not None and model_fingerprint(source) != want:
            raise ValueError(
                f"{path} is not the model {folder} was converted from (its embedding's fingerprint differs from "
                f"{RECORD_FILE}'s made_from.model_fingerprint); pass --original with that model"
            )
        if not usable_tokenizer(tokenizer):
            raise ValueError(f"{path} has no usable tokenizer: the judgement reads text and generates answers")
        text = conv_cfg.text or str(fetch_shakespeare())
        texts = _texts(conv_cfg, text, tokenizer, source.get_input_embeddings().num_embeddings)
        with stage("judge: texts, chat answers, long sequences, stress inputs"):
            report = usage_report(
                source, net, tokenizer, texts, Path(text).read_text(errors="replace"), cfg or UsageConfig()
            )
        print(usage_lines(report, markdown))
        (folder / EVALUATION_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _texts(conv_cfg: ConvertConfig, text: str, tokenizer: object, vocab: int) -> dict:
    """The held-out batches of the texts the conversion measured: its own text's, and its second text's."""
    cut = TextCut(conv_cfg.seq_len, n_calib=1, n_held=conv_cfg.sequences)
    texts = {"held-out": text_batches(text, tokenizer, vocab, cut)[1]}
    e = conv_cfg.eval_text
    if e is not None and e.strip().lower() != "none":
        second = str(fetch_docs()) if e == "docs" else e
        texts[f"{DOCS} documentation" if e == "docs" else Path(e).name] = text_batches(second, tokenizer, vocab, cut)[1]
    return texts
