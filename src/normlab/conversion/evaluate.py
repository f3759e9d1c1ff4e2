"""``normlab evaluate DIR``: a converted folder judged as it will be used (`normlab.conversion.measure.usage`), against
the original it was made from, on the texts its conversion measured (never other ones without a word: a missing
config, a text changed since, or one not found is an error before any model is loaded; ``--text`` names another,
judged under its own name). The result is printed and written to ``DIR/evaluation.json`` (``--report``: elsewhere,
for a folder that cannot be written)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from normlab.conversion.config import ConvertConfig
from normlab.conversion.data.fixtures import fixture_path
from normlab.conversion.data.models import load_model, usable_tokenizer
from normlab.conversion.data.texts import TextCut, text_batches
from normlab.conversion.export.saving import RECORD_FILE, load_converted, read_record
from normlab.conversion.measure.fidelity import predicts_next_token
from normlab.conversion.measure.usage import (
    UsageConfig,
    chat_interval,
    kept_answers,
    paired_chat,
    usage_lines,
    usage_report,
)
from normlab.conversion.stages import Stages
from normlab.conversion.workflow import CONFIG_FILE, model_fingerprint, text_fingerprint
from normlab.corpus import DOCS, fetch_docs, fetch_shakespeare, sha256_file
from normlab.errors import NormlabError
from normlab.owner import check_writable, hold, replace_text

__all__ = ["EVALUATION_FILE", "evaluate_folder", "evaluate_folders", "compare_lines", "original_of", "provenance"]

EVALUATION_FILE = "evaluation.json"


def original_of(folder: Path, original: str | None = None) -> str:
    """The original's path of a converted folder: ``original``, or the one its record names; checked to exist.

    Args:
        folder: A converted model's folder (``normlab convert --out``).
        original: The original model's path; None: the one the folder records.
    """
    return _source(Path(folder), original)[0]


def _source(folder: Path, original: str | None, text: str | None = None) -> tuple[str, dict, ConvertConfig]:
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
    if not cfg_file.is_file() and text is None:
        raise ValueError(
            f"{cfg_file} is missing, so the texts this conversion held out are unknown (judged on others, they would "
            "be called held-out): pass --text FILE, judged under its own name, or convert the model again"
        )
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
    return path, record, cfg


def _judged_text(folder: Path, cfg: ConvertConfig, record: dict, text: str | None) -> tuple[str, str]:
    """The text judged and its name in the report: ``--text`` under its file's name, else the conversion's own
    (``data.text``, else the default corpus) as "held-out", checked to exist and to be the text the conversion held
    out (``made_from.text_sha256``)."""
    if text is not None:
        if not Path(text).is_file():
            raise FileNotFoundError(f"--text {text} is not a file")
        return text, f"given: {Path(text).name}"
    own = cfg.data.text or str(fetch_shakespeare())
    if not Path(own).is_file():
        raise FileNotFoundError(
            f"{folder / CONFIG_FILE}: data.text {own} is not a file here (a path relative to where the conversion "
            "ran, or moved since): pass --text with that text"
        )
    want = record.get("made_from", {}).get("text_sha256")
    if want is not None and text_fingerprint(own) != want:
        raise ValueError(
            f"{own} is not the text {folder} was converted on (its SHA-256 differs from {RECORD_FILE}'s "
            "made_from.text_sha256: edited since), so its held-out split would not be held out: restore it, or pass "
            "--text with it to judge on it under its own name"
        )
    return own, "held-out"


def _report_path(folder: Path, report: str | None) -> Path:
    """Where the report goes (``--report``, else the folder's evaluation.json), checked writable and not a folder."""
    path = Path(report) if report is not None else folder / EVALUATION_FILE
    if path.is_dir():
        raise ValueError(f"the report {path} is a folder: remove it, or pass --report with a file's path")
    try:
        check_writable(path, "the report")  # before minutes of judging, not after
    except ValueError as e:
        raise ValueError(f"{e} (--report PATH writes it elsewhere)") from None
    return path


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
    folder: str | Path,
    original: str | None = None,
    *,
    markdown: bool = False,
    cfg: UsageConfig | None = None,
    text: str | None = None,
    report: str | None = None,
) -> dict:
    """Judge the converted model in ``folder`` against its original (module docstring); returns the report.

    Args:
        folder: A converted model's folder (``normlab convert --out``).
        original: The original model's path; None: the one the folder records.
        markdown: Print the tables as Markdown.
        cfg: What to measure.
        text: A text to judge on instead of the conversion's own held-out split, named as given.
        report: Where the report is written; None: ``folder/evaluation.json``.
    """
    folder = Path(folder)
    path, record, conv_cfg = _source(folder, original, text)
    text, label = _judged_text(folder, conv_cfg, record, text)
    out = _report_path(folder, report)
    stage = Stages(progress=True, prefix="evaluate: ")
    # the folder is held (a convert to it waits) where the report goes into it; a report elsewhere is held itself
    with hold(folder, "the folder") if report is None else hold(out, "the report"):
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
        texts = _texts(conv_cfg, (text, label), tokenizer, source.get_input_embeddings().num_embeddings)
        with stage("judge: texts, chat answers, long sequences, stress inputs"):
            result = usage_report(
                source, net, tokenizer, texts, Path(text).read_text(errors="replace"), cfg or UsageConfig()
            )
        print(usage_lines(result, markdown))
        result["original"] = provenance(path, source)
        try:  # beside, then into place: a failed write leaves the previous report as it was
            replace_text(out, json.dumps(result, indent=2) + "\n")
        except OSError as e:
            raise NormlabError(
                f"the report {out} could not be written ({e.strerror or e}); the judgement is printed above"
            ) from None
    return result


