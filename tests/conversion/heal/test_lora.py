"""Low-rank adapters for healing (normlab.conversion.heal.lora)."""

from __future__ import annotations

import torch

from conftest import id_batches, tiny_lm


def test_lora_merged_into_the_weights_gives_the_same_outputs():
    from normlab.conversion.heal.lora import add_lora, merge_lora

    model = tiny_lm()
    wrapped = add_lora(model.model.layers, rank=4)
    assert len(wrapped) == 2 * 7  # q, k, v, o, gate, up, down in each of two blocks
    ids = id_batches(1)[0]
    with torch.no_grad():
        plain = model(ids).logits
        for w in wrapped:  # a nonzero update, as after training (B starts at zero)
            w.lora_b.normal_(0, 0.05)
        unmerged = model(ids).logits
    assert not torch.allclose(plain, unmerged)
    assert merge_lora(model) == 14
    assert not any(type(m).__name__ == "LoRALinear" for m in model.modules())
    with torch.no_grad():
        merged = model(ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
