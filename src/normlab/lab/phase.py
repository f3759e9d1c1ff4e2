"""When does a point-wise norm train? The prediction from a config at init, before any step.

The dissection explains the unigram attractor by signal scale: with GPT-2 init the residual stream has std ~0.02,
so alpha * x stays in tanh's linear region, the point-wise norm passes a signal ~alpha * 0.02 where RMSNorm
passes 1, and the model falls back on the unigram. Two quantities follow from that argument, and both are
measured here on the model at init (random bytes, no data, no training):

* ``alpha_rms``: alpha0 times the RMS of block 0's input, the dissection's own quantity (how far into f's
  non-linear region the first block's norm works);
* ``logit_gain``: the std of the logits at init relative to RMSNorm's at GPT-2 init, 0.02 * sqrt(C)
  (RMSNorm's output has RMS 1 and the head is N(0, 0.02)). It is the same scale argument applied at the
  output, where the head reads the final norm: the point-wise model's logits are alpha * sigma * gamma
  times quieter, unless an embedding scale, a larger init, a gamma matched to RMSNorm (``match_rms``) or
  an RMSNorm at the final site makes up for it.

The prediction: a run escapes the attractor within the default budget when ``logit_gain`` reaches
``ESCAPE_THRESHOLD``. The threshold was set at half of RMSNorm's scale before the phase grid was run, from
a pilot of 18 single-seed runs (docs/results.md, "When does a point-wise norm train?"); the report states how many
runs of the grid fall on the predicted side, for this quantity and for ``alpha_rms``.
"""

from __future__ import annotations

import math

import torch

from normlab.lab.metrics import init_telemetry
from normlab.lab.model import GPT, GPTConfig
from normlab.modules import prime_running_stats

__all__ = ["ESCAPE_THRESHOLD", "GPT2_STD", "predict", "predicted_escape"]

GPT2_STD = 0.02  # the dissection's init std; RMSNorm's logits at init then have std 0.02 * sqrt(C)
ESCAPE_THRESHOLD = 0.5  # logit_gain at which a run is predicted to leave the attractor


def predicted_escape(logit_gain: float) -> bool:
    """Whether a model leaves the unigram attractor, by the prediction: its logits' scale at init is at least
    `ESCAPE_THRESHOLD` times RMSNorm's at GPT-2 init.

    Args:
        logit_gain: The logits' std at init over RMSNorm's (`predict`).
    """

    return logit_gain >= ESCAPE_THRESHOLD


@torch.no_grad()
def predict(cfg: GPTConfig, *, seed: int = 0, batch: int = 8) -> dict[str, float | bool]:
    """The model of ``cfg`` at init, on random bytes: alpha_rms and rms_out at block 0's attention norm,
    the logits' std, logit_gain (relative to RMSNorm at GPT-2 init), and the predicted escape.

    Args:
        cfg: The model's config.
        seed: Of the init and the bytes.
        batch: Sequences of random bytes.
    """
    from normlab.errors import check_memory

    with torch.device("meta"):  # the size first: a width of 100000 must be refused, not swapped to death
        n = sum(p.numel() for p in GPT(cfg).parameters())
    acts = batch * cfg.context * (cfg.vocab_size + 16 * cfg.width)  # the logits and a block's activations
    check_memory(
        4 * (n + acts),
        f"the model of model.width={cfg.width}, model.depth={cfg.depth} ({n / 1e6:.0f}M parameters) at init",
        "use a smaller model.width or model.depth",
    )
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab_size, (batch, cfg.context), generator=g)
    prime_running_stats(model, idx)  # rms_ema: the running mean training sets from its first batch
    if cfg.norm_init == "match_rms":
        model.match_rms_(idx)
    tele = init_telemetry(model, idx)
    logits, _ = model(idx)
    logit_std = float(logits.float().std())
    gain = logit_std / (GPT2_STD * math.sqrt(cfg.width))
    site = "blocks.0.norm_attn"
    return {
        "alpha_rms": tele.get(f"alpha_rms/{site}", math.nan),
        "rms_out": tele[f"rms_out/{site}"],
        "rms_in": tele[f"rms_in/{site}"],
        "logit_std": logit_std,
        "logit_gain": gain,
        "predicted_escape": predicted_escape(gain),
    }
