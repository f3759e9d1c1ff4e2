"""Calibration on cached block inputs (normlab.conversion.calibrate.stream): the same fits as re-running the converted
prefix,
for every family `normlab convert` supports, and the re-running path where a model has no chain of blocks. Also the
float32 profile solver against the float64 L-BFGS one (normlab.conversion.calibrate.sites.fit_replacement)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normlab
import normlab.conversion.calibrate.sites as calibrate
from conftest import id_batches, sink_batches, tiny_lm, with_sinks
from normlab.conversion.calibrate.stream import BlockStream, find_blocks

pytest.importorskip("transformers")

FAMILIES = ["Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma3"]


def _convert(model, to="dyisru", *, blocks=True, monkeypatch=None, **kw):
    if not blocks:
        monkeypatch.setattr(calibrate, "find_blocks", lambda *a, **k: None)
    record = normlab.convert_norms(model, to, calibrate=sink_batches(2, t=12), progress=False, **kw)
    if not blocks:
        monkeypatch.undo()
    return record


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("massive_tokens", ["auto", "shared"])
@pytest.mark.parametrize("per", ["global", "channel"])
def test_the_block_stream_fits_what_re_running_the_prefix_fits(family, massive_tokens, per, monkeypatch):
    model = with_sinks(tiny_lm(family, layers=3))
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = _convert(a, massive_tokens=massive_tokens, per=per)
    rb = _convert(b, blocks=False, monkeypatch=monkeypatch, massive_tokens=massive_tokens, per=per)
    assert ra.calibration["path"] == "blocks" and rb.calibration["path"] == "prefix"
    assert ra.calibration["outside"] == []  # every site streams, the final norm (the last block's output) included
    assert [s.massive for s in ra.sites] == [s.massive for s in rb.sites]
    assert any(s.massive for s in ra.sites) == (massive_tokens == "auto")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=0, msg=name)


def test_per_head_norms_share_their_replacement_when_massive_tokens_have_their_own():
    """Qwen3's q_norm and k_norm normalize (B, T, heads, head_dim), not the residual stream: no massive copy there
    (a first version crashed calibration with an expand error); the residual-stream sites get one."""
    model = with_sinks(tiny_lm("Qwen3"))
    record = _convert(model)
    copies = {s.name: s.massive is not None for s in record.sites}
    assert copies["model.layers.0.self_attn.q_norm"] is False and copies["model.layers.0.self_attn.k_norm"] is False
    assert copies["model.layers.0.input_layernorm"] is True and copies["model.norm"] is True


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("to", normlab.conversion.convert.CALIBRATABLE)
def test_every_family_and_target_calibrates_saves_and_reloads(family, to, tmp_path):
    """The family matrix: every supported family, every calibratable target, massive tokens routed and shared, per
    global and channel; the reloaded model gives the converted model's logits."""
    ids = sink_batches(1, seed=5, t=12)[0]
    for massive, per in (("auto", "channel"), ("shared", "global"), ("auto", "global"), ("shared", "channel")):
        model = with_sinks(tiny_lm(family))
        record = _convert(model, to, massive_tokens=massive, per=per)
        assert all(s.fit is not None for s in record.sites)
        out = tmp_path / f"{massive}-{per}"
        normlab.save_converted(model, record, out)
        loaded, _ = normlab.load_converted(out)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_model_without_blocks_takes_the_prefix_path_and_says_why():
    model = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.Linear(16, 16), nn.RMSNorm(16), nn.Linear(16, 4))
    record = normlab.convert_norms(model, "dyisru", calibrate=[torch.randn(32, 8)], progress=False)
    assert record.calibration["path"] == "prefix"
    assert "no decoder blocks" in record.calibration["why"]
    assert find_blocks(model, ["1", "3"]) is None


def test_find_blocks_asks_for_two_blocks_with_sites_unless_told_one():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(4)

    model = nn.Module()
    model.head = nn.ModuleList([nn.Linear(4, 4), nn.RMSNorm(4)])  # mixed classes: never the blocks
    model.layers = nn.ModuleList([Block() for _ in range(3)])
    one, two = ["layers.2.norm", "head.1"], ["layers.0.norm", "layers.2.norm"]
    assert find_blocks(model, one) is None  # one block holds a site: calibration has nothing to stream
    assert find_blocks(model, one, least=1) == ("layers", 3)  # a heal freezes blocks 0 and 1
    assert find_blocks(model, two) == find_blocks(model, two, least=1) == ("layers", 3)
    assert find_blocks(model, ["head.1"], least=1) is None


class _Unchained(nn.Module):
    """Blocks in a ModuleList, with ``between`` applied between them, or run in another ``order``: not a chain the
    stream may replay. A final norm reads ``last`` of the last block's output."""

    def __init__(self, between=lambda x: x, order=(0, 1, 2), last=lambda x: x):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.RMSNorm(16), nn.Linear(16, 16)) for _ in range(3))
        self.norm = nn.RMSNorm(16)
        self.between, self.order, self.last = between, order, last

    def forward(self, x):
        for i in self.order:
            x = self.between(self.blocks[i](x))
        return self.norm(self.last(x))


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (_Unchained(between=lambda x: 2 * x), "is not blocks.0's output"),
        (_Unchained(order=(0, 2, 1)), "once each, in order"),
        (_Unchained(), None),
    ],
)
def test_blocks_that_do_not_chain_leave_the_model_on_the_prefix_path(model, why):
    record = normlab.convert_norms(model, "dyisru", calibrate=[torch.randn(4, 6, 16)], progress=False)
    assert record.calibration["path"] == ("prefix" if why else "blocks")
    if why:
        assert why in record.calibration["why"]
    else:
        assert record.calibration["outside"] == []


