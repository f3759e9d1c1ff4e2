"""A plain-PyTorch transformer with normlab's DyT, trained a few AdamW steps under ``torchrun`` with FSDP2 in mixed
precision (bf16 blocks, norms kept in float32) or tensor parallel with sequence parallel on the norms; the losses go
to a JSON file. ``tests/distributed/test_scale_out.py`` runs it with 1 and 2 processes over gloo and compares.

    torchrun --nproc-per-node 2 tests/distributed/scale_out.py --mode tp --out losses.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import normlab

VOCAB, WIDTH, HEADS, DEPTH, SEQ, BATCH, STEPS = 96, 64, 4, 2, 32, 4, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        b, t = h.shape[:2]
        q, k, v = (w(h).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.wo(a)  # -1 above: the heads this rank holds under tensor parallel, all of them otherwise
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm, self.output = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build() -> Tiny:
    """The model every mode starts from: seed 0, then the norms swapped (before any wrapping)."""
    torch.manual_seed(0)
    model = Tiny()
    normlab.replace_norms(model, "dyt", init="default")  # no embedding scale: RowwiseParallel places weight only
    return model


def fsdp_mixed(model: Tiny) -> Tiny:
    """FSDP2: bf16 parameters and float32 gradient reduction for the blocks; every norm its own group kept in
    float32 (its input cast up, its output back to bf16 for the next matmul)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    norms = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    for name, m in model.named_modules():
        if name.endswith("norm"):
            fully_shard(m, mp_policy=norms)
    for layer in model.layers:
        fully_shard(layer, mp_policy=blocks)
    return fully_shard(model, mp_policy=blocks)


def tensor_parallel(model: Tiny) -> Tiny:
    """Megatron-style TP on a 1-D mesh: attention and MLP column- then row-wise, the norms sequence parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    for layer in model.layers:
        seq_in = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "up": ColwiseParallel()}
        seq_out = {"wo": RowwiseParallel(output_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
        norms = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(layer, mesh, {**seq_in, **seq_out, **norms})
    return model


def batch(step: int, rank: int, ranks: int, mode: str) -> torch.Tensor:
    """The step's global batch, fixed by the step; FSDP gives each rank its share, TP every rank all of it."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    if mode == "fsdp":
        return ids.chunk(ranks)[rank]
    return ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "fsdp", "tp"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    model = build()
    if args.mode != "plain":  # plain: the model as it is, float32, one process: the run the others are held to
        model = fsdp_mixed(model) if args.mode == "fsdp" else tensor_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    seen: dict[str, str] = {}
    for name, m in model.named_modules():  # the dtype each layer computes in, as its forward sees it
        if isinstance(m, (nn.Linear, normlab.DyT)):
            m.register_forward_pre_hook(lambda mod, a, n=name: seen.setdefault(n, str(mod.weight.dtype)) and None)
    losses = []
    for step in range(STEPS):
        ids = batch(step, rank, ranks, args.mode)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if args.mode == "fsdp":  # each rank's mean over its share; the global batch's mean is their mean
            dist.all_reduce(total)
            total /= ranks
        losses.append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "dtypes": seen, "ranks": ranks, "pid": os.getpid()}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
