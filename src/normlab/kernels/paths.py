"""Which path a norm takes here, observed rather than inferred: the ops that actually ran, as PyTorch's dispatcher
saw them.

    from normlab.kernels.paths import ops_run
    ops = ops_run(lambda: model(x).sum().backward())   # Counter({'normlab_cpu::pointwise_fwd': 8, ...})

`normlab.features.kernel_paths` runs every registered norm that has a fused path through it (``normlab build-kernels
--check`` prints it). A dispatch mode (the mechanism of torch's own
``FlopCounterMode``) sees every op that runs, forward and backward, so an answer here cannot be fooled by a flag: a
norm that fell back to the reference math shows ATen's ops and no ``normlab_cpu``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OWN_OPS", "ops_run", "fused_ops"]

OWN_OPS = "normlab_cpu::"  # the namespace of the C++ library's ops (csrc/cpu_norms.cpp)


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
