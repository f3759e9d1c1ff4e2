"""``normlab convert`` as one function: check every input, load, convert and calibrate, measure, heal, save.

The command line only parses its flags and calls :func:`convert_model`; a script can call it the same way.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import hashlib
import json
import math
import shlex
import shutil
import sys
from pathlib import Path

from normlab.conversion.convert import convert_norms, fidelity, save_converted
from normlab.conversion.frontier import frontier
from normlab.conversion.heal import DEFAULT_OBJECTIVE, DEFAULT_TRAIN, _check_budget, _identity_difference, heal
from normlab.conversion.hf import load_model, smollm2, text_batches, text_splits
from normlab.conversion.saving import RECORD_FILE
from normlab.corpus import fetch_shakespeare, sha256_file
from normlab.owner import check_writable, hold, inside
from normlab.registry import norm_spec

__all__ = ["convert_model", "check_out", "HEAL_OBJECTIVE", "HEAL_TRAIN"]

HEAL_OBJECTIVE, HEAL_TRAIN = DEFAULT_OBJECTIVE, DEFAULT_TRAIN


def check_out(out: str | None, model: str, overwrite: bool) -> None:
    """Refuse, before any work, an output that is the source model, an existing path, a folder normlab did not
    write (whatever the flags), or a place that cannot be written."""
    if out is None:
        return
    if not str(out).strip():
        raise ValueError("--out is empty; name a folder")
    o, m = Path(out).resolve(), Path(model).resolve()
    src = m.parent if m.is_file() else m
    if o == src or o == m or src.is_relative_to(o) or (m.is_dir() and o.is_relative_to(m)):
        raise ValueError(f"--out {out} would write over or inside the source model {model}; choose another folder")
    if o.exists() and not overwrite:
        raise ValueError(f"--out {out} already exists; choose a new folder, or pass --overwrite to replace it")
    if o.exists():
        if not o.is_dir():
            raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
        if any(o.iterdir()) and not (o / RECORD_FILE).is_file():
            raise ValueError(f"--out {out} holds files that normlab did not write (no {RECORD_FILE}); it is never "
                             "cleared, whatever the flags. Choose another --out")  # fmt: skip
    check_writable(o, "--out")


def _check_heal_options(heal_minutes, heal_tokens, heal_train: str, heal_objective: str, checkpoint, resume: bool,
                        out, inputs: list) -> str | None:  # fmt: skip
    """The heal's flags, checked before any work; returns the checkpoint path the heal will use."""
    budget = heal_minutes is not None or heal_tokens is not None
    if not budget:
        flags = (("--heal-objective", heal_objective != HEAL_OBJECTIVE), ("--heal-train", heal_train != HEAL_TRAIN),
                 ("--resume", resume), ("--checkpoint", checkpoint is not None))  # fmt: skip
        given = [flag for flag, on in flags if on]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a heal: give a "
                             "budget (--heal-minutes or --heal-tokens), or drop it")  # fmt: skip
        return None
    _check_budget(heal_minutes, heal_tokens, heal_train, heal_objective, False, None)
    ckpt = checkpoint or (f"{Path(out)}.heal.pt" if out else None)  # Path: "DIR/" and "DIR" name one folder
    if ckpt is None:
        if resume:
            raise ValueError("--resume needs the heal checkpoint: pass --checkpoint PATH (or --out, whose default "
                             "checkpoint is OUT.heal.pt)")  # fmt: skip
        return None
    hit = inside(ckpt, *inputs, out)
    if hit is not None:
        raise ValueError(f"--checkpoint {ckpt} would write over or inside an input or the output ({hit}); choose "
                         "another path")  # fmt: skip
    p = Path(ckpt)
    if p.is_dir():
        raise ValueError(f"--checkpoint {ckpt} is a folder; name a file")
    if resume and not p.is_file():
        raise ValueError(f"--resume: there is no heal checkpoint at {ckpt}; drop --resume to start the heal")
    if p.exists() and not resume:
        raise ValueError(f"--checkpoint {ckpt} already exists; pass --resume to continue that heal, or choose "
                         "another path (it is never overwritten)")  # fmt: skip
    check_writable(p, "--checkpoint")
    return ckpt