def _texts(conv_cfg: ConvertConfig, text: tuple[str, str], tokenizer: object, vocab: int) -> dict:
    """The held-out batches of the texts the conversion measured: its own text's (or the given one's, by its name),
    and its second text's."""
    cut = TextCut(conv_cfg.seq_len, n_calib=1, n_held=conv_cfg.sequences)
    texts = {text[1]: text_batches(text[0], tokenizer, vocab, cut)[1]}
    e = conv_cfg.data.judge
    if e is not None and e.strip().lower() != "none":
        second = str(fetch_docs()) if e == "docs" else e
        texts[f"{DOCS} documentation" if e == "docs" else Path(e).name] = text_batches(second, tokenizer, vocab, cut)[1]
    return texts


def evaluate_folders(
    folders: list[str | Path], names: list[str] | None = None, *, shown: int = 3, **kwargs: object
) -> dict[str, dict]:
    """Several conversions of one original, each judged by `evaluate_folder` (its report in its own folder), then
    compared (`compare_lines`): their greedy answers side by side and each one's chat score against the first's,
    prompt by prompt. Every folder is checked, and their originals' fingerprints compared, before any model loads.

    Args:
        folders: Converted folders of one original.
        names: A name per folder; None: the folders' names.
        shown: The prompts whose answers are shown side by side.
        **kwargs: `evaluate_folder`'s keywords (``original``, ``cfg``, ``text``, ``markdown``), but ``report``.
    """
    folders = [Path(f) for f in folders]
    names = names or [f.name for f in folders]
    if len(names) != len(folders) or len(set(names)) != len(names):
        raise ValueError(f"--names: give {len(folders)} distinct names, one per folder; got {names}")
    made = {}
    for f in folders:
        _source(f, kwargs.get("original"), kwargs.get("text"))  # every folder's files, before a model loads
        _report_path(f, None)
        made[f] = read_record(f).get("made_from", {}).get("model_fingerprint")
    if len(set(made.values())) > 1:
        raise ValueError(f"the folders were converted from different originals: {made}; compare conversions of one")
    reports = {n: evaluate_folder(f, **kwargs) for n, f in zip(names, folders)}
    if len(reports) > 1:
        print(compare_lines(reports, shown))
    return reports


def _cell(text: str, n: int = 60) -> str:
    one = " ".join(text.split()).replace("|", "\\|")
    return f'"{one}"' if len(one) <= n else f'"{one[: n - 3]}..."'


def compare_lines(reports: dict[str, dict], shown: int = 3) -> str:
    """Judged conversions of one original compared: the first ``shown`` prompts' greedy answers side by side (a
    Markdown table), each one's chat score with its 95% interval, and each against the first prompt by prompt
    (`normlab.conversion.measure.usage.paired_chat`: McNemar's exact test) and by the heal guard's rule on the first
    text (its worst sequence and p99 KL divergence must not rise: a heal's folder against the one before it).

    Args:
        reports: Name -> its `usage_report` (an ``evaluation.json``), judged on the same prompts.
        shown: How many prompts' answers to show.
    """
    gens = {n: r.get("generation") for n, r in reports.items()}
    if any(g is None for g in gens.values()):
        return "no comparison of answers: " + ", ".join(n for n, g in gens.items() if g is None) + " answered none"
    first = next(iter(gens.values()))["answers"]
    if any([a["prompt"] for a in g["answers"]] != [a["prompt"] for a in first] for g in gens.values()):
        return "no comparison of answers: the folders were asked different prompts"
    lines = ["| prompt | original | " + " | ".join(gens) + " |", "|---" * (len(gens) + 2) + "|"]
    for i, a in enumerate(first[:shown]):
        row = [a["prompt"], _cell(a["original"]), *(_cell(g["answers"][i]["converted"]) for g in gens.values())]
        lines.append("| " + " | ".join(row) + " |")
    words = next(iter(reports.values()))["config"]["words"]
    kept = {n: kept_answers(g["answers"], words) for n, g in gens.items()}
    for n, k in kept.items():
        lo, hi = chat_interval(sum(k), len(k))
        lines.append(f"chat score: {n} {sum(k)} of {len(k)} ({sum(k) / len(k):.0%}; 95% interval {lo:.0%}-{hi:.0%})")
    base, *rest = kept
    for n in rest:
        d = paired_chat(kept[base], kept[n])
        lines.append(
            f"{n} against {base}: {d['only_second']} answers kept by {n} alone, {d['only_first']} by {base} alone; "
            f"McNemar's exact p = {d['p']:.2g}"
        )
        lines.append(_tails(n, base, reports))
    return "\n".join(lines)


def _tails(name: str, base: str, reports: dict[str, dict]) -> str:
    """The heal guard's rule (`normlab.conversion.measure.judge.heal_verdict`) between two judged folders on their
    first text: whether ``name`` raised the worst sequence or the p99 KL divergence over ``base``."""
    from normlab.conversion.measure.judge import heal_verdict

    text = next(iter(reports[base]["texts"]))
    after = reports[name]["texts"].get(text)
    if after is None:
        return f"{name} against {base}: not judged on {text}"
    v = heal_verdict(reports[base]["texts"][text], after)
    said = "neither tail rose" if v["kept"] else "; ".join(v["rose"])
    return f"{name} against {base} on {text}, the heal guard's rule: {said}"
