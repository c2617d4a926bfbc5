"""Each rule's price against what its fix saved, measured: the committed GPU runs under
reports/examples whose `--try-fixes` measured a remedy faster (interval above 1). A price is set
beside the saving on the basis the saving is measured on, the mean timed step
(gpudiag/diagnose/ledger.py, `timed_shares`). tests/test_tryfix.py recomputes every figure here
from those runs and fails when one drifts, a run is missing, or a price misses its saving by
more than a quarter (a lower bound: exceeds it); docs/rules.md prints them per rule."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PriceCheck:
    rules: tuple[str, ...]  # the findings the remedy answers in that run
    run: str  # the run's folder under reports/examples
    gpu: str
    remedy: str  # gpudiag.model.remedies name: the best saving among those answering `rules`
    priced: float  # the findings' price, a share of the mean timed step
    saved: float  # 1 - 1/speedup, measured

    @property
    def says(self) -> str:
        together = f" (with {', '.join(self.rules)} together)" if len(self.rules) > 1 else ""
        return (f"{self.gpu}, reports/examples/{self.run}: priced {self.priced:.0%}{together}, "
                f"{self.remedy} saved {self.saved:.0%} "
                f"({(self.priced - self.saved) * 100:+.0f} points)")


PRICE_CHECKS: tuple[PriceCheck, ...] = (
    PriceCheck(('GD301',), "h100-try-fixes/blocking_save", "H100", "tf32", 0.49, 0.47),
    PriceCheck(('GD301',), "h100-try-fixes/fp32_no_tf32", "H100", "bf16-autocast", 0.63, 0.69),
    PriceCheck(('GD201',), "h100-try-fixes/slow_dataset", "H100", "loader", 0.80, 0.72),
    PriceCheck(('GD301',), "h200-confined-try-fixes", "H200", "bf16-autocast", 0.67, 0.73),
    PriceCheck(('GD304', 'GD306'), "h200-issue55/cnn_layout", "H200", "compile-model", 0.55, 0.69),
    PriceCheck(('GD306',), "h200-issue55/cnn_layout", "H200", "channels-last", 0.18, 0.59),
    PriceCheck(('GD107',), "h200-issue55/debug_left_on", "H200", "no-debug", 0.56, 0.56),
    PriceCheck(('GD204',), "h200-knobs/loader_restarts", "H200", "persistent-workers", 0.85, 0.86),
    PriceCheck(('GD301',), "h200-memory-fixes/small_batch", "H200", "tf32", 0.31, 0.30),
    PriceCheck(
        ('GD106',), "h200-knobs/per_tensor_optimizer", "H200", "fused-optimizer", 0.54, 0.57),
    PriceCheck(
        ('GD304',), "h200-memory-bound-compile/hand-written", "H200", "compile-model", 0.48, 0.56),
    PriceCheck(
        ('GD304',), "h200-memory-bound-compile/nanogpt-gpt2-small", "H200", "compile-model",
        0.17, 0.17),
    PriceCheck(
        ('GD304',), "h200-memory-bound-compile/narrow", "H200", "compile-model", 0.23, 0.27),
)


def price_checks(code: str) -> str:
    """A rule's measured error, for docs/rules.md."""
    checks = [c.says for c in PRICE_CHECKS if code in c.rules]
    if not checks:
        return ("Not yet checked: no committed GPU run measured a remedy for it faster, so its "
                "price is the model above alone.")
    return "\n".join(f"- {line}" for line in checks)
