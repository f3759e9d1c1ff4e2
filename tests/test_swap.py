"""`normlab.replace_norms`: the papers' drop-in in a model you train, with their init recipes, where training happens
(torch.compile, CPU autocast, DDP and FSDP2 over gloo, torch.export, state_dict, a Hugging Face folder), on the
fused CPU path (asserted by the ops that ran, not assumed).

The models are the smallest that show each property: widths of 64 (and 2048 where the DyT paper's alpha0 differs by
site), one or two blocks, a vocabulary of 64."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import normlab
from normlab.elementwise import DyISRU, DyT
from normlab.kernels.paths import fused_ops
from normlab.recipes import DYT_PAPER_ALPHA0, MATCH_RMS_CAVEAT


# --------------------------------------------------------------------------
# the three kinds of model a user brings
# --------------------------------------------------------------------------
class Block(nn.Module):
    """A nanoGPT-style block: ln_1 before attention, ln_2 before the MLP."""

    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln_1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, depth: int = 2, context: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


class ViTBlock(nn.Module):
    """A ViT-style block (timm's names), with a conv stem whose BatchNorm is no per-token norm."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, d, 4, 4), nn.BatchNorm2d(d))
        self.norm1, self.norm2, self.norm = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, img):
        x = self.stem(img).flatten(2).transpose(1, 2)  # (B, patches, d)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.norm(x).mean(1)


def tiny_llama(width: int = 64, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=width, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(cfg)


def ids(b: int = 4, t: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits, idx):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


# --------------------------------------------------------------------------
# what it finds, what it builds, what each recipe sets
# --------------------------------------------------------------------------
def test_every_norm_of_a_nanogpt_is_replaced_with_fresh_layers():
    model = TinyGPT()
    with torch.no_grad():
        model.ln_f.weight.fill_(3.0)  # a trained gamma is *not* carried over: the layers are fresh
    record = normlab.replace_norms(model, "dyt", init="default")
    assert [s.name for s in record.sites] == ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"]
    assert [s.notes[0] for s in record.sites] == ["role attn", "role mlp"] * 2 + ["role final"]
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    assert isinstance(model.ln_f, DyT) and torch.equal(model.ln_f.weight, torch.ones(64))
    assert model.ln_f.alpha.item() == 0.5  # DyT's default alpha0
    assert "h.0.ln_1" in record.table() and len(record) == 5


def test_the_dyt_paper_recipe_sets_alpha0_by_width_and_site():
    """At width 2048 the DyT paper's alpha0 is 1.0 before attention and 0.5 before the FFN and at the final norm
    (its Table 11 row); DyISRU gets beta0 = 1 / alpha0^2, the slope-matching map."""
    attn, other = DYT_PAPER_ALPHA0[2048]
    assert (attn, other) == (1.0, 0.5)
    model = tiny_llama(width=2048, layers=1)
    normlab.replace_norms(model, "dyt", init="dyt_paper")
    layer = model.model.layers[0]
    assert layer.input_layernorm.alpha.item() == attn
    assert layer.post_attention_layernorm.alpha.item() == other and model.model.norm.alpha.item() == other
    model = tiny_llama(width=2048, layers=1)
    record = normlab.replace_norms(model, "dyisru", init="dyt_paper")
    assert isinstance(model.model.norm, DyISRU)
    assert math.isclose(model.model.layers[0].input_layernorm.beta.item(), 1 / attn**2, rel_tol=1e-6)
    assert math.isclose(model.model.norm.beta.item(), 1 / other**2, rel_tol=1e-6)
    assert "beta0 = 1/alpha0^2" in record.table()


def test_derf_gets_its_published_init():
    """A language model (a token embedding) gets the Derf paper's GPT-2 values: alpha0 1.0, shift0 0 (0.5 in its
    vision models, tested below)."""
    model = TinyGPT()
    normlab.replace_norms(model, "derf", init="derf_paper")
    assert model.ln_f.alpha.item() == 1.0 and model.ln_f.shift.item() == 0.0


def test_match_rms_makes_each_sites_output_rms_one_on_the_batch():
    model = tiny_llama()
    batch = ids()
    record = normlab.replace_norms(model, "dyt", init=["dyt_paper", "match_rms"], sample=batch)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, y: seen.append(float(y.pow(2).mean().sqrt())))
             for m in model.modules() if isinstance(m, DyT)]  # fmt: skip
    with torch.no_grad():
        model(batch)
    for h in hooks:
        h.remove()
    assert len(seen) == 5 and all(abs(r - 1) < 1e-4 for r in seen), seen
    assert MATCH_RMS_CAVEAT in record.notes  # the caveat travels with the record
    assert all(any(n.startswith("match_rms: gamma x") for n in s.notes) for s in record.sites)


