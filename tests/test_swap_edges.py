"""`normlab.replace_norms` at the edges of large-scale training (issue 96): meta-device init, a bf16 model's norms
without parameters under FSDP2, a model already wrapped by DDP or FSDP, a norm shared by two names, frozen norms, a
bf16 folder reloaded, a refused match_rms, and arguments of the wrong kind. Each test failed on 0.6.2."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import normlab
from normlab.errors import NormlabError
from normlab.registry import norm_spec
from test_swap import TinyGPT, ids, lm_loss, tiny_llama


class Plain(nn.Module):
    """A linear and a norm without parameters (``elementwise_affine=False``): the site that has no dtype of its own."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x):
        return self.ln(self.lin(x))


@contextlib.contextmanager
def one_rank():
    """A gloo process group of one rank in this process, for the wrappers that need one (DDP, fully_shard)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # whatever still holds the group (a DDP reducer) goes first: its destructor joins gloo's threads
        dist.destroy_process_group()


# --------------------------------------------------------------------------
# the meta device
# --------------------------------------------------------------------------
def _kernels(name: str) -> list[str | None]:
    spec = norm_spec(name)
    if "kernel" not in spec.init_kwargs:
        return [None]
    return [k for k in ("auto", "reference", "cpu", "triton") if _takes(spec, k)]


def _takes(spec, kernel) -> bool:
    try:
        spec.create(8, kernel=kernel)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", normlab.list_norms())
def test_every_norm_runs_forward_and_backward_on_the_meta_device(name):
    """SW14: ``to("meta")`` then a forward raised "unknown device type for autocast" on every kernel setting. Meta
    tensors carry shapes and dtypes only, so every setting takes the reference math there."""
    for kernel in _kernels(name):
        m = norm_spec(name).create(16, **({} if kernel is None else {"kernel": kernel})).to("meta")
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(2, 3, 16, device="meta", dtype=dtype, requires_grad=True)
            y = m.to(dtype)(x)
            y.sum().backward()
            assert y.shape == x.shape and y.is_meta and y.dtype == dtype, (name, kernel, dtype)
            assert x.grad is not None and x.grad.is_meta


@pytest.mark.parametrize("to, init", [("dyt", "dyt_paper"), ("dyisru", "dyt_paper"), ("derf", "derf_paper")])
def test_a_meta_model_gets_meta_replacements_that_to_empty_and_reset_fill(to, init):
    """A model built on the meta device (torchtitan, accelerate's init_empty_weights) is swapped without memory; then
    ``to_empty`` and each module's ``reset_parameters`` give exactly the layers a CPU swap gives."""
    with torch.device("meta"):
        model = tiny_llama(width=64, layers=1)
    record = normlab.replace_norms(model, to, init=init)
    news = [model.get_submodule(s.name) for s in record.sites]
    assert all(p.is_meta for m in news for p in m.parameters())
    model.to_empty(device="cpu")
    for m in news:
        m.reset_parameters()
    want = tiny_llama(width=64, layers=1)
    normlab.replace_norms(want, to, init=init)
    for s in record.sites:
        got, ref = model.get_submodule(s.name).state_dict(), want.get_submodule(s.name).state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), f"{s.name}.{k}"


def test_match_rms_on_a_meta_model_is_refused_with_the_way_round():
    with torch.device("meta"):
        model = TinyGPT(depth=1)
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        normlab.replace_norms(model, "dyt", init=["default", "match_rms"], sample=ids().to("meta"))
    assert isinstance(model.ln_f, nn.LayerNorm)


# --------------------------------------------------------------------------
# dtype, device and frozen state of the replacements
# --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["bf16", "meta"])
def test_a_norm_without_parameters_takes_its_block_s_dtype_and_device(where):
    """SW11: a parameterless site of a bf16 (or meta) model got a float32 CPU replacement."""
    model = Plain().to(torch.bfloat16) if where == "bf16" else Plain().to("meta")
    normlab.replace_norms(model, "dyt")
    assert {p.dtype for p in model.parameters()} == {model.lin.weight.dtype}
    assert {p.device for p in model.parameters()} == {model.lin.weight.device}


