"""The teacher cache (normlab.conversion.heal.teacher): the top-k KL is the KL at the full vocabulary and a lower bound
below it, the cached teacher gives the live teacher's loss and gradient, and a heal with it computes each
sequence's targets once."""

from __future__ import annotations

import copy

import pytest
import torch

import normlab
from conftest import id_batches, tiny_lm
from normlab.conversion.config import HealConfig
from normlab.conversion.data.texts import TokenStream
from normlab.conversion.heal.report import heal_summary
from normlab.conversion.heal.teacher import TeacherCache, teacher_top_k
from normlab.conversion.measure.judge import top_k_kl


def _logps(seed: int, shape=(3, 5, 40), scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).log_softmax(-1)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - logq)).sum(-1).mean()


@pytest.mark.parametrize("k", [40, 39])  # 39 of 40: the tail is the one outcome left, so nothing is merged
def test_the_top_k_kl_at_the_whole_vocabulary_is_the_kl(k):
    logp, logq = _logps(0), _logps(1)
    assert float(top_k_kl(logq, *logp.topk(k, dim=-1))) == pytest.approx(float(_kl(logp, logq)), rel=1e-9)


@pytest.mark.parametrize("k", [1, 3, 10, 38])
def test_the_top_k_kl_is_a_lower_bound_and_zero_between_equal_models(k):
    logp, logq = _logps(0), _logps(1)
    part = float(top_k_kl(logq, *logp.topk(k, dim=-1)))
    assert 0.0 < part < float(_kl(logp, logq))  # merging outcomes never raises a KL
    assert abs(float(top_k_kl(logp, *logp.topk(k, dim=-1)))) < 1e-6
    peaked = logq.clone()  # a student that puts (nearly) all its mass on the teacher's top k: finite
    peaked.scatter_(-1, logp.topk(k, dim=-1).indices, 60.0)
    assert torch.isfinite(top_k_kl(peaked.log_softmax(-1), *logp.topk(k, dim=-1)))


def test_the_cached_teacher_gives_the_live_teachers_loss_and_gradient():
    original = tiny_lm(seed=0, initializer_range=0.5)
    model = copy.deepcopy(original)
    normlab.convert_norms(model, "dyt")
    ids = id_batches(1, seed=3)[0]
    ids[3] = ids[1]  # a row twice in one batch: computed once
    calls = []
    original.register_forward_hook(lambda *_: calls.append(1))
    cache = TeacherCache(original, k=7)

    def loss_and_grad(fn):
        model.zero_grad()
        loss = fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    live, live_grad = loss_and_grad(lambda: top_k_kl(model(ids).logits.float().log_softmax(-1),
                                                     *teacher_top_k(original, ids, 7)))  # fmt: skip
    first, first_grad = loss_and_grad(lambda: cache.loss(model, ids))
    assert len(calls) == 2 and (cache.computed, cache.reused) == (3, 1)
    again, again_grad = loss_and_grad(lambda: cache.loss(model, ids))
    assert len(calls) == 2 and (cache.computed, cache.reused) == (3, 5)  # read back: the original did not run
    assert torch.equal(live, first) and torch.equal(first, again)
    assert live_grad and all(
        torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(live_grad, first_grad, again_grad)
    )


def test_a_heal_with_the_teacher_cache_computes_each_sequence_once_and_heals():
    original = tiny_lm(seed=0, initializer_range=0.5)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")
    stream = TokenStream(torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(5)))
    rep = normlab.heal(original, model, stream, rec, HealConfig(tokens=64 * 20, teacher_top_k=16, lr=1e-2),
                       val=id_batches(1, seed=9), eval_every=320, progress=False)  # fmt: skip
    assert rep.teacher_computed == 8 and rep.teacher_reused == 4 * 20 - 8  # 20 steps of 4 over 8 sequences
    assert rep.to_dict()["teacher_reused"] == rep.teacher_reused
    assert "teacher cache: the original ran on 8 sequences, 72 were read back" in heal_summary(rep)
    assert min(p["val_kl"] for p in rep.curve[1:]) < rep.curve[0]["val_kl"]  # judged by the full KL


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"teacher_top_k": 0}, "teacher_top_k must be an int >= 1"),
     ({"teacher_top_k": 2.5}, "teacher_top_k must be an int")],
)  # fmt: skip
def test_a_bad_teacher_cache_setting_is_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        HealConfig(tokens=64, **fields).validate()