def test_the_lab_gpt_matches_rms_with_the_same_call():
    """The lab's GPT and replace_norms share normlab.recipes.match_rms_: the same factors on the same model."""
    from normlab.lab.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, width=64, depth=2, heads=4, context=32, norm="dyt")
    torch.manual_seed(0)
    gpt = GPT(cfg)
    idx = ids(2, 16)
    twin = GPT(cfg)
    twin.load_state_dict(gpt.state_dict())
    factors = gpt.match_rms_(idx)
    from normlab.recipes import match_rms_

    again = match_rms_(twin, twin.norm_modules(), lambda: twin(idx))
    assert factors == again and len(factors) == 5


# --------------------------------------------------------------------------
# what it refuses, before touching the model
# --------------------------------------------------------------------------
class MyNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize(
    ("make", "kwargs", "says"),
    [
        (lambda: nn.Sequential(nn.Linear(8, 8)), {}, "has no norm to replace"),
        (lambda: nn.Sequential(nn.LayerNorm(8), MyNorm(8)), {}, "MyNorm, a norm class normlab does not know"),
        (lambda: TinyGPT(), {"init": "derf_paper"}, "Derf's published init"),
        (lambda: TinyGPT(), {"to": "rms_norm", "init": "dyt_paper"}, "takes neither"),
        (lambda: TinyGPT(), {"init": "match_rms"}, "needs sample="),
        (lambda: TinyGPT(), {"to": "rms_norm", "init": "match_rms", "sample": ids()}, "not one"),
        (lambda: TinyGPT(), {"init": "warmup"}, "unknown init recipe 'warmup'"),
        (lambda: TinyGPT(), {"init": ["match_rms", "dyt_paper"]}, "optionally followed by 'match_rms'"),
        (lambda: TinyGPT(), {"to": "tanhh"}, "tanhh"),
        (lambda: TinyGPT(), {"init": "dyt_paper", "alpha_init": 0.3}, "give it once"),
        (lambda: TinyGPT(), {"gamma": 2}, "does not take gamma"),
        (lambda: TinyGPT(), {"roles": {"*ln_1": "ffn"}}, "a role is one of attn, mlp, final"),
    ],
)
def test_what_cannot_work_is_refused_and_the_model_left_as_it_was(make, kwargs, says):
    model = make()
    before = [type(m) for m in model.modules()]
    kwargs = {"to": "dyt", **kwargs}
    with pytest.raises((ValueError, TypeError)) as err:
        normlab.replace_norms(model, **kwargs)
    assert says in str(err.value), str(err.value)
    assert [type(m) for m in model.modules()] == before


def test_an_unknown_norm_class_names_both_fixes_and_each_works():
    model = nn.Sequential(nn.LayerNorm(8), MyNorm(8))
    with pytest.raises(ValueError, match=r"extra_classes=\{MyNorm: 'rms_norm'\}.*include=lambda name, m: not"):
        normlab.replace_norms(model, "dyt")
    assert len(normlab.replace_norms(model, "dyt", extra_classes={MyNorm: "rms_norm"})) == 2
    model = nn.Sequential(nn.LayerNorm(8), MyNorm(8))
    record = normlab.replace_norms(model, "dyt", include=lambda name, m: not isinstance(m, MyNorm))
    assert len(record) == 1 and isinstance(model[1], MyNorm)


