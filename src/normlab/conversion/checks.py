"""Everything ``normlab convert`` checks before it loads the model or writes a file: the output folder and the heal
checkpoint (never over an input, never a folder normlab did not write), the texts and the model the config names,
a checkpoint to resume from, and, once the model is loaded, the exclude patterns and whether the walk and the heal
can measure it. Each refusal names the flag and the fix; nothing is computed before it."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from torch import nn

from normlab.conversion.config import ConvertConfig, flag, identity_difference
from normlab.conversion.data.fixtures import FIXTURES, fixture_path
from normlab.conversion.data.texts import eval_file
from normlab.conversion.export.saving import RECORD_FILE, read_record
from normlab.conversion.measure.fidelity import predicts_next_token
from normlab.corpus import cache_dir
from normlab.errors import check_memory
from normlab.owner import check_writable, inside

# The largest stage peak of a conversion over the float32 model's size, with a margin: Qwen2.5-Coder-0.5B's
# recommended recipe held 8.1 GB of resident memory (3.2x) in its measurement for a model of 2.52 GB, and 9.21 GB
# (3.7x) in a heal that trained every block (heal.early_blocks="trained"; bench/convert_stages.csv; SmolLM2's
# stages: at most 12x its 0.54 GB, the fixed costs of a small model). The fits' rows, the teacher's top-k, the merged
# LoRA weights beside the original's (which otherwise shares the model's matrices) make up the rest.
CONVERSION_PEAK = 3.7

__all__ = ["CONVERSION_PEAK", "check_conversion_memory", "check_out",
           "check_files", "check_checkpoint",
           "check_exclude", "check_inputs", "check_inputs_outside", "check_next_token",
           "check_resume_identity"]  # fmt: skip


def check_out(out: str | None, model: str, overwrite: bool) -> None:
    """Refuse, before any work, an output that is the source model, an existing path, a folder normlab did not
    write (whatever the flags), or a place that cannot be written.

    Args:
        out: The output folder, or None for none.
        model: The source model's path or name.
        overwrite: Whether an existing normlab output may be replaced.
    """
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
    cache = cache_dir().resolve()
    if cache == o or cache.is_relative_to(o):
        raise ValueError(
            f"--out {out} holds normlab's cache ({cache}: NORMLAB_CACHE), which --overwrite would delete with it; "
            "choose another --out, or point NORMLAB_CACHE elsewhere"
        )
    if o.exists():
        if not o.is_dir():
            raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
        if any(o.iterdir()) and not (o / RECORD_FILE).is_file():
            raise ValueError(
                f"--out {out} holds files that normlab did not write (no {RECORD_FILE}); it is never "
                "cleared, whatever the flags. Choose another --out"
            )
    check_writable(o, "--out")


def check_checkpoint(cfg: ConvertConfig, inputs: list) -> str | None:
    """The heal checkpoint's place, checked before any work; returns the path the heal will use.

    Args:
        cfg: The conversion's config.
        inputs: The paths the run reads (the model, the text): the checkpoint may not lie over or inside one.
    """
    h = cfg.heal
    if not h.budgeted:
        return None
    ckpt = h.checkpoint or (f"{Path(cfg.out)}.heal.pt" if cfg.out else None)  # Path: "DIR/" and "DIR" are one folder
    if ckpt is None:
        if h.resume:
            raise ValueError(
                "--resume needs the heal checkpoint: pass --checkpoint PATH (or --out, whose default "
                "checkpoint is OUT.heal.pt)"
            )
        return None
    hit = inside(ckpt, *inputs, cfg.out)
    if hit is not None:
        raise ValueError(
            f"--checkpoint {ckpt} would write over or inside an input or the output ({hit}); choose another path"
        )
    p = Path(ckpt)
    if p.is_dir():
        raise ValueError(f"--checkpoint {ckpt} is a folder; name a file")
    if h.resume and not p.is_file():
        raise ValueError(f"--resume: there is no heal checkpoint at {ckpt}; drop --resume to start the heal")
    if p.exists() and not h.resume:
        raise ValueError(
            f"--checkpoint {ckpt} already exists; pass --resume to continue that heal, or choose "
            "another path (it is never overwritten)"
        )
    check_writable(p, "--checkpoint")
    return ckpt


def check_inputs(cfg: ConvertConfig) -> str:
    """The files the config names, checked before any work; returns the model's path (a fixture fetched).

    Args:
        cfg: The conversion's config.
    """
    check_files(cfg)
    return _check_model(fixture_path(cfg.model), cfg)


def check_files(cfg: ConvertConfig) -> None:
    """The texts and the model the config names exist and are what they should be (a fixture's name, such as
    "smollm2", is fetched later, not here): what a study checks for every cell before it runs the first.

    Args:
        cfg: The conversion's config.
    """
    for key, path in (("data.text", cfg.data.text), ("data.judge", eval_file(cfg))):
        if path is not None and path != "docs" and not Path(path).is_file():
            what = "is a folder" if Path(path).is_dir() else "does not exist"
            raise FileNotFoundError(f"{flag(key)} {path} {what}; give a text file")
        if path is not None and path != "docs" and not Path(path).read_bytes().strip():
            raise ValueError(f"{flag(key)} {path} is empty; give a text file with text in it")
    if cfg.model not in FIXTURES:
        _check_model(cfg.model, cfg)


def _check_model(model_path: str, cfg: ConvertConfig) -> str:
    if not Path(model_path).exists():
        raise FileNotFoundError(f"--model {cfg.model}: no such folder or .gguf file")
    if (Path(model_path) / RECORD_FILE).is_file():
        made = read_record(model_path).get("made_from", {}).get("model", "?")
        raise ValueError(
            f"--model {cfg.model} is a converted model (it holds {RECORD_FILE}), not an original: convert the model "
            f"it was made from ({made}); `normlab evaluate {cfg.model}` judges it"
        )
    return model_path


def check_inputs_outside(cfg: ConvertConfig) -> None:
    """Refuse, before any work, an input that lies inside the output folder a run would clear (``--overwrite``): the
    texts are read before the folder is replaced, so they would be lost with it (the heal checkpoint's place is
    checked by `check_checkpoint`).

    Args:
        cfg: The conversion's config.
    """
    if not cfg.out:
        return
    for key, path in (("data.text", cfg.data.text), ("data.judge", eval_file(cfg))):
        if path is None or (key == "data.judge" and path == "docs"):
            continue
        if inside(path, cfg.out) is not None:
            raise ValueError(
                f"{flag(key)} {path} lies inside --out {cfg.out}, which this run writes (and clears with "
                "--overwrite): move it out of that folder, or choose another --out"
            )


def check_resume_identity(ckpt: str | None, cfg: ConvertConfig, identity: dict) -> None:
    """Before the expensive work: a heal checkpoint to resume from must record the same identity (the keys
    given; the model's fingerprint is checked once the model is loaded). The checkpoint is memory-mapped, so
    this reads only its small parts.

    Args:
        ckpt: The heal checkpoint's path (None: no heal).
        cfg: The conversion's config.
        identity: This run's identity, or the part of it known so far.
    """
    import torch

    if not (cfg.heal.resume and ckpt):
        return
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file: not a checkpoint a heal wrote)
        saved = f"{type(e).__name__}: {str(e)[:120]}"
    if not isinstance(saved, dict) or "stream" not in saved:
        why = saved if isinstance(saved, str) else f"it holds a {type(saved).__name__}, not a heal's state"
        raise ValueError(
            f"--resume: {ckpt} is not a heal checkpoint ({why}); give the file a heal wrote, or drop "
            "--resume and choose another --checkpoint"
        )
    saved = saved.get("identity")
    diff = identity_difference(saved, identity, keys=identity)
    if diff:
        raise ValueError(
            f"--resume: checkpoint {ckpt} was made from another model, text or settings ({diff}); "
            "resume with the same ones, or start afresh with another --checkpoint"
        )


def check_next_token(cfg: ConvertConfig, net: nn.Module) -> None:
    """What the command will run the model on, checked once it is loaded and before calibration: token ids alone
    (not an encoder-decoder's pairs), sequences no longer than its positions, and, for the budget walk and the heal,
    which measure next-token cross-entropy, logits that predict the next token (not a masked LM).

    Args:
        cfg: The conversion's config.
        net: The loaded model.
    """
    config = getattr(net, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"--model {cfg.model} is an encoder-decoder ({type(net).__name__}): normlab convert runs a model on token "
            "ids alone (decoder-only LMs such as Llama, Qwen or Gemma; encoders such as BERT; vision models), not on "
            "the source and target pairs it needs. From Python, normlab.convert_norms(model, to, calibrate=None) "
            "converts its norms at their default init"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and cfg.seq_len > positions:
        raise ValueError(
            f"{flag('seq_len')} {cfg.seq_len} is longer than {cfg.model}'s {positions} positions "
            f"(config.json: max_position_embeddings); lower it to at most {positions}"
        )
    if predicts_next_token(net):
        return
    asked = [
        f for f, on in (("--budget-nats", cfg.budget.nats is not None), ("a heal budget", cfg.heal.budgeted)) if on
    ]
    if asked:
        raise ValueError(
            f"{' and '.join(asked)}: the budget walk and the heal measure next-token cross-entropy, and "
            f"{type(net).__name__} does not predict the next token (a masked LM); convert every site without them"
        )


def check_exclude(cfg: ConvertConfig, net: nn.Module) -> None:
    """Each ``--exclude`` pattern matches some module of the loaded model.

    Args:
        cfg: The conversion's config.
        net: The loaded model.
    """
    if not cfg.exclude:
        return
    names = [n for n, _ in net.named_modules()]
    idle = [pat for pat in cfg.exclude if not any(fnmatch.fnmatch(n, pat) for n in names)]
    if idle:
        raise ValueError(
            f"--exclude {idle[0]!r} matches no module of {cfg.model}; module names look like "
            f"{', '.join(n for n in names if n.endswith('norm'))[:200]}"
        )


def check_conversion_memory(net: nn.Module) -> None:
    """Refuse, once the model is loaded and before calibration, a conversion this machine cannot hold: about
    ``CONVERSION_PEAK`` times the float32 model's size at its largest stage.

    Args:
        net: The loaded model.
    """
    n = sum(p.numel() for p in net.parameters())
    check_memory(
        CONVERSION_PEAK * 4 * n,
        f"converting {n / 1e6:.0f}M parameters (a peak of about {CONVERSION_PEAK:g}x the float32 model's "
        f"{4 * n / 1e9:.2f} GB, as measured on Qwen2.5-Coder-0.5B)",
        "convert on a machine with more memory",
    )
