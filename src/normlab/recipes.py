"""The published init recipes of the point-wise norms, as data and code: one home for their numbers, read by
`normlab.replace_norms` (a model of yours) and by the lab's GPT (``model.alpha_table``, ``model.norm_init``).

The recipes (`RECIPES`), each applied per site by `recipe_kwargs`, or after the swap by `match_rms_`:

- ``"default"``: each layer's own init: DyT's and Derf's alpha0 = 0.5, DyISRU's and ELN's beta0 = 4 = 1 / 0.5**2.
- ``"dyt_paper"``: the DyT paper's alpha0 by width and by site (below). For DyISRU and ELN it sets
  ``beta0 = 1 / alpha0**2``, the slope-matching map of the DyISRU paper (Stollenwerk, arXiv 2503.21708, Fig. 2):
  both then have the slope sqrt(C) * alpha0 at x = 0.
- ``"derf_paper"``: Derf's published init (Chen et al., "Stronger Normalization-Free Transformers",
  arXiv 2512.10938): alpha0 = 0.5 and shift0 = 0.
- ``"match_rms"``: each point-wise site's gamma scaled, in forward order, so that its output on one batch has RMS 1,
  RMSNorm's at init. `MATCH_RMS_CAVEAT` says what the lab's scaling study found it to be worth.

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
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from normlab.registry import NormSpec

__all__ = ["DYT_PAPER_ALPHA0", "DERF_PAPER_INIT", "RECIPES", "ROLES", "ROLE_NAMES", "MATCH_RMS_CAVEAT", "dyt_alpha0",
           "parse_alpha_table", "matmul_gain_std", "site_role", "recipe_kwargs", "match_rms_"]  # fmt: skip

# width -> (alpha0 before attention, alpha0 before the FFN and at the final norm); DyT paper, Table 11
DYT_PAPER_ALPHA0: dict[int, tuple[float, float]] = {1024: (1.0, 1.0), 2048: (1.0, 0.5), 4096: (0.8, 0.2),
                                                    8192: (0.2, 0.05)}  # fmt: skip


def dyt_alpha0(width: int) -> dict[str, float]:
    """The DyT paper's alpha0 at each site ('attn', 'mlp', 'final') for a model of ``width`` channels:
    the row of the nearest tabulated width (on a log scale).

    Args:
        width: The model's channel count.
    """
    row = min(DYT_PAPER_ALPHA0, key=lambda w: abs(math.log(w / width)))
    attn, other = DYT_PAPER_ALPHA0[row]
    return {"attn": attn, "mlp": other, "final": other}


def parse_alpha_table(value: str, width: int) -> dict[str, float]:
    """``model.alpha_table``: 'dyt_paper' (the row for this model's width) or 'dyt_paper@W' (the row for
    width W, e.g. when a narrow model emulates a wide one's init through ``model.init_std``).

    Args:
        value: 'dyt_paper' or 'dyt_paper@W'.
        width: The model's channel count.
    """
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
    init at width 1024.

    Args:
        emulated_width: The width whose matmul gain to match.
        width: The model's width.
        std: The init std at ``emulated_width``.
    """
    return std * math.sqrt(emulated_width / width)


DERF_PAPER_INIT = {"alpha_init": 0.5, "shift_init": 0.0}  # Chen et al., arXiv 2512.10938
RECIPES = ("default", "dyt_paper", "derf_paper", "match_rms")
MATCH_RMS_CAVEAT = (
    "match_rms is a short-budget win: in the lab's scaling study (docs/results.md) DyT with matched gamma ends below "
    "RMSNorm at 256k tokens, the gap closes by 4M tokens (within the seeds), and a model with no norm at all, only the "
    "same matched gain, does as well"
)

# A site's place in a block, which the DyT paper's alpha0 depends on: before attention, before the FFN (MLP), or the
# final norm before the head. By the module's own name (its last component), as the common codebases write it.
ROLES = ("attn", "mlp", "final")
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "attn": ("input_layernorm", "ln_1", "norm1", "norm_1", "norm_attn", "attention_norm", "attn_norm", "ln_attn",
             "layernorm_before", "self_attn_layer_norm"),
    "mlp": ("post_attention_layernorm", "ln_2", "norm2", "norm_2", "norm_mlp", "ffn_norm", "mlp_norm", "ln_mlp",
            "layernorm_after", "final_layer_norm_ffn"),
    "final": ("norm", "ln_f", "norm_final", "final_layernorm", "final_layer_norm", "ln_final", "norm_out",
              "final_norm"),
}  # fmt: skip


