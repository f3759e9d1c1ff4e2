"""``normlab evaluate DIR``: a converted folder judged as it will be used (`normlab.conversion.measure.usage`), against
the
original it was made from, on the texts its conversion measured. The result is printed and written to
``DIR/evaluation.json``."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from normlab.conversion.config import ConvertConfig
from normlab.conversion.data.models import TextCut, fixture_path, load_model, text_batches, usable_tokenizer
from normlab.conversion.export.saving import RECORD_FILE, load_converted, read_record
from normlab.conversion.measure.fidelity import predicts_next_token
from normlab.conversion.measure.usage import UsageConfig, usage_lines, usage_report
from normlab.conversion.stages import Stages
from normlab.conversion.workflow import CONFIG_FILE, model_fingerprint
from normlab.corpus import DOCS, fetch_docs, fetch_shakespeare, sha256_file
from normlab.errors import NormlabError
from normlab.owner import check_writable, hold, replace_text

__all__ = ["EVALUATION_FILE", "evaluate_folder", "original_of", "provenance"]

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
    record = read_record(folder)
    cfg_file = folder / CONFIG_FILE
    try:
        cfg = ConvertConfig.from_dict(json.loads(cfg_file.read_text())) if cfg_file.is_file() else ConvertConfig()
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is damaged ({e}); convert the model again") from None
    path = original or record.get("made_from", {}).get("model")
    if path is None:
        raise ValueError(f"{where} names no original (made_from.model): pass --original PATH")
    path = fixture_path(path)
    given = "--original" if original else f"{RECORD_FILE}: made_from.model"
    if not Path(path).exists():
        raise FileNotFoundError(
            f"the original {path} ({given}) does not exist: pass --original with the model the folder was "
            "converted from"
        )
    if (Path(path) / RECORD_FILE).is_file():  # a conversion (the folder itself, or another) is never an original
        made = record.get("made_from", {}).get("model", "?")
        raise ValueError(
            f"the original {path} ({given}) is a normlab conversion (it holds {RECORD_FILE}), not an original: "
            f"transformers would load its gammas as RMSNorm weights. Pass --original with the model {folder} was "
            f"converted from ({made})"
        )
    check_writable(folder / EVALUATION_FILE, "the report")  # before minutes of judging, not after
    return path, record, cfg


def provenance(path: str, source: nn.Module) -> dict:
    """What an evaluation was judged against: the original's resolved path, the SHA-256 of its weight files (a
    folder's safetensors or .bin, or the .gguf itself) and its architecture.

    Args:
        path: The original's path.
        source: The original, loaded.
    """
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted([*p.glob("*.safetensors"), *p.glob("*.bin")])
    arch = getattr(getattr(source, "config", None), "architectures", None) or [type(source).__name__]
    return {"path": str(p), "weights_sha256": {f.name: sha256_file(f) for f in files}, "architecture": arch[0]}


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
            raise ValueError(
                f"{path} has no usable tokenizer (no tokenizer files beside its weights), and the judgement reads text "
                "and generates answers: save the model's tokenizer there (tokenizer.save_pretrained), or pass "
                "--original a folder of the same model that has one"
            )
        if not predicts_next_token(net):
            raise ValueError(
                f"{folder} holds a {type(net).__name__}, which does not predict the next token: normlab evaluate "
                "judges causal language models (next-token KL, generated answers)"
            )
        text = conv_cfg.data.text or str(fetch_shakespeare())
        texts = _texts(conv_cfg, text, tokenizer, source.get_input_embeddings().num_embeddings)
        with stage("judge: texts, chat answers, long sequences, stress inputs"):
            report = usage_report(
                source, net, tokenizer, texts, Path(text).read_text(errors="replace"), cfg or UsageConfig()
            )
        print(usage_lines(report, markdown))
        report["original"] = provenance(path, source)
        try:  # beside, then into place: a failed write leaves the previous report as it was
            replace_text(folder / EVALUATION_FILE, json.dumps(report, indent=2) + "\n")
        except OSError as e:
            raise NormlabError(
                f"the report {folder / EVALUATION_FILE} could not be written ({e.strerror or e}); the judgement is "
                "printed above"
            ) from None
    return report


def _texts(conv_cfg: ConvertConfig, text: str, tokenizer: object, vocab: int) -> dict:
    """The held-out batches of the texts the conversion measured: its own text's, and its second text's."""
    cut = TextCut(conv_cfg.seq_len, n_calib=1, n_held=conv_cfg.sequences)
    texts = {"held-out": text_batches(text, tokenizer, vocab, cut)[1]}
    e = conv_cfg.data.judge
    if e is not None and e.strip().lower() != "none":
        second = str(fetch_docs()) if e == "docs" else e
        texts[f"{DOCS} documentation" if e == "docs" else Path(e).name] = text_batches(second, tokenizer, vocab, cut)[1]
    return texts