def test_a_final_norm_that_does_not_read_the_last_block_re_runs_the_model_and_fits_the_same(monkeypatch):
    model = _Unchained(last=lambda x: x + 1.0)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    data = [torch.randn(4, 6, 16)]
    ra = normlab.convert_norms(a, "dyisru", calibrate=data, progress=False)
    monkeypatch.setattr(calibrate, "find_blocks", lambda *a, **k: None)
    normlab.convert_norms(b, "dyisru", calibrate=data, progress=False)
    assert ra.calibration["path"] == "blocks" and ra.calibration["outside"] == ["norm"]
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=0)


def test_a_stream_too_big_for_the_machine_is_refused_with_its_size(monkeypatch):
    model = tiny_lm("Llama")
    stream = BlockStream(model, "model.layers", 2)
    with stream.record():
        model(id_batches(1)[0], use_cache=False)
    monkeypatch.setattr(
        "normlab.conversion.calibrate.stream.machine_memory", lambda: stream.memory()
    )  # half of it is too little
    stream.check_fits()
    assert stream.broken and "would not fit" in stream.broken


def test_a_replay_from_a_sites_block_measures_what_the_whole_model_measures():
    """BlockReplay: blocks before the changed site's block replay their kept outputs; the cross-entropy equals a
    pass of the whole model, for a site in a middle block and for the final norm, and commit keeps a change."""
    from normlab.conversion.calibrate.stream import BlockReplay
    from normlab.conversion.measure.fidelity import cross_entropy
    from normlab.sites import swap

    model = tiny_lm("Llama", layers=3)
    batches = id_batches(2, t=12)
    sites = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    replay = BlockReplay(model, batches, find_blocks(model, sites), sites)
    assert replay.measure() == pytest.approx(cross_entropy(model, batches), abs=1e-6)
    assert replay.block_of("model.layers.1.input_layernorm") == 1 and replay.block_of("model.norm") == 3
    for name in ("model.layers.1.post_attention_layernorm", "model.norm"):
        old = swap(model, name, normlab.create_norm("dyt", 32, alpha_init=2.0))
        full = cross_entropy(model, batches)
        assert replay.measure(replay.block_of(name), keep=False) == pytest.approx(full, abs=1e-6)
        replay.commit()
        assert replay.measure(3) == pytest.approx(full, abs=1e-6)  # the kept outputs carry the change
    swap(model, "model.norm", old)
    assert replay.measure(3) == pytest.approx(cross_entropy(model, batches), abs=1e-6)


def test_a_bf16_replay_replays_its_own_passes_exactly_and_reads_near_float32():
    """BlockReplay(dtype=bf16), the budget walk's default where bf16 runs natively: a replay from a block equals a
    whole bf16 pass, and the bf16 cross-entropy is within bf16's rounding of the float32 one."""
    from normlab.conversion.batches import autocast_dtype
    from normlab.conversion.calibrate.stream import BlockReplay
    from normlab.conversion.measure.fidelity import cross_entropy
    from normlab.sites import swap

    model = tiny_lm("Llama", layers=3)
    if autocast_dtype("auto", model, "budget.precision")[0] is None:
        pytest.skip("bf16 does not run natively on this CPU")
    batches = id_batches(2, t=12)
    sites = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    replay = BlockReplay(model, batches, find_blocks(model, sites), sites, torch.bfloat16)
    first = replay.measure()
    assert first != cross_entropy(model, batches) and first == pytest.approx(cross_entropy(model, batches), abs=0.02)
    name = "model.layers.1.post_attention_layernorm"
    swap(model, name, normlab.create_norm("dyt", 32, alpha_init=2.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = cross_entropy(model, batches)
    assert replay.measure(replay.block_of(name)) == pytest.approx(whole, abs=1e-6)


def test_a_subset_of_early_sites_streams_though_its_passes_stop_before_the_last_block(monkeypatch):
    """Calibration passes stop once every site has run: sites only in blocks 0-1 of 4 still take the stream (the
    budget walk's refit of its kept sites converts such subsets), with the prefix path's fits."""
    model = with_sinks(tiny_lm("Llama", layers=4))
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    early = lambda name, m: name.startswith(("model.layers.0.", "model.layers.1."))  # noqa: E731
    ra = _convert(a, include=early)
    rb = _convert(b, blocks=False, monkeypatch=monkeypatch, include=early)
    assert ra.calibration["path"] == "blocks" and ra.calibration["outside"] == [] and rb.calibration["path"] == "prefix"
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Qwen3", "Gemma", "Mistral"])
def test_a_replay_stands_in_for_the_early_blocks_in_the_models_own_list(family):
    """What a replay relies on in transformers: the decoder calls each block through its list of blocks at call
    time, and reads the block's attributes (Qwen2's and Gemma's ``attention_type``) before calling it. A replay puts
    a stand-in (`Replayed`) in the list for each block before the changed one: those blocks do not run, the
    cross-entropy equals the whole model's, and the list holds the real blocks again after."""
    from normlab.conversion.calibrate.stream import BlockReplay
    from normlab.conversion.measure.fidelity import cross_entropy
    from normlab.sites import swap

    model = tiny_lm(family, layers=3)
    batches = id_batches(2, t=12)
    sites = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    replay = BlockReplay(model, batches, find_blocks(model, sites), sites)
    replay.measure()
    layers = list(model.model.layers)
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    name = "model.layers.2.input_layernorm"
    swap(model, name, normlab.create_norm("dyt", 32, alpha_init=2.0))
    got = replay.measure(replay.block_of(name), keep=False)
    assert set(ran) == {2}  # blocks 0 and 1 were replayed, not run
    assert list(model.model.layers) == layers  # the real blocks are back in the list
    for h in hooks:
        h.remove()
    assert got == pytest.approx(cross_entropy(model, batches), abs=1e-6)