def site_role(name: str, roles: dict[str, str] | None = None) -> str | None:
    """The role of the norm named ``name`` ('attn', 'mlp' or 'final'): the first of ``roles`` ({fnmatch pattern:
    role}) that matches the whole name, else `ROLE_NAMES` by its last component; None when neither tells.

    Args:
        name: The module's name in the model (``model.layers.3.input_layernorm``).
        roles: The caller's own patterns, which win over the names.
    """
    import fnmatch

    for pattern, role in (roles or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return role
    last = name.rsplit(".", 1)[-1]
    return next((role for role, names in ROLE_NAMES.items() if last in names), None)


def recipe_kwargs(recipe: str, spec: NormSpec, role: str | None, width: int) -> tuple[dict, str]:
    """The init keywords ``recipe`` gives a ``spec`` layer (a `normlab.registry.NormSpec`) at a site of ``role`` and
    ``width`` channels, and a note saying what it set. A recipe that does not apply to the target is a ValueError.

    Args:
        recipe: One of `RECIPES` except "match_rms" (applied after the swap, by `match_rms_`).
        spec: The target norm's registry entry.
        role: 'attn', 'mlp', 'final', or None where unknown (refused where the recipe's value depends on it).
        width: The site's channel count.
    """
    takes = spec.init_kwargs
    if recipe == "default":
        return {}, "default init"
    if recipe == "derf_paper":
        if spec.name != "derf":
            raise ValueError(
                f"init 'derf_paper' is Derf's published init (alpha0 = 0.5, shift0 = 0); the target is "
                f"{spec.name!r}: use to='derf', or init='dyt_paper' / 'default'"
            )
        return dict(DERF_PAPER_INIT), "Derf's init: alpha0 = 0.5, shift0 = 0"
    if recipe != "dyt_paper":
        raise ValueError(f"unknown init recipe {recipe!r}; the recipes are {', '.join(RECIPES)}")
    table = dyt_alpha0(width)
    if role is None and len(set(table.values())) > 1:
        raise ValueError("role")  # the caller names the site and the fix
    alpha0 = table[role or "mlp"]
    row = min(DYT_PAPER_ALPHA0, key=lambda w: abs(math.log(w / width)))
    where = f"DyT paper, width {row}" + (f" row for {width}" if row != width else "")
    if "alpha_init" in takes:
        return {"alpha_init": alpha0}, f"alpha0 = {alpha0} ({where})"
    if "beta_init" in takes:
        beta0 = 1.0 / alpha0**2
        return {"beta_init": beta0}, f"beta0 = 1/alpha0^2 = {beta0:g} ({where})"
    raise ValueError(
        f"init 'dyt_paper' sets DyT's alpha0 (or beta0 = 1 / alpha0^2 for DyISRU and ELN); the target "
        f"{spec.name!r} takes neither: use init='default'"
    )


def match_rms_(model: nn.Module, sites: dict[str, nn.Module], run: Callable[[], object]) -> dict[str, float]:
    """``match_rms``: scale each point-wise site's gamma so that its output in ``run()`` (one forward on one batch)
    has RMS 1, RMSNorm's at init. The sites go in the order the forward calls them, each measured after the ones
    before it were scaled. The forwards run in eval mode and without autograd (a running statistic such as rms_ema's
    is read, never moved). Returns the factor applied at each site; a site with no gamma, or not point-wise, is
    left alone.

    Args:
        model: The model ``run`` calls.
        sites: Its norm sites by name.
        run: One forward of ``model`` on the batch to match, e.g. ``lambda: model(idx)``.
    """
    import torch

    from normlab.registry import norm_spec

    eligible = {n: m for n, m in sites.items() if getattr(m, "weight", None) is not None
                and norm_spec(getattr(m, "registry_name", "")).pointwise}  # fmt: skip
    factors: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            order: list[str] = []
            hooks = [m.register_forward_hook(lambda mod, a, y, n=n: order.append(n)) for n, m in eligible.items()]
            try:
                run()
            finally:
                for h in hooks:
                    h.remove()
            for name in dict.fromkeys(order):  # first call of each, in forward order
                m = eligible[name]
                outputs: list = []
                handle = m.register_forward_hook(lambda mod, a, y, seen=outputs: seen.append(y))
                try:
                    run()
                finally:
                    handle.remove()
                rms = float(outputs[0].float().pow(2).mean().sqrt())
                if rms > 0 and math.isfinite(rms):
                    m.weight.mul_(1.0 / rms)
                    factors[name] = 1.0 / rms
    finally:
        model.train(was_training)
    return factors
