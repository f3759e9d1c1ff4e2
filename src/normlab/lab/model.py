"""A GPT in reading order: config, RoPE, attention, MLPs, block, model. Every norm comes from the registry.

Pre-norm blocks, x <- x + attn(norm_attn(x)); x <- x + mlp(norm_mlp(x)), and a final norm
before the head. GPT-2 initialisation as in the dissection: normal(0, 0.02) weights and
normal(0, 0.02 / sqrt(2 L)) for the two residual projections of each block.

Two blocks (``block``): ``gpt2`` (learned positions, a GELU MLP of 4 x width, tied head: the
dissection's model) and ``llama`` (RoPE on q and k, no learned positions, a SwiGLU MLP of about 8/3 x
width, an untied head: the shapes of LLaMA and SmolLM2, the models normlab converts). Neither has biases.

The recipe knobs of the DyT and Derf papers (``normlab.recipes``), each off by default so that a
default model is the dissection's: ``recipe`` (a recipe name of `normlab.replace_norms`: "dyt_paper" or
"derf_paper" set each site's init and bias and add the learnable sqrt(d) scalar on the embedding, as the swap of a
model of yours does), ``embed_scale`` (that scalar given or removed by hand), ``init_std`` (the 0.02 above) and
``norm_init = "match_rms"`` (each point-wise site's gamma set from a batch so that its output RMS is RMSNorm's, 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from normlab.recipes import PAPERS, match_rms_, parse_recipe, recipe_kwargs
from normlab.registry import accepted_kwargs, create_norm, init_kwargs, norm_spec
from normlab.typed import check_types, choices

__all__ = ["GPTConfig", "GPT", "BLOCKS", "rope_tables", "apply_rope"]

SITES = ("attn", "mlp", "final")


@dataclass
class GPTConfig:
    """The model: its shape, its block, and the norm at each site (``--set model.KEY=VALUE``)."""

    vocab_size: int = 256
    """Tokens (256: bytes)."""
    width: int = 128
    """The residual stream's channels."""
    depth: int = 4
    """Blocks."""
    heads: int = 4
    """Attention heads; they divide the width."""
    context: int = 128
    """Tokens per sequence."""
    mlp_ratio: float = 4.0
    """gpt2: the MLP's hidden size is ratio x width; llama: 2/3 of that, rounded up to a multiple of 16."""
    block: Literal["gpt2", "llama"] = "gpt2"
    """"gpt2", or "llama": RoPE, SwiGLU, an untied head (see the module docstring)."""
    rope_theta: float = 10000.0
    """The llama block's RoPE base."""
    tied_embeddings: bool | None = None
    """Whether the head shares the embedding's matrix; None: the block's own (gpt2 tied, llama untied)."""
    norm: str = "rms_norm"
    """The norm at every site, unless a site names its own."""
    norm_kwargs: dict = field(default_factory=dict)
    """Init values for every site (e.g. alpha_init)."""
    norm_attn: str | None = None
    """The norm before attention; None: ``norm``."""
    norm_mlp: str | None = None
    """The norm before the MLP; None: ``norm``."""
    norm_final: str | None = None
    """The final norm; None: ``norm``."""
    norm_attn_kwargs: dict = field(default_factory=dict)
    """Init values at the attention sites (DyT's LLaMA recipe: a different alpha per site)."""
    norm_mlp_kwargs: dict = field(default_factory=dict)
    """Init values at the MLP sites."""
    norm_final_kwargs: dict = field(default_factory=dict)
    """Init values at the final norm."""
    recipe: str = "default"
    """A recipe of `normlab.replace_norms`: "default" (each layer's own init), "dyt_paper" (the DyT paper's alpha0 per
    site, DyT without bias, the sqrt(d) embedding scalar; "dyt_paper@W": the table's row for width W) or "derf_paper"
    (alpha0 1.0, the scalar): the values the swap gives a model of yours, read from ``normlab.recipes``."""
    embed_scale: float | str | None = None
    """A learnable scalar on the embedding: None (the recipe's: sqrt(d) under a paper recipe, else none), "none",
    "sqrt_d" or a number."""
    init_std: float = 0.02
    """The std of the N(0, std) init; the residual projections get std / sqrt(2 L)."""
    norm_init: Literal["default", "match_rms"] = "default"
    """"default", or "match_rms": point-wise gammas set so each site's output RMS is 1."""

    def site(self, site: str) -> tuple[str, dict]:
        """The norm name and init kwargs at ``site`` ('attn', 'mlp' or 'final').

        Precedence: the site's own kwargs, then ``recipe``, then ``norm_kwargs``."""
        name = getattr(self, f"norm_{site}") or self.norm
        recipe = self.recipe_kwargs(name, site)
        return name, accepted_kwargs(name, {**self.norm_kwargs, **recipe, **getattr(self, f"norm_{site}_kwargs")})

    def recipe_kwargs(self, name: str, site: str) -> dict:
        """What ``recipe`` gives a ``name`` layer at ``site``: `normlab.recipes.recipe_kwargs` for a language model,
        the call `normlab.replace_norms` makes; {} where the recipe sets nothing that layer takes (an RMSNorm site)."""
        recipe, row = parse_recipe(self.recipe)
        if recipe == "default":
            return {}
        try:
            return recipe_kwargs(recipe, norm_spec(name), site, row or self.width, lm=True)[0]
        except ValueError:  # validate() refuses a recipe that no site takes
            return {}

    def tied(self) -> bool:
        """Whether the head shares the embedding's matrix: ``tied_embeddings``, else the block's default."""
        return (self.block == "gpt2") if self.tied_embeddings is None else self.tied_embeddings

    def mlp_hidden(self) -> int:
        """The MLP's hidden size: mlp_ratio x width (gpt2); 2/3 of it rounded up to a multiple of 16 (llama's
        SwiGLU, as LLaMA sizes it: 1536 at SmolLM2's width 576)."""
        hidden = int(self.mlp_ratio * self.width)
        return hidden if self.block == "gpt2" else 16 * math.ceil(2 * hidden / 3 / 16)

    def embed_scale_init(self) -> float | None:
        """The initial value of the embedding scalar, or None when the model has none."""
        scale = self.embed_scale
        if scale is None:  # the recipe's: the papers' language models scale the embedding by sqrt(d)
            scale = "sqrt_d" if parse_recipe(self.recipe)[0] in PAPERS else "none"
        return {"none": None, "sqrt_d": math.sqrt(self.width)}.get(scale, scale)

    def site_names(self) -> list[str]:
        """Every norm site by name, as GPT.norm_modules() names them."""
        return [f"blocks.{i}.norm_{s}" for i in range(self.depth) for s in SITES[:2]] + ["norm_final"]

    def validate(self) -> None:
        check_types(self, "model.", name=str)
        for f in ("vocab_size", "width", "depth", "heads", "context"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f} must be an int >= 1, got {v!r}")
        if self.width % self.heads:
            raise ValueError(f"model.heads = {self.heads} does not divide model.width = {self.width}")
        if not (math.isfinite(self.mlp_ratio) and self.mlp_ratio > 0):
            raise ValueError(f"model.mlp_ratio must be a finite number > 0, got {self.mlp_ratio}")
        if self.block == "llama" and (self.width // self.heads) % 2:
            raise ValueError(
                f"model.block = 'llama' rotates pairs of channels (RoPE): the head size width / heads "
                f"= {self.width // self.heads} must be even"
            )
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"model.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if self.block != "llama" and self.rope_theta != GPTConfig.rope_theta:  # ignored: refused, not dropped
            raise ValueError(
                f"model.rope_theta = {self.rope_theta!r} sets RoPE, which only model.block = 'llama' has (the "
                f"{self.block!r} block has learned positions): set model.block = 'llama', or leave rope_theta out"
            )
        scale = self.embed_scale
        number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
        if not (scale in (None, "none", "sqrt_d") or (number and math.isfinite(scale) and scale > 0)):
            raise ValueError(
                f"model.embed_scale must be null (the recipe's), 'none', 'sqrt_d' or a finite number > 0, got {scale!r}"
            )
        if not (math.isfinite(self.init_std) and self.init_std > 0):
            raise ValueError(f"model.init_std must be a finite number > 0, got {self.init_std!r}")
        parse_recipe(self.recipe)
        for site in SITES:
            field_name = "norm" if getattr(self, f"norm_{site}") is None else f"norm_{site}"
            try:
                norm_spec(getattr(self, field_name))
            except ValueError as e:
                raise ValueError(f"model.{field_name}: {e}") from None
        names = [getattr(self, f"norm_{s}") or self.norm for s in SITES]
        if self.norm_init == "match_rms" and not any(norm_spec(n).pointwise for n in names):
            raise ValueError(
                f"model.norm_init = 'match_rms' scales the gamma of point-wise norms; no site of this "
                f"model has one ({', '.join(sorted(set(names)))}): drop it, or use a point-wise norm"
            )
        self._check_recipe(names)
        every = {k for s in SITES for k in init_kwargs(self.site(s)[0])}
        unused = set(self.norm_kwargs) - every
        if unused:
            raise ValueError(f"model.norm_kwargs: no norm of this model takes {', '.join(sorted(unused))}")
        for site in SITES:
            name = getattr(self, f"norm_{site}") or self.norm
            bad = set(getattr(self, f"norm_{site}_kwargs")) - set(init_kwargs(name))
            if bad:
                raise ValueError(f"model.norm_{site}_kwargs: norm {name!r} does not take {', '.join(sorted(bad))}")

    def _check_recipe(self, names: list[str]) -> None:
        """A recipe that sets nothing at any site is refused with the recipe's own reason (the swap's words)."""
        recipe, row = parse_recipe(self.recipe)
        if recipe == "default":
            return
        errors = []
        for site, name in zip(SITES, names):
            try:
                recipe_kwargs(recipe, norm_spec(name), site, row or self.width, lm=True)
                return
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"model.recipe = {self.recipe!r} sets nothing at any site of this model: {errors[0]}")

    def to_dict(self) -> dict:
        return asdict(self)


