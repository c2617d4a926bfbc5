"""FLOPs of one real step, by torch's FlopCounterMode (the first warm-up step of a stage).

Within ~1% of the analytic count (6N + attention, PaLM appendix B) on CUDA; on a CPU the
attention kernel goes uncounted, so CPU figures are a lower bound.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.flop_counter import FlopCounterMode


def count_flops(step: Callable[[], object]) -> int:
    """FLOPs of one call of `step` (forward and backward as run)."""
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())
