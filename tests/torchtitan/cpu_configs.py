"""torchtitan run configurations for the tests: the Llama 3 ``debugmodel`` as torchtitan ships it, with a short
sequence and the assets beside this file."""

from __future__ import annotations

from pathlib import Path

from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

ASSETS = Path(__file__).parent / "assets"


def _cpu(config, converters=None):
    config.model_spec = model_registry("debugmodel", converters=converters)
    config.hf_assets_path = str(ASSETS / "tokenizer")
    config.dataloader.dataset_path = str(ASSETS / "c4_test")
    config.training.seq_len, config.training.local_batch_size = 64, 2
    config.validator.enable = False
    config.training.mixed_precision_param = "float32"  # bf16 matmuls are slow on a CPU without AVX-512 bf16
    config.debug.seed = 0  # (debug.deterministic would put back the compiled FlexAttention the shim replaces)
    model = config.model_spec.model
    model.layers = model.layers[:2]  # two blocks: the smallest model with every kind of site twice
    return config


def llama3_debug_cpu():
    """The stock model: RMSNorm at every site."""
    return _cpu(llama3_debugmodel())


def llama3_debug_cpu_full_ac():
    """The stock model under full activation checkpointing (every block recomputed in the backward; the debug
    model's own setting is selective)."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    config = _cpu(llama3_debugmodel())
    config.activation_checkpoint = FullAC.Config()
    return config


def llama3_debug_cpu_dyt():
    """DyT at every site with the DyT paper's recipe, through normlab's model converter."""
    from normlab.integrations.torchtitan import NormConverter

    return _cpu(llama3_debugmodel(), [NormConverter.Config(to="dyt", init="dyt_paper")])
