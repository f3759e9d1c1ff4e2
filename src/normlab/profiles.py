"""Profiles: how big every experiment's runs are on a given machine (`normlab.sweep` applies them).

``tiny`` (seconds, for tests), ``quick`` (minutes), ``default`` (the CPU subset of ``normlab reproduce``), ``long``
(the default at 4x its tokens), ``full`` (the lab's ``cpu`` preset), ``gpu`` (the dissection's shapes) and
``scaling`` (the scaling study, whose runs set their own shapes and budgets).
"""

from __future__ import annotations

__all__ = ["PROFILES"]

# The CPU profiles use lr 1e-3 (with min_lr 1e-4), as the lab's cpu preset does: usual for models this small,
# and it lets a 250-step run separate the norms (at 3e-4 RMSNorm stays above 2.4 in 600 steps; docs/lab.md).
_STEPS = {"warmup": 10, "eval_batches": 8, "log_every": 10, "lr": 1e-3, "min_lr": 1e-4}
PROFILES: dict[str, dict] = {
    # seconds: for tests and smoke runs
    "tiny": {
        "preset": "tiny", "seeds": 1, "set": {},
        "shapes": {"narrow": {"model.width": 32, "model.depth": 4, "model.heads": 2},
                   "wide": {"model.width": 64, "model.depth": 1, "model.heads": 2}},
    },
    # minutes on 2 CPU cores: every table, one seed, a tiny model
    "quick": {
        "preset": "cpu", "seeds": 1,
        "set": {"model.width": 32, "model.depth": 2, "model.heads": 2, "model.context": 32, "batch_size": 16,
                "steps": 150, "eval_every": 50, "metrics_every": 50, "checkpoint_every": 50, **_STEPS, "lr": 3e-3,
                "min_lr": 3e-4},
        "shapes": {"narrow": {"model.width": 32, "model.depth": 4, "model.heads": 2},
                   "wide": {"model.width": 64, "model.depth": 1, "model.heads": 4}},
    },
    # normlab reproduce: every table at width 64 (the lab's `small` preset), two seeds, minutes on 2 CPU cores
    "default": {
        "preset": "small", "seeds": 2, "set": {},
        "shapes": {"narrow": {"model.width": 64, "model.depth": 8, "model.heads": 4},
                   "wide": {"model.width": 128, "model.depth": 2, "model.heads": 4}},
    },
    # the lab's cpu preset, as specified: width 128, 4 layers, 600 steps
    "full": {
        "preset": "cpu", "seeds": None, "set": {},
        "shapes": {"narrow": {"model.width": 64, "model.depth": 16, "model.heads": 4},
                   "wide": {"model.width": 128, "model.depth": 4, "model.heads": 4}},
    },
    # the dissection's shapes on one GPU
    "gpu": {
        "preset": "gpu", "seeds": 1, "set": {},
        "shapes": {"narrow": {"model.width": 1024, "model.depth": 24, "model.heads": 16},
                   "wide": {"model.width": 2048, "model.depth": 5, "model.heads": 16}},
    },
}  # fmt: skip
# the default's shapes at 4x its tokens (1000 steps), three seeds: are the verdicts a short budget's?
PROFILES["long"] = {**PROFILES["default"], "seeds": 3, "set": {**PROFILES["default"]["set"], "steps": 1000,
                    "eval_every": 100, "metrics_every": 100, "checkpoint_every": 250}}  # fmt: skip
# the scaling study (experiments/scaling.toml): the default's preset and seeds; each run sets its own shape and budget
PROFILES["scaling"] = {**PROFILES["default"]}
