"""timm's models with normlab's norms (issue 97): timm needs torchvision, whose CPU wheel cannot sit beside the main
venv's torch, so ``timm_models.py`` runs in the torch 2.14.1 venv ``make titan`` builds (``NORMLAB_TITAN_VENV`` for
another)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import second_venv

HERE = Path(__file__).parent
PYTHON = second_venv("timm") / "bin" / "python"


@pytest.mark.slow
def test_a_timm_vit_and_convnext_swap_train_and_build_with_normlab_norms():
    """A ViT's LayerNorms and a ConvNeXt's channels-first LayerNorm2d become DyT (the latter over axis 1, checked
    channel by channel on a map whose last axis is as long as the channels); both train 8 AdamW steps; a ViT built
    with ``norm_layer=normlab.norm_layer("dyt")`` has DyT at every site and trains."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NORMLAB_KERNEL"))}
    run = subprocess.run([str(PYTHON), str(HERE / "timm_models.py")], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    vit, convnext, built = got["vit"], got["convnext"], got["norm_layer"]
    assert vit["sites"] == ["LayerNorm"] * 5 and vit["left"] == []  # 2 blocks x 2 + the final norm
    assert convnext["sites"] == ["LayerNorm2d"] and convnext["channels_first"] == convnext["n"] == 17
    assert convnext["site_error"] < 1e-6
    assert built["dyt"] == 5 and built["alpha"] == [1.0]
    for losses in (vit["losses"], convnext["losses"], built["losses"]):
        assert len(losses) == 8 and losses[-1] < losses[0], losses