BLOCKS = choices(GPTConfig, "block")  # ("gpt2", "llama"): read from the field, written once


def rope_tables(context: int, head_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles t * theta^(-2i / hs), each (T, hs): the halves repeated, as LLaMA lays them.

    Args:
        context: The longest sequence.
        head_size: One head's width (even).
        theta: The base of the rotation frequencies.
    """
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    angles = torch.arange(context, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i + hs/2}) of ``x`` (B, nh, T, hs) by its angle: x cos + rotate_half(x) sin.

    Args:
        x: Queries or keys, (B, heads, T, head_size).
        cos: `rope_tables`' cos for positions 0..T-1, (T, head_size).
        sin: Its sin, likewise.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)  # residual projection ("c_proj")

    def qk(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """q, k, v, each (B, nh, T, hs), with RoPE applied to q and k when ``rope`` is given."""
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=-1)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        if rope is not None:
            cos, sin = (r[:t].to(q.dtype) for r in rope)  # (T, hs)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qk(x, rope)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_hidden()
        self.fc = nn.Linear(cfg.width, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.width, bias=False)  # residual projection ("c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class SwiGLU(nn.Module):
    """LLaMA's MLP: proj(silu(gate(x)) * up(x)), hidden about 8/3 x width."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_hidden()
        self.gate = nn.Linear(cfg.width, hidden, bias=False)
        self.up = nn.Linear(cfg.width, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.width, bias=False)  # residual projection ("down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))  # (B, T, C) -> (B, T, H) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        name, kw = cfg.site("attn")
        self.norm_attn = create_norm(name, cfg.width, **kw)
        self.attn = CausalSelfAttention(cfg)
        name, kw = cfg.site("mlp")
        self.norm_mlp = create_norm(name, cfg.width, **kw)
        self.mlp = MLP(cfg) if cfg.block == "gpt2" else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), rope)  # (B, T, C)
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """The lab's language model: token (and, for GPT-2 blocks, position) embeddings, ``cfg.depth`` blocks, each with a
    norm before its attention and its MLP, a final norm and a head tied to the embedding unless ``cfg`` unties it.

    Args:
        cfg: The model's config: width, depth, heads, the block (GPT-2 or LLaMA), the norm and its init.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.context, cfg.width) if cfg.block == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        name, kw = cfg.site("final")
        self.norm_final = create_norm(name, cfg.width, **kw)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tied():
            self.head.weight = self.wte.weight
        if cfg.block == "llama":  # RoPE's tables, rebuilt with the model (not saved in checkpoints)
            cos, sin = rope_tables(cfg.context, cfg.width // cfg.heads, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        # the DyT / Derf recipe's scalar after the embedding (no weight decay: it is not a matrix)
        self.embed_scale = None if cfg.embed_scale_init() is None else nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init (the dissection): N(0, s), residual projections N(0, s / sqrt(2 L)), s = init_std (0.02);
        norms their own; the embedding scalar its value."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.depth))
            elif p.dim() == 2:  # embeddings, qkv, fc (gate, up), untied head
                nn.init.normal_(p, 0.0, std)
        for m in self.norm_modules().values():
            m.reset_parameters()
        if self.embed_scale is not None:
            nn.init.constant_(self.embed_scale, self.cfg.embed_scale_init())

    def match_rms_(self, idx: torch.Tensor) -> dict[str, float]:
        """``norm_init = "match_rms"``: scale each point-wise site's gamma, in forward order, so that its
        output on ``idx`` has RMS 1, RMSNorm's at init (`normlab.recipes.match_rms_`, the one the library's
        `normlab.replace_norms` applies). Returns the factor applied at each site."""
        return match_rms_(self, self.norm_modules(), lambda: self(idx))

    def norm_modules(self) -> dict[str, nn.Module]:
        """Every norm site by name: 'blocks.0.norm_attn', ..., 'norm_final'."""
        return {n: m for n, m in self.named_modules() if n.split(".")[-1] in ("norm_attn", "norm_mlp", "norm_final")}

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape  # (B, T)
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds model.context = {self.cfg.context}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = (self.rope_cos, self.rope_sin) if self.cfg.block == "llama" else None
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(self.norm_final(x))  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