def _check_numbers(seq_len: int, sequences: int, heal_minutes: float | None, heal_tokens: int | None,
                   budget_nats: float | None, no_calibrate: bool) -> None:  # fmt: skip
    for flag, value, least in (("--seq-len", seq_len, 2), ("--sequences", sequences, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if heal_minutes is not None and heal_tokens is not None:
        raise ValueError("give one heal budget: --heal-minutes or --heal-tokens")
    for flag, value in (("--heal-minutes", heal_minutes), ("--heal-tokens", heal_tokens)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a finite number > 0, got {value}")
    if budget_nats is not None:
        if not (budget_nats >= 0 and math.isfinite(budget_nats)):
            raise ValueError(f"--budget-nats must be a finite number >= 0 (nats of held-out cross-entropy), got "
                             f"{budget_nats}")  # fmt: skip
        if no_calibrate:
            raise ValueError("--budget-nats ranks calibrated sites; drop --no-calibrate")


def _check_target(to: str, no_calibrate: bool, init: dict) -> None:
    """--to, its calibration and --init, checked as flags before the model is loaded: a target with no parameter to
    fit needs --no-calibrate; --init values must build the norm; NORMLAB_KERNEL must be valid."""
    from normlab.conversion.convert import CALIBRATABLE
    from normlab.kernels import auto_choice
    from normlab.registry import create_norm

    norm_spec(to)
    auto_choice()
    if not no_calibrate and to not in CALIBRATABLE:
        raise ValueError(f"--to {to}: calibration fits the parameter of {', '.join(CALIBRATABLE)}; {to} has none "
                         "to fit: pass --no-calibrate (the new norms keep their default init)")  # fmt: skip
    try:
        create_norm(to, 8, **init)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--init {' '.join(f'{k}={v}' for k, v in init.items())}: {e}") from None


def _check_resume_identity(ckpt: str | None, resume: bool, identity: dict) -> None:
    """Before the expensive work: a heal checkpoint to resume from must record the same identity (the keys
    given; the model's fingerprint is checked once the model is loaded). The checkpoint is memory-mapped, so
    this reads only its small parts."""
    import torch

    if not (resume and ckpt):
        return
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True).get("identity")
    except Exception:  # noqa: BLE001  (heal's own load names a corrupt file)
        return
    diff = _identity_difference(saved, identity, keys=identity)
    if diff:
        raise ValueError(f"--resume: checkpoint {ckpt} was made from another model, text or settings ({diff}); "
                         "resume with the same ones, or start afresh with another --checkpoint")  # fmt: skip


def _file_sha(path) -> str:
    return sha256_file(Path(path))[:16]


def _fingerprint(net) -> str:
    """A content hash of the model's input embedding: tells two models apart without hashing every weight."""
    w = net.get_input_embeddings().weight.detach().float().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def _resume_command(ckpt: str) -> str:
    argv = [a for a in sys.argv[1:] if a != "--resume"] if sys.argv[1:2] == ["convert"] else []
    if not argv:
        return f"the same call with resume=True and checkpoint={ckpt!r}"
    if "--checkpoint" not in argv:
        argv += ["--checkpoint", ckpt]
    return shlex.join(["normlab", *argv, "--resume"])


def heal_summary(rep) -> str:
    """One line on a heal: tokens, minutes, how much of the stream, and the validation curve's start and kept point."""
    line = (f"healed ({rep.objective}, {rep.train}): {rep.tokens:,} tokens in {rep.seconds / 60:.1f} min, "
            f"{rep.sequences:,} stream sequences ({rep.stream_passes:.2f} passes)")  # fmt: skip
    if rep.curve and rep.best is not None:
        line += (f"; validation CE {rep.curve[0]['val_ce']:.3f} at the start, best {rep.best['val_ce']:.3f} at "
                 f"{rep.best['tokens']:,} tokens (kept), last {rep.curve[-1]['val_ce']:.3f}")  # fmt: skip
    return line


def write_curve(rep, folder: Path) -> None:
    """The heal's validation curve as heal_curve.csv and heal_curve.png in ``folder``."""
    import csv

    if not rep.curve:
        return
    keys = list(dict.fromkeys(k for p in rep.curve for k in p))
    with open(folder / "heal_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rep.curve)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    toks = [p["tokens"] for p in rep.curve]
    ax.plot(toks, [p["val_ce"] for p in rep.curve], marker=".", label="validation CE")
    if rep.best is not None:
        ax.axvline(rep.best["tokens"], color="green", ls=":", label="kept")
    handles = ax.get_legend_handles_labels()
    tl = [(p["tokens"], p["train_loss"]) for p in rep.curve if p["train_loss"] == p["train_loss"]]
    if tl:
        ax2 = ax.twinx()
        what = "KL" if rep.objective == "distill" else "block rel. error"
        ax2.plot(*zip(*tl), color="grey", lw=0.8, label=f"train loss ({what})")
        ax2.set_ylabel(f"train loss ({what})")
        handles = [a + b for a, b in zip(handles, ax2.get_legend_handles_labels())]
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("validation CE (nats/token)")
    ax.set_title(f"heal: {rep.objective}, {rep.train}")
    ax.legend(*handles, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(folder / "heal_curve.png", dpi=110)
    plt.close(fig)


def fidelity_line(fid: dict, n: int) -> str:
    line = (f"\nfidelity on {n} held-out sequences: output cosine {fid['output_cosine']:.4f}, "
            f"mean site error {fid['mean_site_error']:.4f}")  # fmt: skip
    if "kl" in fid:
        line += f", KL {fid['kl']:.4g} nats/token"
    if "ce_original" in fid:
        line += f"; cross-entropy {fid['ce_original']:.3f} (original) -> {fid['ce_converted']:.3f} nats/token"
    return line


def convert_model(model: str, to: str = "dyisru", *, calibrate: str | None = None, no_calibrate: bool = False,
                  per: str = "global", first_token: str = "auto", exclude: list[str] = (), init: dict | None = None,
                  seq_len: int = 128, sequences: int = 32, heal_minutes: float | None = None,
                  heal_tokens: int | None = None, heal_train: str = HEAL_TRAIN, heal_objective: str = HEAL_OBJECTIVE,
                  budget_nats: float | None = None, checkpoint: str | None = None, resume: bool = False,
                  out: str | None = None, overwrite: bool = False, progress: bool = True,
                  markdown: bool = False) -> dict:  # fmt: skip
    """Convert the norms of ``model`` (a Hugging Face folder, a .gguf file, or 'smollm2') to ``to``; print the
    per-site table and the fidelity; heal within a budget if one is given; save to ``out``. Returns the fidelity.

    ``budget_nats``: convert only the sites that fit, cheapest first, within that rise of the held-out
    cross-entropy (:mod:`normlab.conversion.frontier`); the others stay as they are. The heal trains on a
    stream of the text (every sequence but the held-out and validation ones) and keeps its best state on the
    validation split; its curve is written to OUT/heal_curve.csv and OUT/heal_curve.png.

    Every flag is checked before the model is loaded; ``out`` (and the heal checkpoint) are owned by this process
    for the whole job, so a second convert to the same place is refused."""
    _check_target(to, no_calibrate, init or {})  # bad input fails before the model is loaded
    _check_numbers(seq_len, sequences, heal_minutes, heal_tokens, budget_nats, no_calibrate)
    if calibrate is not None and not Path(calibrate).is_file():
        what = "is a folder" if Path(calibrate).is_dir() else "does not exist"
        raise FileNotFoundError(f"--calibrate {calibrate} {what}; give a text file")
    model_path = str(smollm2()) if model == "smollm2" else model
    if not Path(model_path).exists():
        raise FileNotFoundError(f"--model {model}: no such folder or .gguf file")
    check_out(out, model_path, overwrite)
    ckpt = _check_heal_options(heal_minutes, heal_tokens, heal_train, heal_objective, checkpoint, resume, out,
                               [model_path, calibrate])  # fmt: skip
    with contextlib.ExitStack() as owned:
        if out:
            owned.enter_context(hold(out, "--out"))
            check_out(out, model_path, overwrite)  # again, now that it is ours: another process may have finished
        if ckpt:
            owned.enter_context(hold(ckpt, "--checkpoint"))
        return _convert(model, model_path, to, calibrate, no_calibrate, per, first_token, exclude, init or {},
                        seq_len, sequences, heal_minutes, heal_tokens, heal_train, heal_objective, budget_nats, ckpt,
                        checkpoint, resume, out, overwrite, progress, markdown)  # fmt: skip


def _convert(model, model_path, to, calibrate, no_calibrate, per, first_token, exclude, init, seq_len, sequences,
             heal_minutes, heal_tokens, heal_train, heal_objective, budget_nats, ckpt, checkpoint, resume, out,
             overwrite, progress, markdown) -> dict:  # fmt: skip
    text = calibrate or fetch_shakespeare()
    settings = {"model": str(Path(model_path).resolve()), "text_sha256": _file_sha(text), "to": to, "per": per,
                "first_token": first_token, "exclude": sorted(exclude), "init": init, "seq_len": seq_len,
                "sequences": sequences, "calibrated": not no_calibrate, "heal_train": heal_train,
                "heal_objective": heal_objective, "budget_nats": budget_nats}  # fmt: skip
    _check_resume_identity(ckpt, resume, settings)
    from normlab.kernels import auto_choice, cpu

    if auto_choice() != "reference":
        cpu.ready(wait=True)  # the one-time build of the CPU kernels (if any) now, so every pass takes one path
    net, tokenizer = load_model(model_path)
    if exclude:
        names = [n for n, _ in net.named_modules()]
        idle = [pat for pat in exclude if not any(fnmatch.fnmatch(n, pat) for n in names)]
        if idle:
            raise ValueError(f"--exclude {idle[0]!r} matches no module of {model}; module names look like "
                             f"{', '.join(n for n in names if n.endswith('norm'))[:200]}")  # fmt: skip
    _check_resume_identity(ckpt, resume, {"model_fingerprint": _fingerprint(net)})
    vocab = net.get_input_embeddings().num_embeddings
    if tokenizer is None:
        print(f"{model} has no tokenizer: using byte values mod {vocab} as token ids")
    healing = heal_minutes is not None or heal_tokens is not None
    if healing:
        splits = text_splits(text, tokenizer, vocab, seq_len, sequences, sequences)
        calib, held = splits.calib, splits.held
    else:
        calib, held = text_batches(text, tokenizer, vocab, seq_len, sequences, sequences)
    identity = {**settings, "model_fingerprint": _fingerprint(net)}
    original = copy.deepcopy(net)
    include = (lambda name, m: not any(fnmatch.fnmatch(name, pat) for pat in exclude)) if exclude else None
    n_calib, n_held = sum(len(b) for b in calib), sum(len(b) for b in held)
    if budget_nats is not None:
        front, record = frontier(net, to, calib, held, budget_nats=budget_nats, per=per, init=init, include=include,
                                 first_token=first_token, progress=progress)  # fmt: skip
        print(f"--budget-nats {budget_nats:g}: {len(front.converted)} of {len(front.order)} norms fit "
              f"(held-out cross-entropy {front.ce_original:.3f} -> {front.curve[-1]:.3f}); converted, cheapest "
              f"first: {', '.join(front.converted) or 'none'}\n")  # fmt: skip
    else:
        record = convert_norms(net, to, calibrate=None if no_calibrate else calib, per=per, init=init,
                               include=include, first_token=first_token, progress=progress)  # fmt: skip
    print(f"converted {len(record.sites)} norms of {type(net).__name__} to {to} "
          f"({'calibrated on ' + str(n_calib) + ' sequences' if not no_calibrate else 'default init'})\n")
    print(record.table(markdown=markdown))
    fid = fidelity(original, net, held, record)
    print(fidelity_line(fid, n_held))
    rep = None
    if healing and not record.sites:
        print("\nnothing converted: no heal")
    elif healing:
        try:
            rep = heal(original, net, splits.stream, record, val=splits.val, minutes=heal_minutes, tokens=heal_tokens,
                       objective=heal_objective, train=heal_train, checkpoint=ckpt, resume=resume,
                       identity=identity, progress=progress)  # fmt: skip
        except KeyboardInterrupt:
            if ckpt is not None and Path(ckpt).is_file():
                print(f"\nheal interrupted; its checkpoint is {ckpt}. Continue with: {_resume_command(ckpt)}",
                      file=sys.stderr)  # fmt: skip
            raise
        print(f"\n{heal_summary(rep)}")
        fid = fidelity(original, net, held, record)
        fid["heal"] = rep.to_dict()
        print(fidelity_line(fid, n_held))
    if out:
        if overwrite and Path(out).exists():
            shutil.rmtree(out)  # a normlab conversion (check_out made sure), replaced only now that the new one is done
        save_converted(net, record, out, tokenizer=tokenizer, identity=identity)
        (Path(out) / "fidelity.json").write_text(json.dumps(fid, indent=2) + "\n")
        if rep is not None:
            write_curve(rep, Path(out))
        print(f"saved to {out} (load with normlab.load_converted)")
        if ckpt is not None and checkpoint is None:  # the default heal checkpoint has served its purpose
            Path(ckpt).unlink(missing_ok=True)
    return fid
