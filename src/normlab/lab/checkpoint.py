"""A lab run's checkpoint: written atomically, and read back only into the run configuration that wrote it (the
fields of `RESUMABLE` aside)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from normlab.errors import NormlabError
from normlab.lab.config import TrainConfig

__all__ = ["RESUMABLE", "CheckpointError", "save_checkpoint", "load_checkpoint"]

# config fields that may change when a run is resumed; every other field must match the checkpoint
RESUMABLE = {
    "steps",
    "eval_every",
    "log_every",
    "metrics_every",
    "checkpoint_every",
    "out",
    "tensorboard",
    "device",
    "compile",
    "eval_batches",
    "jacobian_site",
}


class CheckpointError(NormlabError):
    """A checkpoint that cannot be resumed: corrupt, not normlab's, or written by another run configuration."""


def save_checkpoint(
    path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig
) -> None:
    """torch.save to a temporary file, then an atomic rename: a kill never leaves a half checkpoint.

    Args:
        path: The checkpoint file.
        model: The model.
        opt: Its optimizer.
        step: The steps done.
        cfg: The run's config.
    """
    state = {
        "format": "normlab-checkpoint-1",
        "step": step,
        "config": cfg.to_dict(),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    tmp = path.with_suffix(".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk surfaces as either ("unexpected pos ...")
        tmp.unlink(missing_ok=True)
        raise OSError(
            f"could not write the checkpoint {path} ({str(e).splitlines()[0][:200]}); is the disk "
            "full? The last complete checkpoint is kept"
        ) from None


def load_checkpoint(path: Path, cfg: TrainConfig) -> dict:
    """Load and check a checkpoint: a corrupt file or one from a different run is refused.

    Args:
        path: The checkpoint file.
        cfg: This run's config, compared field by field.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001  (any unpickling error means the file is unusable)
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({type(e).__name__}: {e}); "
            "pass --overwrite to start the run over, or point --out at another run"
        ) from None
    if not isinstance(state, dict) or state.get("format") != "normlab-checkpoint-1":
        raise CheckpointError(f"{path} is not a normlab checkpoint")
    missing = [k for k in ("step", "config", "model", "optimizer", "rng", "cuda_rng") if k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)} (damaged or hand-edited); pass "
            "--overwrite to start the run over"
        )
    saved, now = state["config"], cfg.to_dict()
    diffs = [k for k in now if k not in RESUMABLE and saved.get(k) != now[k]]
    if diffs:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in diffs)
        raise CheckpointError(f"checkpoint {path} was written by a different run configuration ({detail})")
    return state