def test_a_site_whose_role_the_recipe_needs_is_named_with_the_fix():
    """At width 2048 alpha0 depends on the site; a norm named 'pre' says nothing: refused, naming roles=."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.RMSNorm(2048)

        def forward(self, x):
            return self.pre(x)

    with pytest.raises(ValueError, match=r"the name 'pre' does not say: pass roles=\{'\*pre': 'attn'\}"):
        normlab.replace_norms(Net(), "dyt", init="dyt_paper")
    net = Net()
    normlab.replace_norms(net, "dyt", init="dyt_paper", roles={"*pre": "attn"})
    assert net.pre.alpha.item() == 1.0
    small = nn.Sequential(nn.RMSNorm(64))  # at width 64 every site's alpha0 is the same: no role needed
    normlab.replace_norms(small, "dyt", init="dyt_paper")
    assert small[0].alpha.item() == DYT_PAPER_ALPHA0[1024][0]


def test_a_vit_block_with_a_batchnorm_stem():
    """BatchNorm2d is a "Norm" normlab does not replace: refused until include= leaves it; the three LayerNorms are
    replaced and the block trains."""
    model = ViTBlock()
    with pytest.raises(ValueError, match="stem.1 is a BatchNorm2d"):
        normlab.replace_norms(model, "dyt")
    record = normlab.replace_norms(model, "dyt", include=lambda name, m: not isinstance(m, nn.BatchNorm2d))
    assert [(s.name, s.notes[0]) for s in record.sites] == [
        ("norm1", "role attn"), ("norm2", "role mlp"), ("norm", "role final")]  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    img, target = torch.randn(8, 3, 16, 16), torch.randn(8, 64)
    losses = []
    for _ in range(20):
        loss = (model(img) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


# --------------------------------------------------------------------------
# where training happens
# --------------------------------------------------------------------------
def test_the_fused_cpu_kernel_runs_inside_a_swapped_model():
    """Observed, not assumed: the ops that ran in a training step and in inference include normlab's own."""
    from normlab.kernels import cpu

    if not cpu.ready(wait=True):
        pytest.fail("the CPU kernels did not build here")
    model = TinyGPT(d=256)
    normlab.replace_norms(model, "dyt")
    batch = ids(4, 64)  # 4 x 64 x 256 = 65,536 elements a norm: where "auto" fuses a training call
    step = fused_ops(lambda: lm_loss(model(batch), batch).backward())
    assert step["normlab_cpu::pointwise_fwd"] == 5 and step["normlab_cpu::pointwise_bwd"] == 5, step
    with torch.no_grad():
        assert fused_ops(lambda: model(batch))["normlab_cpu::pointwise_fwd"] == 5
    llama = tiny_llama()
    normlab.replace_norms(llama, "dyisru")  # DyISRU fuses at every size
    assert fused_ops(lambda: llama(ids()).logits.sum().backward())["normlab_cpu::pointwise_bwd"] == 5


@pytest.mark.slow
def test_a_swapped_model_compiles_with_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(depth=1)
    normlab.replace_norms(model, "dyt", init="dyt_paper")
    batch = ids(2, 16)
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises here
    torch.testing.assert_close(compiled(batch), model(batch), rtol=1e-4, atol=1e-4)
    lm_loss(compiled(batch), batch).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_swapped_model_trains_under_cpu_autocast_in_bf16():
    torch.manual_seed(0)
    model = TinyGPT(d=256)
    normlab.replace_norms(model, "dyt")
    batch = ids(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch)
        ops = fused_ops(lambda: model(batch))
    assert logits.dtype == torch.bfloat16 and ops["normlab_cpu::pointwise_fwd"] == 5
    lm_loss(logits.float(), batch).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        full = model(batch).float()
    assert (logits.float() - full).abs().max() < 0.1 * full.abs().max()  # bf16 rounding, not another model


