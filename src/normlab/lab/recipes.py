"""The published training recipes of the point-wise norms, as data: one home for their numbers.

DyT (Zhu et al. 2025, "Transformers without Normalization") sets alpha0 per site for LLaMA, and finds
that the model's width, not its depth, decides the best value (its Table 11): one alpha0 for the DyT
layers before attention, another for those before the FFN and for the final one. Below its smallest
width (1024) the paper gives no value; ``dyt_alpha0`` then takes the nearest row, and says so.

Both the DyT LLaMA code and the Derf nanoGPT patch (Chen et al., arXiv 2512.10938) multiply the token +
position embedding by a learnable scalar initialised to sqrt(d) before block 0, for DyT and Derf only
(``model.embed_scale = "sqrt_d"`` in the lab). Neither decays it (nanoGPT decays only matrices), nor the
norms' alpha, gamma and beta; the lab's AdamW does the same (``normlab.lab.optim.build_optimizer``).
"""

from __future__ import annotations

import math

__all__ = ["DYT_PAPER_ALPHA0", "dyt_alpha0", "parse_alpha_table", "matmul_gain_std"]

# width -> (alpha0 before attention, alpha0 before the FFN and at the final norm); DyT paper, Table 11
DYT_PAPER_ALPHA0: dict[int, tuple[float, float]] = {1024: (1.0, 1.0), 2048: (1.0, 0.5), 4096: (0.8, 0.2),
                                                    8192: (0.2, 0.05)}  # fmt: skip


def dyt_alpha0(width: int) -> dict[str, float]:
    """The DyT paper's alpha0 at each site ('attn', 'mlp', 'final') for a model of ``width`` channels:
    the row of the nearest tabulated width (on a log scale)."""
    row = min(DYT_PAPER_ALPHA0, key=lambda w: abs(math.log(w / width)))
    attn, other = DYT_PAPER_ALPHA0[row]
    return {"attn": attn, "mlp": other, "final": other}


def parse_alpha_table(value: str, width: int) -> dict[str, float]:
    """``model.alpha_table``: 'dyt_paper' (the row for this model's width) or 'dyt_paper@W' (the row for
    width W, e.g. when a narrow model emulates a wide one's init through ``model.init_std``)."""
    name, sep, at = value.partition("@")
    if sep and not at:
        raise ValueError(
            f"model.alpha_table {value!r} names no width after '@': use 'dyt_paper' (this model's width) "
            f"or 'dyt_paper@W' with W one of {', '.join(map(str, DYT_PAPER_ALPHA0))}"
        )
    if name != "dyt_paper":
        raise ValueError(
            f"model.alpha_table must be 'dyt_paper' or 'dyt_paper@W' (W one of "
            f"{', '.join(map(str, DYT_PAPER_ALPHA0))}), got {value!r}"
        )
    if not at:
        return dyt_alpha0(width)
    if not at.isdigit() or int(at) not in DYT_PAPER_ALPHA0:
        raise ValueError(
            f"model.alpha_table {value!r}: the DyT paper's table has the widths {', '.join(map(str, DYT_PAPER_ALPHA0))}"
        )
    return dyt_alpha0(int(at))


def matmul_gain_std(emulated_width: int, width: int, std: float = 0.02) -> float:
    """The init std at ``width`` whose matmul gain std * sqrt(width) equals that of ``std`` at
    ``emulated_width``: 0.02 * sqrt(1024 / 64) = 0.08 makes a width-64 model's layers as loud as GPT-2
    init at width 1024."""
    return std * math.sqrt(emulated_width / width)
