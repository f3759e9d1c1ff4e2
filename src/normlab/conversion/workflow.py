"""``normlab convert`` as one function: check every input, load, convert and calibrate, measure, heal, save.

The command line only resolves its flags and ``--set`` pairs into a `normlab.conversion.config.ConvertConfig`
and calls `convert_model`; a script can call it the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import shlex
import shutil
import sys
from pathlib import Path

from normlab.conversion.batches import sharing_copy
from normlab.conversion.checks import (
    check_checkpoint,
    check_conversion_memory,
    check_exclude,
    check_inputs,
    check_inputs_outside,
    check_next_token,
    check_out,
    check_resume_identity,
)
from normlab.conversion.config import BudgetConfig, ConvertConfig, HealConfig
from normlab.conversion.convert import convert_norms, fidelity, save_converted
from normlab.conversion.data.models import (
    leading_bos,
    load_model,
    quiet,
    usable_tokenizer,
)
from normlab.conversion.data.samples import sample_starts
from normlab.conversion.data.streams import heal_splits, own_samples
from normlab.conversion.data.texts import ConversionTexts, conversion_texts
from normlab.conversion.export.saving import read_record
from normlab.conversion.frontier import FEW_SELECTION, METRICS, frontier
from normlab.conversion.heal.distill import check_heal_resources, heal
from normlab.conversion.heal.report import heal_summary, write_curve
from normlab.conversion.measure.fidelity import ConversionResult, check_result, predicts_next_token
from normlab.conversion.measure.judge import TokenTally
from normlab.conversion.measure.usage import usage_lines, usage_report
from normlab.conversion.stages import Stages, count_every_process, earlier_stages, stages_file
from normlab.corpus import fetch_shakespeare, sha256_file
from normlab.errors import NormlabError
from normlab.owner import beside, check_out_space, hold, restore_swapped, swap_in
from normlab.sites import class_entries

__all__ = ["convert_model", "check_out", "CONFIG_FILE", "model_fingerprint", "text_fingerprint"]

CONFIG_FILE = "convert_config.json"  # the resolved ConvertConfig, beside the record in every output folder


def _judge(fid: dict, inputs: tuple, stages: Stages, markdown: bool) -> None:
    """The judgement as used (`usage_report`) into ``fid``; a failure inside it is said and recorded
    (``usage_error``), and the conversion is saved without it: minutes of conversion are never lost to the judge,
    and ``normlab evaluate`` judges the saved folder again."""
    try:
        with stages("judgement"):
            fid["usage"] = usage_report(*inputs)
    except Exception as e:  # noqa: BLE001  (whatever the judge raises: the conversion itself is done and good)
        fid["usage_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        said = f"the judgement failed ({fid['usage_error']}); the conversion is saved without it: judge it again"
        print(f"\n{said} with normlab evaluate", file=sys.stderr)
        return
    print("\n" + usage_lines(fid["usage"], markdown))


def second_text_line(second: dict) -> str:
    ce = (
        f"cross-entropy {second['ce_original']:.3f} (original) -> {second['ce_converted']:.3f}, "
        if "ce_original" in second
        else ""
    )
    return (
        f"second text ({second['name']}, never calibrated or healed on), {second['sequences']} held-out sequences: "
        f"{ce}KL {second['kl']:.4g} nats/token"
    )


def _measure_second(original, net, texts: ConversionTexts, tally: TokenTally | None) -> dict | None:
    if texts.second is None:
        return None
    f = fidelity(original, net, texts.second, tally=tally)
    kept = {k: f[k] for k in ("ce_original", "ce_converted", "kl") if k in f}  # a masked LM has no cross-entropy
    return {"name": texts.second_name, "sequences": sum(len(b) for b in texts.second), **kept}


def _absolute_texts(d: dict) -> dict:
    """The config as saved: its text files as absolute paths, so that ``normlab evaluate`` run from another folder
    reads the texts this conversion read (a relative ``--calibrate`` otherwise named nothing there)."""
    data = dict(d["data"])
    for key in ("text", "judge"):
        if isinstance(data.get(key), str) and Path(data[key]).is_file():
            data[key] = str(Path(data[key]).resolve())
    return {**d, "data": data}


def text_fingerprint(path: str | Path) -> str:
    """The text's identity a conversion records (``made_from.text_sha256``): the first 16 hex digits of its SHA-256.

    Args:
        path: The text file.
    """
    return sha256_file(Path(path))[:16]


def model_fingerprint(net: object) -> str:
    """A content hash of the model's input embedding: tells two models apart without hashing every weight.

    Args:
        net: A model with ``get_input_embeddings``.
    """
    w = net.get_input_embeddings().weight.detach().float().cpu().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def _resume_command(ckpt: str, out: str | None) -> str:
    """The command that continues an interrupted heal: this one with ``--resume``, and ``--checkpoint`` only where
    the checkpoint is not the one ``--out`` gives by default (OUT.heal.pt)."""
    argv = [a for a in sys.argv[1:] if a != "--resume"] if sys.argv[1:2] == ["convert"] else []
    if not argv:
        return f"the same call with resume=True and checkpoint={ckpt!r}"
    if "--checkpoint" not in argv and (out is None or ckpt != f"{Path(out)}.heal.pt"):
        argv += ["--checkpoint", ckpt]
    return shlex.join(["normlab", *argv, "--resume"])


def fidelity_line(fid: dict, n: int) -> str:
    line = (
        f"\nfidelity on {n} held-out sequences: output cosine {fid['output_cosine']:.4f}, "
        f"mean site error {fid['mean_site_error']:.4f}"
    )
    if "kl" in fid:
        line += f", KL {fid['kl']:.4g} nats/token"
    if "ce_original" in fid:
        line += f"; cross-entropy {fid['ce_original']:.3f} (original) -> {fid['ce_converted']:.3f} nats/token"
    return line


def convert_model(cfg: ConvertConfig, *, progress: bool = True, markdown: bool = False) -> dict:
    """Convert the norms of ``cfg.model`` (a Hugging Face folder, a .gguf file, or 'smollm2') to ``cfg.to``; print
    the per-site table and the fidelity; heal within a budget if one is given; save to ``cfg.out``. Returns the
    fidelity. ``cfg``: a `normlab.conversion.config.ConvertConfig` (``resolve_convert_config`` builds one
    from fields and ``--set`` overrides).

    ``budget.nats``: convert only the sites that fit, cheapest first, within that rise of the held-out
    cross-entropy (`normlab.conversion.frontier`); the others stay as they are. The heal trains on a
    stream of the text (every sequence but the held-out and validation ones) and keeps its best state on the
    validation split; its curve is written to OUT/heal_curve.csv and OUT/heal_curve.png, the resolved config to
    OUT/convert_config.json.

    Every field is checked before the model is loaded; ``out`` (and the heal checkpoint) are owned by this process
    for the whole job, so a second convert to the same place is refused.

    Args:
        cfg: The conversion's config.
        progress: Show progress bars (``--no-progress``: False).
        markdown: Print the tables as Markdown.
    """
    if not isinstance(cfg, ConvertConfig):
        raise TypeError(
            f"convert_model: expected a ConvertConfig (resolve_convert_config(...) builds one), got "
            f"{type(cfg).__name__}"
        )
    cfg.validate()  # bad input fails before the model is loaded
    model_path = check_inputs(cfg)
    check_out(cfg.out, model_path, cfg.overwrite)
    check_inputs_outside(cfg)
    ckpt = check_checkpoint(cfg, [model_path, cfg.data.text])
    with contextlib.ExitStack() as owned:
        if cfg.out:
            owned.enter_context(hold(cfg.out, "--out"))
            if said := restore_swapped(cfg.out):  # a save killed part-way: its folder back before the checks
                print(f"--out: {said}", file=sys.stderr)
            check_out(cfg.out, model_path, cfg.overwrite)  # again, now that it is ours: another process may have ended
        if ckpt:
            owned.enter_context(hold(ckpt, "--checkpoint"))
        return _convert(_Job(cfg, model_path, ckpt, {"model": str(Path(model_path).resolve())}, progress), markdown)


@dataclasses.dataclass(frozen=True)
class _Job:
    """One conversion: its config, the model's path, the heal checkpoint's path (None without an out folder), the
    facts only the run knows (the model's resolved path and fingerprint, the text's hash: part of the heal's
    identity), and whether it shows progress. A fact learnt on the way makes a new job (`knowing`)."""

    cfg: ConvertConfig
    model_path: str
    ckpt: str | None
    facts: dict
    progress: bool

    def identity(self) -> dict:
        return self.cfg.identity(**self.facts)

    def knowing(self, **facts: str) -> _Job:
        return dataclasses.replace(self, facts={**self.facts, **facts})


def _convert(job: _Job, markdown: bool) -> dict:
    cfg, ckpt, progress = job.cfg, job.ckpt, job.progress
    model_path = job.model_path
    stages = Stages()
    text = cfg.data.text or fetch_shakespeare()
    job = job.knowing(text_sha256=text_fingerprint(text))
    check_resume_identity(ckpt, cfg, job.identity())
    from normlab.kernels import auto_choice, cpu

    with stages("load"):
        if auto_choice() != "reference":
            cpu.ready(wait=True)  # the one-time build of the CPU kernels (if any) now, so every pass takes one path
        net, tokenizer = load_model(model_path, progress=progress)
        net = net.to(cfg.device)  # every stage runs where the model is (batches follow it: run_batch)
    check_exclude(cfg, net)
    check_next_token(cfg, net)
    check_conversion_memory(net)
    check_out_space(cfg.out, net, tokenizer=tokenizer)  # before the work: the save is its last step
    job = job.knowing(model_fingerprint=model_fingerprint(net))
    check_resume_identity(ckpt, cfg, {"model_fingerprint": job.facts["model_fingerprint"]})
    vocab = net.get_input_embeddings().num_embeddings
    if cfg.heal.budgeted:  # its memory and LoRA rank, before the calibration it follows
        check_heal_resources(cfg.heal, net, cfg.seq_len, vocab)
    if tokenizer is None:
        print(f"{cfg.model} has no tokenizer: using byte values mod {vocab} as token ids")
    with stages("load"):
        texts = conversion_texts(cfg, text, tokenizer, vocab)
    starts = sample_starts(tokenizer, cfg.data.starts == "varied")
    if cfg.data.converts_on_samples:
        with stages("samples"):
            own = own_samples(net, cfg.data, cfg.seq_len, starts=starts, progress=progress)  # drawn once, cached
            texts = texts.on_samples(cfg.data, own, cfg.sequences)
    original = sharing_copy(net)  # its own norms, the weight matrices shared: conversion swaps modules
    with stages("budget walk" if cfg.budget.nats is not None else "calibration"):
        record, walk = _convert_sites(cfg, net, texts, progress)
    print(record.table(markdown=markdown))
    _refuse_empty(cfg, record)
    judging = bool(record.sites) and usable_tokenizer(tokenizer) and predicts_next_token(net)
    with stages("measurement"):
        fid, tallies = _measure(original, net, texts, record, judging)
    rep = None
    if cfg.heal.budgeted:
        with stages("samples") if cfg.data.heals_on_samples else contextlib.nullcontext():
            splits = heal_splits(texts.splits, original, cfg.data, starts=starts, progress=progress)
        # a resumed heal: what the processes before this one spent
        earlier = earlier_stages(job.ckpt, job.cfg.heal.resume, stages)
        with stages("heal"):
            rep, guard = _guarded_heal(job, original, net, splits, record, tokenizer)
        count_every_process(stages, earlier)
        before = fid
        with stages("measurement"):
            fid, tallies = _measure(original, net, texts, record, judging)
        fid["heal"] = {**rep.to_dict(), "guard": guard}
        fid["before_heal"] = {k: before[k] for k in ("ce_converted", "kl") if k in before}
        if "second_text" in before:
            fid["before_heal"]["second_text"] = before["second_text"]
    if walk is not None:  # after the heal's measurement, which starts a new record
        fid["budget_walk"] = walk
    if record.calibration:
        fid["calibration"] = record.calibration
    if judging:
        _judge(fid, (original, net, tokenizer, tallies, Path(text).read_text(errors="replace")), stages, markdown)
    fid["stages"], fid["stage_peak_gb"] = stages.seconds, stages.peak_gb
    fid["bos_every_sequence"] = leading_bos(tokenizer) is not None
    fid["parameters"] = sum(p.numel() for p in original.parameters())  # the float32 model: 4 bytes each
    print(f"\n{stages.line()} (the float32 model: {fid['parameters'] * 4 / 1e9:.2f} GB)")
    if cfg.out:
        with quiet(not progress):
            _save(job, net, record, tokenizer, fid, rep)
    if ckpt is not None:  # the job is whole: every process's count is in its record
        stages_file(ckpt).unlink(missing_ok=True)
    if cfg.out:
        if ckpt is not None and cfg.heal.checkpoint is None:  # the default heal checkpoint has served its purpose
            Path(ckpt).unlink(missing_ok=True)
        elif ckpt is not None and Path(ckpt).is_file():
            print(f"the heal checkpoint {ckpt} is kept, as --checkpoint named it; {cfg.out} holds the result")
    return fid


def _refuse_empty(cfg: ConvertConfig, record) -> None:
    """A conversion that converted no site (a walk that kept every one) is refused: there is no model to judge, nor a
    folder that would load (the modeling file refuses an empty site list)."""
    if record.sites:
        return
    why = "no site was converted"
    if cfg.budget.nats is not None:
        nats = cfg.budget.nats
        why = f"the budget walk left every site as it was: each one tried took the model past --budget-nats {nats:g}"
    raise NormlabError(
        f"nothing converted: {why}; there is no conversion to judge or save. Raise --budget-nats, or convert without it"
    )


def _measure(original, net, texts: ConversionTexts, record, judging: bool) -> tuple[dict, dict]:
    """Fidelity on the held-out part of the text, and on the second text when there is one; printed. With
    ``judging``, the same pass fills each text's `TokenTally` for the judgement (name -> tally; else name ->
    batches)."""
    tallies = {name: TokenTally() if judging else batches for name, batches in texts.judged().items()}
    fid = fidelity(original, net, texts.held, record, tally=tallies["held-out"] if judging else None)
    print(fidelity_line(fid, sum(len(b) for b in texts.held)))
    second = _measure_second(original, net, texts, tallies.get(texts.second_name) if judging else None)
    if second is not None:
        fid["second_text"] = second
        print(second_text_line(second))
    return fid, tallies


def _convert_sites(cfg: ConvertConfig, net, texts: ConversionTexts, progress: bool):
    """The conversion itself (every site, or the frontier's within ``budget.nats``); prints what it did. Returns
    the record and, for a budget, what the walk saw. The budget walk decides on the validation split (text the heal
    never trains on and the held-out measurement never reuses), so the held-out cross-entropy printed after it is
    an honest estimate, not the number the walk was chosen to keep under the budget."""
    c, b, calib = cfg.calibrate, cfg.budget, texts.calib
    select = texts.selection()
    sites_cfg = dataclasses.replace(cfg, heal=HealConfig(), budget=BudgetConfig())  # what convert_norms runs
    include = (lambda name, m: not any(fnmatch.fnmatch(name, pat) for pat in cfg.exclude)) if cfg.exclude else None
    extra = {"extra_classes": class_entries(cfg.extra_classes)} if cfg.extra_classes else {}
    if b.nats is not None:
        front, record = frontier(
            net,
            cfg.to,
            calib,
            select,
            budget=b,
            config=sites_cfg,
            include=include,
            progress=progress,
            **extra,
        )  # the frontier ranks on independent fits
        n_select = sum(len(b) for b in select)
        print(
            f"--budget-nats {b.nats:g}: {len(front.converted)} of {len(front.order)} norms fit "
            f"({METRICS[front.metric]} on the {n_select} {cfg.data.selection_words()} that select them "
            f"{front.ce_original:.3f} -> "
            f"{front.curve[-1]:.3f} in {front.precision.split(' (')[0]}"
            + (f", on one position in {front.every[1]}" if front.every[1] > 1 else "")
            + "; the held-out sequences below decide nothing); "
            "converted, cheapest "
            f"first: {', '.join(front.converted) or 'none'}"
            + (f"; went past {len(front.passed)} over the budget" if front.passed else "")
            + "\n"
        )
        if n_select < FEW_SELECTION:
            print(
                f"note: {n_select} validation sequences are few to select {len(front.converted)} sites by: the "
                "held-out rise below can end well above the budget (see 'Selecting on few sequences' in the "
                f"conversion docs); --sequences {FEW_SELECTION} or more selects better\n"
            )
        walk = {"budget_nats": b.nats, "metric": b.metric, "text": cfg.data.walk, "selection_sequences": n_select,
                "ce_original": front.ce_original, "ce_converted": front.curve[-1],
                "converted": len(front.converted), "sites": len(front.order), "precision": front.precision,
                "every": list(front.every), "stage_seconds": {k: round(v, 1) for k, v in front.stage_seconds.items()},
                "walk": {"kept": front.converted, "curve": front.curve, "passed": front.passed,
                         "deferred": front.deferred, "costs": front.costs,
                         "seconds": round(front.seconds, 1)}}  # fmt: skip
    else:
        record = convert_norms(
            net, calibrate=calib if c.enabled else None, config=sites_cfg, include=include, progress=progress, **extra
        )
        walk = None
    n_calib = sum(len(b) for b in calib)
    how = f"calibrated on {n_calib} sequences {cfg.data.calibration_words()}" if c.enabled else "default init"
    print(f"converted {len(record.sites)} norms of {type(net).__name__} to {cfg.to} ({how})\n")
    return record, walk


def _guarded_heal(job: _Job, original, net, splits, record, tokenizer):
    """The heal, kept only when it raises neither the worst sequence nor the p99 KL divergence on the validation
    split and its variants (`normlab.conversion.measure.judge.heal_verdict`); else the model goes back to its state
    before."""
    from normlab.conversion.measure.judge import guard_items, guard_prefixes, heal_verdict, judge_tokens

    items = guard_items(splits.val, guard_prefixes(tokenizer if usable_tokenizer(tokenizer) else None))
    before = judge_tokens(original, net, items)
    # what the heal may write in place, copied; a matrix it can only replace (a LoRA merge), referenced
    copied = job.cfg.heal.train == "all"
    snapshot = {k: v.detach().clone() if copied or v.dim() < 2 else v.detach() for k, v in net.state_dict().items()}
    rep = _heal(job, original, net, splits, record)
    verdict = heal_verdict(before, judge_tokens(original, net, items))
    if not verdict["kept"]:
        net.load_state_dict(snapshot)
        print(
            f"heal not kept: on the validation split it raised the {'; the '.join(verdict['rose'])}; the model "
            "is the calibrated one"
        )
    return rep, verdict


def _heal(job: _Job, original, net, splits, record):
    ckpt = job.ckpt
    heal_cfg = dataclasses.replace(job.cfg.heal, checkpoint=ckpt)
    try:
        rep = heal(original, net, splits, record, heal_cfg, identity=job.identity(), progress=job.progress)
    except KeyboardInterrupt:
        if ckpt is not None and Path(ckpt).is_file():
            print(
                f"\nheal interrupted; its checkpoint is {ckpt}. Continue with: {_resume_command(ckpt, job.cfg.out)}",
                file=sys.stderr,
            )
        raise
    print(f"\n{heal_summary(rep)}")
    return rep


def _save(job: _Job, net, record, tokenizer, fid: ConversionResult, rep) -> None:
    """Write the conversion into a folder beside ``--out`` and move it into place (`normlab.owner.swap_in`): a
    failure at any point (a full disk, a kill) leaves the previous output as it was, and what a kill left beside it
    is put right by the next run (`restore_swapped`; this process owns ``--out`` and so these names)."""
    cfg, identity = job.cfg, job.identity()
    out = Path(cfg.out)
    partial = beside(out, "partial")
    check_out_space(cfg.out, net, tokenizer=tokenizer)
    check_result(fid)  # every key declared (a normlab defect otherwise, found by the tests of each path)
    try:
        save_converted(net, record, partial, tokenizer=tokenizer, identity=identity)
        (partial / CONFIG_FILE).write_text(json.dumps(_absolute_texts(cfg.to_dict()), indent=2) + "\n")
        (partial / "fidelity.json").write_text(json.dumps(fid, indent=2) + "\n")
        if rep is not None:
            write_curve(rep, partial)
    except Exception as e:
        shutil.rmtree(partial, ignore_errors=True)
        kept = f"the previous {out} is as it was" if out.exists() else f"nothing was left at {out}"
        raise NormlabError(
            f"--out {out}: writing the conversion failed ({type(e).__name__}: {str(e)[:300]}); {kept}. The "
            "judgement above is in this output; free some space or fix the folder, then convert again"
        ) from e
    swap_in(partial, out)
    how = read_record(out)["portable"]  # without normlab too, where an Auto class can
    auto = f"{how['auto_classes'][0]}.from_pretrained(..., trust_remote_code=True) or " if how["auto_classes"] else ""
    print(f"saved to {cfg.out} (load with {auto}normlab.load_converted; its config is {CONFIG_FILE})")
