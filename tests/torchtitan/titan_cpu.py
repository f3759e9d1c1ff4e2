"""torchtitan's own trainer on a CPU, for the tests: ``python titan_cpu.py <torchtitan.train's arguments>`` (or under
torchrun). torchtitan 0.3.0 assumes an accelerator; this shim, which lives in the tests and never in the library,
gives it the CPU: the device type "cpu", the few ``torch.cpu`` functions its metrics call, and attention through
``scaled_dot_product_attention`` with the same mask (FlexAttention, its only attention for language models, has no
backward on a CPU): the mask is FlexAttention's own ``mask_mod`` made dense; and FSDP2's gradient reduction as
plain SUM with its division done apart (``force_sum_reduction_for_comms``, FSDP2's own switch), where it would ask gloo
for PREMUL_SUM, which gloo lacks."""

from __future__ import annotations

import sys
import types

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"

_cpu = torch.cpu
for _name, _fn in {
    "get_device_name": lambda *a, **k: "cpu",
    "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
    "reset_peak_memory_stats": lambda *a, **k: None,
    "empty_cache": lambda *a, **k: None,
    "memory_stats": lambda *a, **k: {
        "active_bytes.all.peak": 0,
        "reserved_bytes.all.peak": 0,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    },
    "set_device": lambda *a, **k: None,
}.items():
    if not hasattr(_cpu, _name):
        setattr(_cpu, _name, _fn)
_cpu.current_device = lambda: 0  # an index, as torch.cuda's (torch.cpu's is the string "cpu"): barrier(device_ids=)


def _sum_for_gloo():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as C

    factors = C._get_gradient_divide_factors

    def summed(rs_group, ar_group, reduce_dtype, device_type="", factor=None, force_sum_reduction_for_comms=False):
        return factors(rs_group, ar_group, reduce_dtype, device_type, factor, True)

    C._get_gradient_divide_factors = summed


def _flex_as_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """What torchtitan's compiled FlexAttention computes, for a mask and no score_mod, on the CPU."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None and not return_aux.lse, "the CPU shim covers masks only"
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput(lse=None, max_scores=None)  # a NamedTuple, which torch.compile traces


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.train import main

    FlexAttention._compiled_flex_attn = staticmethod(_flex_as_sdpa)
    _sum_for_gloo()

    main()
