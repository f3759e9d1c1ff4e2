"""Which path a norm takes here, observed rather than inferred: the ops that actually ran, as PyTorch's dispatcher
saw them.

    from normlab.kernels.paths import ops_run
    ops = ops_run(lambda: model(x).sum().backward())   # Counter({'normlab_cpu::pointwise_fwd': 8, ...})

`check` runs every registered norm that has a fused path once in inference and once in training and reports the
path each took (``normlab build-kernels --check`` prints it). A dispatch mode (the mechanism of torch's own
``FlopCounterMode``) sees every op that runs, forward and backward, so an answer here cannot be fooled by a flag: a
norm that fell back to the reference math shows ATen's ops and no ``normlab_cpu``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ops_run", "fused_ops", "check", "PATH_NAMES", "TRAIN_ROWS"]

OWN_OPS = "normlab_cpu::"  # the namespace of the C++ library's ops (csrc/cpu_norms.cpp)
# the path a norm took, by the ops seen; LayerNorm's fused path is PyTorch's own op
PATH_NAMES = {"fused": "fused C++ (normlab_cpu)", "aten": "PyTorch's fused op", "reference": "reference math"}
TRAIN_ROWS = 256  # 256 x 512 = 131,072 elements: past kernels.cpu.MIN_FUSED, so that "auto" fuses a training call


class _Seen(TorchDispatchMode):
    """Counts each op by its schema name ('normlab_cpu::pointwise_fwd', 'aten::tanh') and runs it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def ops_run(fn: Callable[[], object]) -> Counter:
    """The ops ``fn()`` ran on the CPU, by name, with how often each ran (forward and backward).

    Args:
        fn: A call with no arguments, e.g. ``lambda: model(x).sum().backward()``.
    """
    with _Seen() as seen:
        fn()
    return seen.ops


def fused_ops(fn: Callable[[], object]) -> Counter:
    """The ``normlab_cpu`` ops among `ops_run`'s: empty when every norm took the reference math.

    Args:
        fn: A call with no arguments.
    """
    return Counter({k: v for k, v in ops_run(fn).items() if k.startswith(OWN_OPS)})


def _path(ops: Counter, name: str) -> str:
    if any(k.startswith(OWN_OPS) for k in ops):
        return "fused"
    if name == "layer_norm" and any(k in ops for k in ("aten::native_layer_norm", "aten::layer_norm")):
        return "aten"
    return "reference"


def check(dim: int = 512, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Each fused norm of the registry, run here on a CPU tensor: the path its inference call (no autograd) and its
    training call (forward and backward, `TRAIN_ROWS` x ``dim``) took, as `PATH_NAMES` keys.

    Args:
        dim: The channel count.
        dtype: The input's dtype (float32, bfloat16 or float16).
    """
    from normlab.registry import create_norm, list_norms, norm_spec

    rows = []
    for name in list_norms():
        if "kernel" not in norm_spec(name).init_kwargs:
            continue  # a norm with no fused path: always the reference
        norm = create_norm(name, dim).to(dtype)
        x = torch.randn(TRAIN_ROWS, dim, dtype=dtype)
        with torch.no_grad():
            norm(x)  # a first call: a library still loading takes the reference once
            infer = ops_run(lambda n=norm, x=x: n(x))
        xg = x.clone().requires_grad_(True)
        train = ops_run(lambda n=norm, x=xg: n(x).float().sum().backward())
        rows.append({"norm": name, "inference": _path(infer, name), "training": _path(train, name)})
    return rows
