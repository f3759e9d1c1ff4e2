"""``normlab convert`` as one function: check every input, load, convert and calibrate, measure, heal, save.

The command line only parses its flags and calls :func:`convert_model`; a script can call it the same way.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from pathlib import Path

from normlab.conversion.convert import convert_norms, fidelity, save_converted
from normlab.conversion.heal import heal
from normlab.conversion.hf import load_model, smollm2, text_batches
from normlab.corpus import fetch_shakespeare
from normlab.registry import norm_spec

__all__ = ["convert_model", "check_out"]


def check_out(out: str | None, model: str, overwrite: bool) -> None:
    """Refuse, before any work, an output that is the source model or an existing path."""
    if out is None:
        return
    o, m = Path(out).resolve(), Path(model).resolve()
    src = m.parent if m.is_file() else m
    if o == src or o == m or src.is_relative_to(o) or (m.is_dir() and o.is_relative_to(m)):
        raise ValueError(f"--out {out} would write over or inside the source model {model}; choose another folder")
    if o.exists() and not overwrite:
        raise ValueError(f"--out {out} already exists; choose a new folder, or pass --overwrite to replace it")


def _check_numbers(seq_len: int, sequences: int, heal_minutes: float | None, heal_tokens: int | None) -> None:
    for flag, value, least in (("--seq-len", seq_len, 2), ("--sequences", sequences, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if heal_minutes is not None and heal_tokens is not None:
        raise ValueError("give one heal budget: --heal-minutes or --heal-tokens")
    for flag, value in (("--heal-minutes", heal_minutes), ("--heal-tokens", heal_tokens)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")


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
                  heal_tokens: int | None = None, heal_train: str = "norms", distill: float = 0.0,
                  checkpoint: str | None = None, resume: bool = False, out: str | None = None,
                  overwrite: bool = False, progress: bool = True, markdown: bool = False) -> dict:  # fmt: skip
    """Convert the norms of ``model`` (a Hugging Face folder, a .gguf file, or 'smollm2') to ``to``; print the
    per-site table and the fidelity; heal within a budget if one is given; save to ``out``. Returns the fidelity."""
    norm_spec(to)  # bad input fails before the model is loaded
    _check_numbers(seq_len, sequences, heal_minutes, heal_tokens)
    model_path = str(smollm2()) if model == "smollm2" else model
    check_out(out, model_path, overwrite)
    from normlab.kernels import cpu

    cpu.ready(wait=True)  # the one-time build of the CPU kernels (if any) now, so every pass takes one path
    net, tokenizer = load_model(model_path)
    vocab = net.get_input_embeddings().num_embeddings
    if tokenizer is None:
        print(f"{model} has no tokenizer: using byte values mod {vocab} as token ids")
    text = calibrate or fetch_shakespeare()
    calib, held = text_batches(text, tokenizer, vocab, seq_len, sequences, sequences)
    original = copy.deepcopy(net)
    include = (lambda name, m: not any(fnmatch.fnmatch(name, pat) for pat in exclude)) if exclude else None
    record = convert_norms(net, to, calibrate=None if no_calibrate else calib, per=per, init=init or {},
                           include=include, first_token=first_token, progress=progress)  # fmt: skip
    n_calib, n_held = sum(len(b) for b in calib), sum(len(b) for b in held)
    print(f"converted {len(record.sites)} norms of {type(net).__name__} to {to} "
          f"({'calibrated on ' + str(n_calib) + ' sequences' if not no_calibrate else 'default init'})\n")
    print(record.table(markdown=markdown))
    fid = fidelity(original, net, held, record)
    print(fidelity_line(fid, n_held))
    ckpt = None
    if heal_minutes is not None or heal_tokens is not None:
        ckpt = checkpoint or (f"{out}.heal.pt" if out else None)
        rep = heal(original, net, calib, record, minutes=heal_minutes, tokens=heal_tokens, train=heal_train,
                   distill=distill, checkpoint=ckpt, resume=resume, progress=progress)  # fmt: skip
        print(f"\nhealed: {rep.tokens:,} tokens in {rep.seconds / 60:.1f} min "
              f"({sum(b['kept'] for b in rep.blocks)} of {len(rep.blocks)} blocks improved)")
        fid = fidelity(original, net, held, record)
        fid["heal"] = rep.to_dict()
        print(fidelity_line(fid, n_held))
    if out:
        save_converted(net, record, out, tokenizer=tokenizer)
        (Path(out) / "fidelity.json").write_text(json.dumps(fid, indent=2) + "\n")
        print(f"saved to {out} (load with normlab.load_converted)")
        if ckpt is not None and checkpoint is None:  # the default heal checkpoint has served its purpose
            Path(ckpt).unlink(missing_ok=True)
    return fid
