"""The published init recipes of the point-wise norms, as data and code: one home for their numbers, read by
`normlab.replace_norms` (a model of yours) and by the lab's GPT (``model.recipe``, ``model.norm_init``): the same
name gives the same layers in both.

The recipes (`RECIPES`), each applied per site by `recipe_kwargs`, or after the swap by `match_rms_`:

- ``"auto"``, `replace_norms`' default: the layers' own init, then ``match_rms`` on ``sample=`` or, without one, on a
  batch of random token ids the swap draws from the model's input embedding (`token_sample`): a fresh point-wise
  layer on a model initialised at small scale (a Hugging Face model's std 0.02) is otherwise about 100 times quieter
  than the RMSNorm it replaces, and the model barely learns (docs/own-model.md has the curves). Where no sample can be
  drawn (no token embedding, a meta model, a forward that refuses the drawn ids), the layers keep their own init and
  the swap says so once.
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
(``normlab.embed_scale``; in the lab, ``model.recipe`` brings it and ``model.embed_scale`` overrides it).
Neither decays it (nanoGPT decays only matrices), nor the norms' alpha, gamma and beta; the lab's AdamW does the
same (``normlab.lab.optim.build_optimizer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from normlab.registry import NormSpec

__all__ = ["DYT_PAPER_ALPHA0", "DERF_PAPER_INIT", "RECIPES", "ROLES", "ROLE_NAMES", "MATCH_RMS_CAVEAT", "dyt_alpha0",
           "parse_recipe", "PAPERS", "LAB_RECIPES", "matmul_gain_std", "site_role", "recipe_kwargs", "match_rms_",
           "token_sample", "input_embedding", "paper_assumption", "alpha0_kwargs", "RoleUnknown"]  # fmt: skip

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


def parse_recipe(value: str) -> tuple[str, int | None]:
    """A recipe name as the lab's ``model.recipe`` writes it: one of `RECIPES` without a sample ("default",
    "dyt_paper", "derf_paper"), or "dyt_paper@W": the DyT paper's row for width W (a narrow model emulating a wide
    one's init through ``model.init_std``). Returns (the recipe, W or None).

    Args:
        value: The name.
    """
    name, sep, at = value.partition("@")
    widths = ", ".join(map(str, DYT_PAPER_ALPHA0))
    if name not in LAB_RECIPES:
        raise ValueError(f"model.recipe must be one of {', '.join(LAB_RECIPES)} or 'dyt_paper@W', got {value!r}")
    if not sep:
        return name, None
    if name != "dyt_paper":
        raise ValueError(f"model.recipe {value!r}: only 'dyt_paper' has a table by width ('dyt_paper@W')")
    if not at:
        raise ValueError(
            f"model.recipe {value!r} names no width after '@': use 'dyt_paper' (this model's width) or "
            f"'dyt_paper@W' with W one of {widths}"
        )
    if not at.isdigit() or int(at) not in DYT_PAPER_ALPHA0:
        raise ValueError(f"model.recipe {value!r}: the DyT paper's table has the widths {widths}")
    return name, int(at)


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
DERF_PAPER_LM_INIT = {"alpha_init": 1.0, "shift_init": 0.0}  # its GPT-2 patch: alpha0 1.0 at every site, bias kept
#: What the papers' language-model code changes beyond alpha0, which "dyt_paper" and "derf_paper" apply to a model with
#: a token embedding: the embedding scale (normlab.embed_scale) and, for DyT, no bias.
LM_CHANGES = "a learnable embedding scale initialised to sqrt(d); DyT without a bias (the DyT paper's LLaMA)"
#: The DyT paper's LLaMA embeds at RMS sqrt(d) * 0.02 = 1.28 (width 4096, std 0.02) after its scale: its alpha0 table
#: was tuned there. A model whose scaled embedding is outside this range breaks the recipe's assumption.
PAPER_EMBED_RMS = (0.5, 3.0)
RECIPES = ("auto", "default", "dyt_paper", "derf_paper", "match_rms")
#: The recipes that set values from the papers, the language-model changes (`LM_CHANGES`) included.
PAPERS = ("dyt_paper", "derf_paper")
#: The recipes the lab's ``model.recipe`` takes: those without a sample (the lab matches gains by
#: ``model.norm_init = "match_rms"`` on its own data).
LAB_RECIPES = ("default", "dyt_paper", "derf_paper")
#: The recipes whose values need a forward of the model (a sample), not only its shapes.
MEASURED = ("auto", "match_rms")
MATCH_RMS_CAVEAT = (
    "match_rms is a short-budget win: in the lab's scaling study (docs/results.md) DyT with matched gamma ends below "
    "RMSNorm at 256k tokens, the gap closes by 4M tokens (within the seeds), and a model with no norm at all, only the "
    "same matched gain, does as well"
)

# A site's place in a block, which the DyT paper's alpha0 depends on: before attention, before the FFN (MLP), or the
# final norm before the head. By the module's own name (its last component), as the common codebases write it.
# A q/k norm ("qk") normalizes each head's queries or keys inside attention (Qwen3, Gemma 3, OLMo 2): the DyT paper
# tabulates no alpha0 for it, so "dyt_paper" leaves it at the layer's own init and says so (`QK_NOTE`).
ROLES = ("attn", "mlp", "final", "qk")
QK_NOTE = "the layer's own init: the DyT paper gives no alpha0 for a q/k norm"
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "attn": ("input_layernorm", "ln_1", "norm1", "norm_1", "norm_attn", "attention_norm", "attn_norm", "ln_attn",
             "layernorm_before", "self_attn_layer_norm"),
    "mlp": ("post_attention_layernorm", "ln_2", "norm2", "norm_2", "norm_mlp", "ffn_norm", "mlp_norm", "ln_mlp",
            "layernorm_after", "final_layer_norm_ffn"),
    "final": ("norm", "ln_f", "norm_final", "final_layernorm", "final_layer_norm", "ln_final", "norm_out",
              "final_norm"),
    "qk": ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm", "q_ln", "k_ln"),
}  # fmt: skip


def site_role(name: str, roles: dict[str, str] | None = None) -> str | None:
    """The role of the norm named ``name`` ('attn', 'mlp', 'final' or 'qk'): the first of ``roles`` ({fnmatch pattern:
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


def alpha0_kwargs(spec: NormSpec, alpha0: float) -> dict:
    """The keyword that gives a ``spec`` layer the DyT paper's alpha0: ``alpha_init`` (DyT, Derf), ``beta_init =
    1 / alpha0**2`` (DyISRU, ELN: the slope-matching map), or none. One map for the library and the lab.

    Args:
        spec: The layer's registry entry.
        alpha0: The paper's alpha0 at the site.
    """
    if "alpha_init" in spec.init_kwargs:
        return {"alpha_init": alpha0}
    if "beta_init" in spec.init_kwargs:
        return {"beta_init": 1.0 / alpha0**2}
    return {}


class RoleUnknown(ValueError):
    """A recipe whose value depends on a site's role was given a site whose role is unknown: the caller, which knows
    the site's name, says how to name its role."""


def recipe_kwargs(recipe: str, spec: NormSpec, role: str | None, width: int, lm: bool = False) -> tuple[dict, str]:
    """The init keywords ``recipe`` gives a ``spec`` layer (a `normlab.registry.NormSpec`) at a site of ``role`` and
    ``width`` channels, and a note saying what it set. A recipe that does not apply to the target is a ValueError.

    Args:
        recipe: One of `RECIPES` except "match_rms" (applied after the swap, by `match_rms_`).
        spec: The target norm's registry entry.
        role: 'attn', 'mlp', 'final', 'qk' (a q/k norm), or None where unknown (refused where the recipe's value
            depends on it).
        width: The site's channel count.
        lm: The model is a language model (it has a token embedding): the papers' language-model code then
            differs from their vision code (`LM_CHANGES`).
    """
    if recipe in ("default", "auto"):  # auto's gain is matched after the swap (replace_norms)
        return {}, "default init"
    if recipe == "derf_paper":
        if spec.name != "derf":
            raise ValueError(
                f"init 'derf_paper' is Derf's published init (alpha0 = 0.5, shift0 = 0; 1.0 in a language model); "
                f"the target is {spec.name!r}: use to='derf', or init='dyt_paper' / 'default'"
            )
        if lm:
            return dict(DERF_PAPER_LM_INIT), "Derf's GPT-2 init: alpha0 = 1.0, shift0 = 0"
        return dict(DERF_PAPER_INIT), "Derf's init: alpha0 = 0.5, shift0 = 0"
    if recipe != "dyt_paper":
        raise ValueError(f"unknown init recipe {recipe!r}; the recipes are {', '.join(RECIPES)}")
    if role == "qk":
        return {}, QK_NOTE
    table = dyt_alpha0(width)
    if role is None and len(set(table.values())) > 1:
        raise RoleUnknown("init 'dyt_paper' sets alpha0 by where a norm sits, and the site's name does not say")
    alpha0 = table[role or "mlp"]
    row = min(DYT_PAPER_ALPHA0, key=lambda w: abs(math.log(w / width)))
    where = f"DyT paper, width {row}" + (f" row for {width}" if row != width else "")
    kw = alpha0_kwargs(spec, alpha0)
    if "alpha_init" in kw:
        if lm and spec.name == "dyt":  # the DyT paper's LLaMA layer: weight * tanh(alpha x), no bias
            return {**kw, "bias": False}, f"alpha0 = {alpha0}, no bias ({where})"
        return kw, f"alpha0 = {alpha0} ({where})"
    if kw:
        return kw, f"beta0 = 1/alpha0^2 = {kw['beta_init']:g} ({where})"
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

    named = {n: m for n, m in sites.items() if isinstance(getattr(m, "registry_name", None), str)}  # norms only
    eligible = {
        n: m
        for n, m in named.items()
        if getattr(m, "weight", None) is not None and norm_spec(m.registry_name).pointwise
    }
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


def input_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The model's token embedding and its name: what a Hugging Face model's ``get_input_embeddings`` returns, else
    the ``nn.Embedding`` with the most rows (the tokens, not the positions); None where the model has none.

    Args:
        model: The model.
    """
    get = getattr(model, "get_input_embeddings", None)
    found = None
    if callable(get):
        try:
            found = get()
        except (NotImplementedError, AttributeError):
            found = None
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if isinstance(found, nn.Embedding):
        return next(((n, m) for n, m in embeddings if m is found), None)
    return max(embeddings, key=lambda nm: nm[1].num_embeddings, default=None)


def token_sample(model: nn.Module, batch: int = 4, length: int = 32, seed: int = 0):
    """A batch of random token ids for one forward of ``model`` (``model(ids)``), drawn uniformly from its input
    embedding's rows with a fixed seed, on the embedding's device; or (None, why not).

    Args:
        model: The model.
        batch: Sequences in the batch.
        length: Tokens per sequence (at most the smallest other embedding's rows: a position table).
        seed: The draw's seed.
    """
    import torch

    found = input_embedding(model)
    if found is None:
        return None, "the model has no token embedding (nn.Embedding) to draw token ids for"
    name, emb = found
    if emb.weight.is_meta:
        return None, f"the model is on the meta device ({name}.weight): there is no forward to measure"
    positions = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding) and m is not emb]
    length = max(1, min([length, *positions]))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, emb.num_embeddings, (batch, length), generator=g).to(emb.weight.device), None


def paper_assumption(model: nn.Module, recipe: str) -> str:
    """Why ``recipe`` ('dyt_paper', 'derf_paper') does not fit ``model``'s initialisation, or '' where it does: its
    token embedding times sqrt(d) (the papers' scale at init) far from unit RMS, where the papers' alpha0 was tuned.

    Args:
        model: The model, its embedding as initialised (not on the meta device).
        recipe: The paper recipe.
    """
    found = input_embedding(model)
    if found is None or found[1].weight.is_meta:
        return ""
    name, emb = found
    rms = float(emb.weight.detach().float().pow(2).mean().sqrt()) * math.sqrt(emb.embedding_dim)
    low, high = PAPER_EMBED_RMS
    if low <= rms <= high:
        return ""
    return (
        f"init {recipe!r} was tuned where the embedding, times its sqrt(d) scale, has RMS near 1 (the DyT paper's "
        f"LLaMA: 0.02 * sqrt(4096) = 1.28); {name} gives {rms:.3g}, so the paper's alpha0 sees inputs "
        f"{'far quieter' if rms < low else 'far louder'} than it was tuned for and the model may barely learn. "
        f"Use init='auto' (the default: the gain matched on a drawn batch) or [{recipe!r}, 'match_rms'] with sample="
    )