def test_torch_export_of_a_swapped_model():
    model = TinyGPT(depth=1)
    normlab.replace_norms(model, "dyisru", init="dyt_paper")
    model.eval()
    batch = ids(2, 16)
    exported = torch.export.export(model, (batch,))
    assert not [n for n in exported.graph.nodes if "normlab" in str(n.target)]  # traced through the formulas
    for m in model.modules():  # so the eager model on the same path: the fused kernels round differently (their
        if hasattr(m, "kernel"):  # tolerance against the formulas is tests/kernels/kernel_checks.py's)
            m.kernel = "reference"
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(batch), model(batch), rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip(tmp_path):
    model = TinyGPT(depth=1)
    normlab.replace_norms(model, "derf", init="derf_paper")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = ids()
    for _ in range(3):
        opt.zero_grad()
        lm_loss(model(batch), batch).backward()
        opt.step()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    again = TinyGPT(depth=1)
    normlab.replace_norms(again, "derf", init="derf_paper")  # the same structure, then the trained weights
    again.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: every key matches
    with torch.no_grad():
        torch.testing.assert_close(again(batch), model(batch), rtol=0, atol=0)
    assert again.ln_f.shift.item() != 0.0  # trained, and carried


def test_a_hugging_face_llama_trained_from_scratch_saves_and_loads_back(tmp_path):
    """The HF path: a config, the swap, a few steps, `normlab.save_converted` (the record is a ConversionRecord),
    then the folder loads with the right layers both through normlab and through transformers alone."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    record = normlab.replace_norms(model, "dyt", init=["dyt_paper", "match_rms"], sample=ids())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = ids(8, 32, seed=3)
    losses = []
    for _ in range(8):
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0]
    model.eval()
    normlab.save_converted(model, record, tmp_path / "dyt-llama")
    with torch.no_grad():
        want = model(batch).logits
    loaded, rec = normlab.load_converted(tmp_path / "dyt-llama")
    assert isinstance(loaded.model.norm, DyT) and rec.target == "dyt" and len(rec.sites) == 5
    alone = AutoModelForCausalLM.from_pretrained(tmp_path / "dyt-llama", trust_remote_code=True)
    assert not any("RMSNorm" in type(m).__name__ for m in alone.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(alone(batch).logits, want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------
# DDP and FSDP2 over gloo, 2 processes
# --------------------------------------------------------------------------
def _distributed_worker(rank: int, world: int, init: str, kind: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyGPT(depth=1)
        normlab.replace_norms(model, "dyt", init="dyt_paper")
        if kind == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.h:
                fully_shard(block)
            wrapped = fully_shard(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        batch = ids(4, 16, seed=10 + rank)  # each rank its own half of the batch
        opt.zero_grad()
        lm_loss(wrapped(batch), batch).backward()
        opt.step()
        if kind == "fsdp":
            from torch.distributed.tensor import DTensor

            state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in wrapped.state_dict().items()}
        else:
            state = model.state_dict()
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in state.items()}, out)
        del wrapped, opt, state
        dist.barrier()  # no rank tears gloo down while the other still has work in flight (a SIGABRT, once, on 2.14.1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_over_gloo_train_as_one_process_would(kind, tmp_path):
    """Two ranks, each on half the batch, one SGD step: the weights equal one process's step on the whole batch
    (the gradients averaged across ranks), the norms' alpha, gamma and beta included."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.pop("NORMLAB_KERNEL", None)
    mp.start_processes(_distributed_worker, args=(2, init, kind, str(out)), nprocs=2, join=True, start_method="spawn")
    torch.manual_seed(0)
    model = TinyGPT(depth=1)
    normlab.replace_norms(model, "dyt", init="dyt_paper")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    loss = sum(lm_loss(model(ids(4, 16, seed=10 + r)), ids(4, 16, seed=10 + r)) for r in range(2)) / 2
    loss.backward()
    opt.step()
    got = torch.load(out, weights_only=True)
    want = model.state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=f"{kind}: {k}")
    assert float(got["ln_f.alpha"]) != DYT_PAPER_ALPHA0[1024][1]  # the step moved the norm's own parameter
