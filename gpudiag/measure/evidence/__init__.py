"""Evidence: what a step did, measured in a short profiler window and charged to source lines."""

from gpudiag.measure.evidence.profiler_window import capture_trace, collect_evidence
from gpudiag.measure.evidence.trace import analyze

__all__ = ["analyze", "capture_trace", "collect_evidence"]
