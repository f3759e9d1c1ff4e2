"""The papers' embedding scale: a learnable scalar, initialised to sqrt(d), that multiplies the embedding's output
before the first block. The DyT paper's LLaMA code (Zhu et al., "Transformers without Normalization", arXiv
2503.10622) scales the token embedding; the Derf paper's GPT-2 patch (Chen et al., "Stronger Normalization-Free
Transformers", arXiv 2512.10938) scales token plus position embeddings. Without a norm to bring the residual stream
to unit scale, this scalar does it at init: with their std-0.02 embeddings at width 4096, sqrt(d) * 0.02 = 1.28.

`ScaledEmbedding` is an ``nn.Embedding`` with that scalar (``scale``), so the table keeps its parameter and its
name (``embed_tokens.weight``, tied to a head where it was) and the scalar is saved beside it
(``embed_tokens.scale``). `scale_embeddings` puts it in place, `replace_norms(init="dyt_paper")` calls it and records
the names, and a saved model gets it back from the record (`normlab.load_converted`, and the modeling file of a
Hugging Face folder). A model with several tables of the model's width (token and position) gets one scalar per
table, equal at init; the paper has one for their sum, which is the same product at init.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ScaledEmbedding", "scale_embeddings", "embedding_tables", "fold_embed_scale"]


class ScaledEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose output is multiplied by a learnable scalar ``scale`` (shape (1,))."""

    def __init__(self, *args, scale_init: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale_init = float(scale_init)
        self.scale = nn.Parameter(torch.full((1,), self.scale_init, device=self.weight.device, dtype=self.weight.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # a DTensor has placements (no import: a Hugging Face folder's modeling file carries this class's text)
        if any(p.is_shard() for p in getattr(self.weight, "placements", ())):
            raise ValueError(
                "ScaledEmbedding: the table is sharded by rows (tensor parallel's RowwiseParallel): its output is a "
                "masked partial sum, which DTensor cannot scale before the reduction. Keep the table replicated in "
                "your plan, or swap with init='default' (no embedding scale)"
            )
        return super().forward(ids) * self.scale

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "scale"):
            with torch.no_grad():
                self.scale.fill_(self.scale_init)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale_init={self.scale_init:g}"

    @classmethod
    def around(cls, emb: nn.Embedding, scale_init: float) -> ScaledEmbedding:
        """A ScaledEmbedding holding ``emb``'s own weight Parameter (a tie to a head stays a tie), on its device and
        in its dtype, in its train/eval mode."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                    "sparse"):  # fmt: skip
            setattr(new, key, getattr(emb, key))
        new.weight = emb.weight
        new.scale_init = float(scale_init)
        w = emb.weight
        new.scale = nn.Parameter(torch.full((1,), new.scale_init, device=w.device, dtype=w.dtype), w.requires_grad)
        return new.train(emb.training)


def embedding_tables(model: nn.Module) -> list[str]:
    """The names of the embedding tables that feed the residual stream: the token embedding (`recipes.input_embedding`)
    and every other ``nn.Embedding`` of its width (positions, token types); empty where the model has none.

    Args:
        model: The model.
    """
    from normlab.recipes import input_embedding

    found = input_embedding(model)
    if found is None:
        return []
    width = found[1].embedding_dim
    return [n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m.embedding_dim == width]


def scale_embeddings(model: nn.Module, names: list[str], scale_init: float | None = None) -> float:
    """Put a `ScaledEmbedding` at each of ``names`` (in place), its scalar initialised to ``scale_init`` (None:
    sqrt(d), d the tables' width); returns the value. A table already scaled is left as it is.

    Args:
        model: The model.
        names: Its embedding tables (`embedding_tables`).
        scale_init: The scalar's initial value.
    """
    from normlab.sites import swap

    value = 1.0
    for name in names:
        emb = model.get_submodule(name)
        value = math.sqrt(emb.embedding_dim) if scale_init is None else float(scale_init)
        if not isinstance(emb, ScaledEmbedding):
            swap(model, name, ScaledEmbedding.around(emb, value))
    return value


def fold_embed_scale(model: nn.Module) -> list[str]:
    """Undo `scale_embeddings` after training: each `ScaledEmbedding`'s learned scalar multiplied into its table,
    which becomes a plain ``nn.Embedding`` again (the same outputs). A table tied to another parameter (a head that
    reads it) is refused: folding would scale the head too. Returns the names folded.

    Args:
        model: The model.
    """
    from normlab.sites import swap

    scaled = [(n, m) for n, m in model.named_modules() if isinstance(m, ScaledEmbedding)]
    tables = {id(m.weight) for _, m in scaled}
    for n, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in tables and not isinstance(m, ScaledEmbedding):
                raise ValueError(
                    f"fold_embed_scale: {n}.{pname} is the same tensor as a scaled embedding's table (tied "
                    "weights): folding the scale into it would scale that layer too; keep the ScaledEmbedding"
                )
    for name, m in scaled:
        shape = (m.num_embeddings, m.embedding_dim)
        plain = nn.Embedding(*shape, m.padding_idx, device=m.weight.device, dtype=m.weight.dtype)
        plain.max_norm, plain.norm_type, plain.scale_grad_by_freq, plain.sparse = (
            m.max_norm,
            m.norm_type,
            m.scale_grad_by_freq,
            m.sparse,
        )
        with torch.no_grad():
            plain.weight.copy_(m.weight * m.scale)
        swap(model, name, plain.train(m.training))
    return [n for n, _ in scaled]
