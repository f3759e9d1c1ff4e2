"""Massive tokens (normlab.conversion.calibrate.massive): the data their copy is fitted on, and a converted model that
no input breaks. The stress inputs put the massive tokens where a position rule misses them: two at the start (a
leading "\\n\\n"), one mid-sequence, a BOS after other text, a left-padded batch, a chunk after a KV cache and
one-token calls."""

from __future__ import annotations

import copy

import pytest
import torch

import normlab
from conftest import id_batches, sink_batches, tiny_lm, with_sinks
from normlab.conversion.calibrate.massive import MassiveRows, MassiveTokens, detector, early_token_batches

transformers = pytest.importorskip("transformers")

BOUND = 0.35  # the largest relative logit error per token a routed conversion may show on a stress input (0.27 on
# text without sinks: the tiny random model's own conversion error)


def test_early_token_batches_double_each_distinct_calibration_token():
    calib = [torch.tensor([[5, 7, 7, 9], [9, 11, 5, 5]]), torch.tensor([[13, 13, 2, 7]])]
    seqs = torch.cat(early_token_batches(calib, max_tokens=100, size=2))
    assert seqs.shape == (6, 2) and torch.equal(seqs[:, 0], seqs[:, 1])
    assert sorted(seqs[:, 0].tolist()) == [2, 5, 7, 9, 11, 13]
    capped = torch.cat(early_token_batches(calib, max_tokens=3))
    assert len(capped) == 3 and set(capped[:, 0].tolist()) <= {2, 5, 7, 9, 11, 13}
    assert len(set(capped[:, 0].tolist())) == 3


