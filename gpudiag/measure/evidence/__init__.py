"""Evidence: what a step did, measured in a short profiler window and charged to source lines."""

from gpudiag.measure.evidence.trace import analyze
from gpudiag.measure.evidence.window import capture_trace, collect_evidence

__all__ = ["analyze", "capture_trace", "collect_evidence"]