def test_fsdp2_shards_a_bf16_model_with_a_parameterless_site():
    """SW11's consequence: ``fully_shard`` refused the swapped model ("FSDP expects uniform original parameter
    dtype"); now it shards it and a step runs."""
    from torch.distributed.fsdp import fully_shard

    model = Plain(16).to(torch.bfloat16)
    normlab.replace_norms(model, "dyt")
    with one_rank():
        fully_shard(model)
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
        assert model.ln.alpha.grad is not None


def test_frozen_norms_stay_frozen():
    """SW12: a site whose parameters were frozen came back trainable."""
    model = TinyGPT(depth=1)
    model.h[0].ln_1.requires_grad_(False)
    normlab.replace_norms(model, "dyt")
    assert not any(p.requires_grad for p in model.h[0].ln_1.parameters())
    assert all(p.requires_grad for p in model.h[0].ln_2.parameters())


def test_a_bf16_swap_reloads_as_bf16_through_both_loaders(tmp_path):
    """SW40: a bf16 swap saved with save_converted came back float32 through load_converted (bf16 through
    transformers)."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama().to(torch.bfloat16)
    record = normlab.replace_norms(model, "dyt")
    normlab.save_converted(model, record, tmp_path / "m")
    ours, _ = normlab.load_converted(tmp_path / "m")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True)
    for loaded in (ours, theirs):
        assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
        assert loaded.model.norm.alpha.dtype == torch.bfloat16


# --------------------------------------------------------------------------
# wrapped models, shared norms, a refused call
# --------------------------------------------------------------------------
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "fsdp2_inner", "tp"])
def test_a_wrapped_model_is_refused_with_the_fix(wrap):
    """SW20: a model already wrapped in DDP was swapped without a word, and its replicas then drifted. A wrapper
    keeps its own view of the parameters: swap first, then wrap."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with one_rank():
        model = TinyGPT(depth=1)
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        elif wrap == "fsdp2":
            fully_shard(model)
        elif wrap == "fsdp2_inner":
            fully_shard(model.h[0])
        else:
            parallelize_module(model, init_device_mesh("cpu", (1,)), {"head": ColwiseParallel()})
        for call in (normlab.replace_norms, normlab.convert_norms):
            with pytest.raises(ValueError, match="swap its norms first, then wrap"):
                call(model, "dyt")
        inner = model.module if wrap == "ddp" else model
        assert isinstance(inner.ln_f, nn.LayerNorm)
        del model, inner  # a DDP's reducer holds the group: freed after it, gloo's destructor waited forever


@pytest.mark.parametrize("call", ["replace", "convert"])
def test_a_norm_held_under_two_names_is_swapped_under_both(call):
    """SW9: ``m.b = m.a`` was swapped at one name only, so the two names then held different layers."""
    model = TinyGPT(depth=1)
    model.ln_shared = model.ln_f
    if call == "replace":
        record = normlab.replace_norms(model, "dyt")
        assert any("also at ln_shared" in n for s in record.sites for n in s.notes)
    else:
        record = normlab.convert_norms(model, "dyt")
    assert model.ln_shared is model.ln_f and type(model.ln_f).__name__ == "DyT"
    assert [s.name for s in record.sites] == ["h.0.ln_1", "h.0.ln_2", "ln_f"]


def test_a_refused_match_rms_leaves_the_model_as_it_was():
    """SW26: a sample the forward rejects raised torch's error and left the model swapped with no record."""
    model = TinyGPT(depth=1)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="forward failed.*left as it was"):
        normlab.replace_norms(model, "dyt", init=["dyt_paper", "match_rms"], sample=torch.randn(2, 5))
    assert {n: type(m) for n, m in model.named_modules()} == before