@pytest.mark.parametrize(
    "batches",
    [
        [torch.randn(2, 4, 8)],  # not token ids (an image or embedding input)
        [torch.arange(8)],  # no batch axis
        [{"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}],  # more than ids
    ],
)
def test_early_token_batches_are_empty_when_the_batches_are_not_plain_token_ids(batches):
    assert early_token_batches(batches, max_tokens=100) == []


def test_early_rows_are_the_original_models_first_two_positions():
    """A causal model's first positions see only the tokens before them: the rows taken from the [t, t] pairs equal
    the model's activations at positions 0 and 1 of a long sequence that starts with t, t. On the original
    (``sequential=False``, each budget-walk refit) inputs and outputs come from one pass over the pairs, not two."""
    model = tiny_lm()
    name = "model.layers.1.input_layernorm"
    passes = []
    counting = model.register_forward_pre_hook(lambda m, a: passes.append(1))
    rows = MassiveRows(model, id_batches(2), {name: -1}, max_tokens=4096, sequential=False)
    counting.remove()
    assert len(passes) == len(rows.pairs)
    pairs = torch.cat(rows.pairs)
    x, y = rows(model, name)
    assert x.shape == y.shape == (2 * len(pairs), 32)
    seen = {}
    hook = model.get_submodule(name).register_forward_hook(lambda m, a, o: seen.update(x=a[0], y=o))
    with torch.no_grad():
        model(torch.cat([pairs, torch.randint(0, 100, (len(pairs), 9))], 1))
    hook.remove()
    torch.testing.assert_close(x, seen["x"][:, :2].reshape(-1, 32).float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, seen["y"][:, :2].reshape(-1, 32).float(), rtol=1e-4, atol=1e-5)


def test_the_detector_separates_by_a_few_channels_or_declines():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=g)
    assert detector(x, massive=10.0) is None  # nothing massive
    x[:5, 3] = 300.0  # five massive rows, in channel 3
    found = detector(x, massive=10.0)
    assert found is not None and 3 in found.channels and len(found.channels) == 4
    assert found.route(x)[:5].all() and not found.route(x)[5:].any() and found.massive_rows == 5
    x[5, 3] = 30.0  # an ordinary row (RMS under 10x the median) 10x below the massive ones in channel 3
    assert not detector(x, massive=10.0, min_margin=4.0).route(x)[5]
    assert detector(x, massive=10.0, min_margin=20.0) is None  # no cut that clean: declined, not guessed


def _stress(vocab: int = 100) -> dict[str, torch.Tensor]:
    """Inputs where the sinks (0: a BOS, 1: a delimiter) sit anywhere, each (1, T)."""
    g = torch.Generator().manual_seed(7)
    body = torch.randint(2, vocab, (64,), generator=g)
    seqs = {
        "leading delimiters": torch.cat([torch.tensor([1, 1]), body]),
        "BOS then a delimiter": torch.cat([torch.tensor([0, 1]), body]),
        "repeated delimiters mid-sequence": torch.cat([body[:10], torch.tensor([1, 1, 1]), body[10:]]),
        "BOS mid-sequence": torch.cat([body[:20], torch.tensor([0]), body[20:]]),
        "no BOS at all": body,
        "long, sinks every 50 tokens": torch.cat([torch.cat([torch.tensor([1]), body[:49]]) for _ in range(6)]),
    }
    return {k: v[None] for k, v in seqs.items()}


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative error of logits ``b`` against ``a`` over the positions."""
    return float(((b - a).norm(dim=-1) / a.norm(dim=-1)).max())


def _calls(model, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """The logits of ``x`` (1, T) computed in chunks ending at ``cuts``, each after the KV cache of the ones before."""
    out, past, start = [], None, 0
    with torch.no_grad():
        for end in [*cuts, x.shape[1]]:
            o = model(x[:, start:end], past_key_values=past, use_cache=True)
            out.append(o.logits)
            past, start = o.past_key_values, end
    return torch.cat(out, 1)


def _padded(model, x: torch.Tensor, pad: int) -> torch.Tensor:
    """The logits of ``x`` (1, T) left-padded by ``pad`` tokens in a batch beside an unpadded sequence."""
    other = torch.randint(2, 100, (1, x.shape[1] + pad), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([torch.cat([torch.full((1, pad), 5), x], 1), other])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[:1, pad:]


@pytest.fixture(scope="module")
def sinks():
    """The original tiny model with sinks, and its conversion with massive tokens routed and shared."""
    model = with_sinks(tiny_lm(seed=3), value=8.0)
    out = {"original": model}
    for mode in ("auto", "shared"):
        net = copy.deepcopy(model)
        normlab.convert_norms(
            net, "dyisru", calibrate=sink_batches(3), per="channel", massive_tokens=mode, progress=False
        )
        out[mode] = net
    return out


@pytest.mark.parametrize("case", list(_stress()))
def test_no_stress_input_breaks_a_routed_conversion(sinks, case):
    """Every stress input stays within BOUND of the original's logits at every position, whole, left-padded, in
    chunks after a KV cache and one token per call. The same inputs through one shared replacement
    (massive_tokens="shared", which is what a position rule gives any massive token after position 0) go far past
    it wherever a sink occurs: the test can fail."""
    x = _stress()[case]
    with torch.no_grad():
        want = sinks["original"](x).logits
    net = sinks["auto"]
    with torch.no_grad():
        whole = net(x).logits
    assert _worst(want, whole) < BOUND, case
    assert _worst(want, _padded(net, x, pad=3)) < BOUND, case
    assert _worst(want, _calls(net, x, [1, 2, 7, 30])) < BOUND, case
    if bool((x < 2).any()):  # a sink in it
        with torch.no_grad():
            shared = sinks["shared"](x).logits
        assert _worst(want, shared) > 2.5 * BOUND, case


def test_a_sequence_gives_the_same_logits_alone_padded_and_split_across_a_cache(sinks):
    """Alone, left-padded in a batch with an attention mask, and split across calls with a KV cache (a chunk of
    several tokens and one-token calls): the same logits within float32 noise."""
    x = _stress()["BOS then a delimiter"]
    net = sinks["auto"]
    with torch.no_grad():
        alone = net(x).logits
    scale = float(alone.abs().max())
    for got in (_padded(net, x, pad=4), _calls(net, x, [3, 4, 5, 40]), _calls(net, x, list(range(1, 12)))):
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4 * scale)


def test_the_formation_site_is_the_first_where_the_massive_rows_separate():
    """Before the massive activation forms, the rows that will carry it are ordinary in magnitude: no detector.
    From the site where it has formed on, they separate; that site is the formation site."""
    from normlab.conversion.calibrate.massive import formation_site

    g = torch.Generator().manual_seed(0)
    ordinary = torch.randn(100, 16, generator=g)
    forming = torch.cat([ordinary, 3 * torch.randn(10, 16, generator=g)])  # a little larger, not separable
    formed = torch.cat([ordinary, torch.randn(10, 16, generator=g)])
    formed[100:, 7] = 500.0
    rows = {"a": forming, "b": forming, "c": formed, "d": formed}
    medians = {n: float(ordinary.pow(2).mean(-1).sqrt().median()) for n in rows}
    assert formation_site(rows, ["a", "b", "c", "d"], medians, massive=10.0) == "c"
    assert formation_site(rows, ["a", "b"], medians, massive=10.0) is None


def test_a_massive_row_is_rescaled_to_the_reference_over_its_channels_and_the_rest_pass():
    """Rescaled, a massive row's channels have the reference's L2 norm, whatever its size; an ordinary row (a zero
    row too) passes unchanged, and the gradient through both copies stays finite."""
    pair = MassiveTokens(torch.nn.Identity(), torch.nn.Identity(), channels=[1, 2], threshold=5.0, reference=10.0)
    x = torch.tensor([[0.5, 30.0, -40.0, 2.0], [0.5, 300.0, 400.0, -1.0], [1.0, 2.0, 3.0, 4.0], [0.0] * 4])
    x.requires_grad_(True)
    carriers = x[..., pair.channels]
    heavy = carriers.abs().amax(-1, keepdim=True) > pair.threshold
    out = pair.rescaled(x, carriers, heavy)
    torch.testing.assert_close(out[:2, 1:3].norm(dim=-1), torch.tensor([10.0, 10.0]))
    torch.testing.assert_close(out[:2], x[:2] / x[:2, 1:3].norm(dim=-1, keepdim=True) * 10.0)
    torch.testing.assert_close(out[2:], x[2:])
    pair(x).sum().backward()
    assert bool(torch.isfinite(x.grad).all())
    big = torch.tensor([[0.5, 25000.0, -30000.0, 2.0]])  # a sink's size: its squares overflow float16
    half = pair.rescaled(big.half(), big.half()[..., pair.channels], torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(half.float(), big / big[:, 1:3].norm() * 10.0, rtol=2e-3, atol=1e-3)


def _sized_sinks(model):
    """Tokens 0-7 are massive in channels 0-1, at 8 sizes from 4 to 42 (Qwen2.5's first tokens vary so)."""
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        for k in range(8):
            emb[k, :2] = 4.0 * 1.4**k
    return model


def test_massive_tokens_of_different_sizes_each_pass_as_the_norm_would(monkeypatch):
    """Sinks of 8 sizes: the routed conversion reproduces the original's logits at every sink position (rescaled,
    the massive copy sees one size), where the same conversion without the rescaling is off by 0.3-1.4%: the test
    can fail."""
    original = _sized_sinks(tiny_lm(seed=3))
    calib = id_batches(3)
    for b in calib:
        b[:, 0] = torch.arange(len(b)) % 8
    body = torch.randint(8, 100, (1, 40), generator=torch.Generator().manual_seed(9))

    def sink_errors(net):
        errors = []
        for k in range(8):
            x = torch.cat([torch.tensor([[k]]), body, torch.tensor([[k]]), body[:, :10]], 1)  # a sink at 0 and 41
            with torch.no_grad():
                errors.append(_worst(original(x).logits[:, [0, 41]], net(x).logits[:, [0, 41]]))
        return errors

    def converted():
        net = copy.deepcopy(original)
        normlab.convert_norms(net, "dyisru", calibrate=calib, per="channel", progress=False)
        assert any(isinstance(m, MassiveTokens) for m in net.modules())
        return net

    assert max(sink_errors(converted())) < 1e-3
    monkeypatch.setattr(MassiveTokens, "rescaled", lambda self, x, carriers, heavy: x)  # fitted and run raw
    assert max(sink_errors(converted())) > 5e-3
