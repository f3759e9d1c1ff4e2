"""How close a converted model is to its original: per site and per token (``fidelity``; the function is
``normlab.fidelity``), by the statistics a quantizer reports (``judge``: KL divergence tails, same top-1, the worst
sequence), and as a user meets it (``usage``: several texts, long context, stress inputs, greedy answers)."""

from normlab.conversion.measure.fidelity import cross_entropy
from normlab.conversion.measure.judge import judge_tokens
from normlab.conversion.measure.usage import usage_report

__all__ = ["cross_entropy", "judge_tokens", "usage_report"]
