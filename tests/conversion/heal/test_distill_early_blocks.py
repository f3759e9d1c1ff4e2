"""The heal's early blocks (`normlab.conversion.heal.distill.first_converted_block`, ``heal.early_blocks``): the blocks
before the first converted site, where the massive activation forms, stay the original's unless asked, and a
resumed heal reports them."""

from __future__ import annotations

import copy

import pytest
import torch

import normlab
from conftest import id_batches, tiny_lm, token_stream

pytest.importorskip("transformers")


@pytest.mark.parametrize("train", ["lora", "all"])
@pytest.mark.parametrize("early_blocks", ["frozen", "trained"])
def test_the_blocks_before_the_first_converted_site_stay_the_originals_unless_asked(train, early_blocks):
    """Block 1 holds the first converted site: with early_blocks="frozen" block 0 keeps the original's weights to
    the bit (no adapter, no update; the massive activation forms in such blocks) while later blocks move; with
    "trained", block 0 moves too."""
    original = tiny_lm(seed=0, layers=3, initializer_range=0.5)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt", include=lambda name, m: not name.startswith("model.layers.0."))
    # no validation split: the state trained is the state kept, where a best-state pick could roll a short heal
    # on a CPU whose rounding makes it no better than the start back to the original weights (seen on an AVX2 CI)
    rep = normlab.heal(original, model, token_stream(), rec, tokens=2000,
                       objective="distill", train=train, lr=1e-2 if train != "all" else 1e-3, eval_every=1000,
                       early_blocks=early_blocks, progress=False)  # fmt: skip

    def moved(i):
        theirs = dict(original.model.layers[i].named_parameters())
        mine = dict(model.model.layers[i].named_parameters())
        return [n for n in theirs if n in mine and not torch.equal(mine[n], theirs[n])]  # a norm swapped is not

    assert moved(1) and moved(2)
    if early_blocks == "frozen":
        assert not moved(0) and rep.frozen_blocks == 1
    else:
        assert moved(0) and rep.frozen_blocks == 0


def test_a_resumed_heal_reports_the_blocks_it_leaves_frozen(tmp_path):
    """A checkpoint written before 0.4.4 has no frozen_blocks in its report: the resumed report says the blocks this
    heal froze, not the 0 it would take from the older report."""
    original = tiny_lm(seed=0, layers=3)
    kw = {"val": id_batches(1, seed=9), "train": "lora", "eval_every": 2 * 4 * 16, "progress": False}

    def fresh():
        m = copy.deepcopy(original)
        return m, normlab.convert_norms(m, "dyt", include=lambda name, _: not name.startswith("model.layers.0."))

    ck = tmp_path / "heal.pt"
    model, rec = fresh()
    normlab.heal(original, model, token_stream(), rec, tokens=2 * 4 * 16, checkpoint=ck, **kw)
    state = torch.load(ck, weights_only=False)
    del state["report"]["frozen_blocks"]
    torch.save(state, ck)
    model, rec = fresh()
    rep = normlab.heal(original, model, token_stream(), rec, tokens=4 * 4 * 16, checkpoint=ck, resume=True, **kw)
    assert rep.resumed_from == 2 * 4 * 16 and rep.frozen_blocks == 1