# --------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------
class MyNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init": None}, "init must be a recipe's name"),
        ({"include": "*ln_1"}, r"include must be a function.*fnmatch"),
        ({"roles": ["attn"]}, "roles must be a dict"),
        ({"extra_classes": {"MyNorm": "rms_norm"}}, "keyed by the norm class itself"),
        ({"extra_classes": {MyNorm: "rms"}}, "rms_norm"),
        ({"roles": {"ln_1": "attn"}}, "matches no norm swapped here"),
        ({"init": "default", "sample": ids()}, "sample= is read by init 'auto' and 'match_rms' only"),
    ],
    ids=["init_none", "include_str", "roles_list", "extra_by_name", "extra_kind", "roles_unused", "sample_unused"],
)
def test_arguments_of_the_wrong_kind_or_ignored_are_one_line_errors(kwargs, match):
    """Wrong argument kinds raised raw Python errors (TypeError: 'NoneType' object is not iterable, 'str' object is
    not callable, ...); roles= that matches nothing and sample= without match_rms were ignored silently."""
    model = TinyGPT(depth=1)
    with pytest.raises((TypeError, ValueError), match=match) as e:
        normlab.replace_norms(model, "dyt", **kwargs)
    assert "\n" not in str(e.value) and str(e.value).startswith("replace_norms: ")
    assert isinstance(model.ln_f, nn.LayerNorm)


def test_a_keyword_with_the_default_recipe_is_reported():
    """A keyword given with the default recipe was reported as "default init"."""
    record = normlab.replace_norms(TinyGPT(depth=1), "dyt", per_channel_alpha=True)
    assert "per_channel_alpha=True" in record.table() and "default init" not in record.table()


def test_ddp_on_a_model_swapped_first_keeps_one_model():
    """The order the refusal asks for: swap, then wrap; a step through DDP (one rank) moves the norm's alpha."""
    model = TinyGPT(depth=1)
    normlab.replace_norms(model, "dyt")
    with one_rank():
        ddp = nn.parallel.DistributedDataParallel(model)
        batch = ids()
        lm_loss(ddp(batch), batch).backward()
        assert model.ln_f.alpha.grad is not None and float(model.ln_f.alpha.grad.abs()) > 0
        del ddp  # before the group goes (see test_a_wrapped_model_is_refused_with_the_fix)


# --------------------------------------------------------------------------
# DTensor inputs (tensor and sequence parallel)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", normlab.list_norms())
def test_a_dtensor_input_computes_on_its_shard_or_says_why_not(name):
    """A norm under ``SequenceParallel`` is given a sequence-sharded DTensor with replicated parameters. The fused CPU
    op has no DTensor sharding rule ("Sharding propagation failed" at 0.7.0, on every norm with a kernel, at a size
    the fused path takes); now the auto path runs the reference, which DTensor computes shard by shard: output and
    parameter gradients equal the plain module's. A fused path asked for by name is refused, saying why."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    x = torch.randn(4, 256, 64)  # 65,536 elements: the fused CPU path's size on a plain tensor
    with one_rank():
        mesh = init_device_mesh("cpu", (1,))
        for kernel in _kernels(name):
            kw = {} if kernel is None else {"kernel": kernel}
            plain = norm_spec(name).create(64, **kw)
            with torch.no_grad():
                for p in plain.parameters():
                    p.add_(torch.rand_like(p) * 0.1)  # parameters away from their init, so a mix-up would show
            sharded = copy.deepcopy(plain)
            parallelize_module(sharded, mesh, SequenceParallel())
            if kernel in ("cpu", "triton"):
                with pytest.raises(NormlabError, match="DTensor"):
                    sharded(x)
                continue
            want = plain(x)
            want.square().sum().backward()
            got = sharded(x)
            got.to_local().square().sum().backward()
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-5, msg=f"{name} {kernel}")
            for (n, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
                torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-4, atol=1e-4, msg=f"{name} {n}")
