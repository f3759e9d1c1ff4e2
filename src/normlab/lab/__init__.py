"""The training lab: a readable GPT with any registered norm, a real corpus, the dissection's metrics."""

from normlab.lab.config import PRESETS, TrainConfig, apply_overrides, resolve_config
from normlab.lab.model import GPT, GPTConfig
from normlab.lab.train import CheckpointError, train

__all__ = [
    "PRESETS", "TrainConfig", "apply_overrides", "resolve_config", "GPT", "GPTConfig", "CheckpointError", "train",
]  # fmt: skip
