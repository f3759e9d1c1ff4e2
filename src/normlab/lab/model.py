"""A GPT in reading order: config, attention, MLP, block, model. Every norm comes from the registry.

Pre-norm blocks, x <- x + attn(norm_attn(x)); x <- x + mlp(norm_mlp(x)), and a final norm
before the head. GPT-2 initialisation as in seed 003: normal(0, 0.02) weights and
normal(0, 0.02 / sqrt(2 L)) for the two residual projections of each block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from normlab.registry import accepted_kwargs, create_norm, init_kwargs, norm_spec

__all__ = ["GPTConfig", "GPT"]

SITES = ("attn", "mlp", "final")

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,), "list[str]": (list,)}


def check_types(cfg) -> None:
    """Each field of a config dataclass has its declared type (an int is a float; a bool is not a number)."""
    prefix = "model." if type(cfg).__name__ == "GPTConfig" else ""
    for f in dataclasses.fields(cfg):
        value, declared = getattr(cfg, f.name), str(f.type)
        optional = declared.endswith(" | None")
        kinds = _TYPES.get(declared.removesuffix(" | None"))
        if kinds is None or (optional and value is None):
            continue
        is_number = bool not in kinds
        if not isinstance(value, kinds) or (is_number and isinstance(value, bool)):
            raise ValueError(f"{prefix}{f.name} must be {declared.removesuffix(' | None')}"
                             f"{' or null' if optional else ''}, got {value!r}")  # fmt: skip


@dataclass
class GPTConfig:
    vocab_size: int = 256
    width: int = 128
    depth: int = 4
    heads: int = 4
    context: int = 128
    mlp_ratio: float = 4.0
    tied_embeddings: bool = True
    norm: str = "rms_norm"  # the norm at every site, unless a site overrides it
    norm_kwargs: dict = field(default_factory=dict)  # init values for every site (e.g. alpha_init)
    norm_attn: str | None = None
    norm_mlp: str | None = None
    norm_final: str | None = None
    norm_attn_kwargs: dict = field(default_factory=dict)  # DyT's LLaMA recipe: a different alpha per site
    norm_mlp_kwargs: dict = field(default_factory=dict)
    norm_final_kwargs: dict = field(default_factory=dict)

    def site(self, site: str) -> tuple[str, dict]:
        """The norm name and init kwargs at ``site`` ('attn', 'mlp' or 'final')."""
        name = getattr(self, f"norm_{site}") or self.norm
        return name, accepted_kwargs(name, {**self.norm_kwargs, **getattr(self, f"norm_{site}_kwargs")})

    def site_names(self) -> list[str]:
        """Every norm site by name, as GPT.norm_modules() names them."""
        return [f"blocks.{i}.norm_{s}" for i in range(self.depth) for s in SITES[:2]] + ["norm_final"]

    def validate(self) -> None:
        check_types(self)
        for f in ("vocab_size", "width", "depth", "heads", "context"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f} must be an int >= 1, got {v!r}")
        if self.width % self.heads:
            raise ValueError(f"model.heads = {self.heads} does not divide model.width = {self.width}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"model.mlp_ratio must be > 0, got {self.mlp_ratio}")
        for site in SITES:
            field_name = "norm" if getattr(self, f"norm_{site}") is None else f"norm_{site}"
            try:
                norm_spec(getattr(self, field_name))
            except ValueError as e:
                raise ValueError(f"model.{field_name}: {e}") from None
        every = {k for s in SITES for k in init_kwargs(self.site(s)[0])}
        unused = set(self.norm_kwargs) - every
        if unused:
            raise ValueError(f"model.norm_kwargs: no norm of this model takes {', '.join(sorted(unused))}")
        for site in SITES:
            name = getattr(self, f"norm_{site}") or self.norm
            bad = set(getattr(self, f"norm_{site}_kwargs")) - set(init_kwargs(name))
            if bad:
                raise ValueError(f"model.norm_{site}_kwargs: norm {name!r} does not take {', '.join(sorted(bad))}")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)  # residual projection ("c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=-1)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.width)
        self.fc = nn.Linear(cfg.width, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.width, bias=False)  # residual projection ("c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        name, kw = cfg.site("attn")
        self.norm_attn = create_norm(name, cfg.width, **kw)
        self.attn = CausalSelfAttention(cfg)
        name, kw = cfg.site("mlp")
        self.norm_mlp = create_norm(name, cfg.width, **kw)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))  # (B, T, C)
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        name, kw = cfg.site("final")
        self.norm_final = create_norm(name, cfg.width, **kw)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init (seed 003): N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)); norms their own."""
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.cfg.depth))
            elif p.dim() == 2:  # embeddings, qkv, fc, untied head
                nn.init.normal_(p, 0.0, 0.02)
        for m in self.norm_modules().values():
            m.reset_parameters()

    def norm_modules(self) -> dict[str, nn.Module]:
        """Every norm site by name: 'blocks.0.norm_attn', ..., 'norm_final'."""
        return {n: m for n, m in self.named_modules() if n.split(".")[-1] in ("norm_attn", "norm_mlp", "norm_final")}

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape  # (B, T)
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds model.context = {self.cfg.context}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm_final(x))  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
