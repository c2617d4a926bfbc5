"""Evidence: what a step did, measured in a short profiler window and charged to source lines."""

from gpudiag.evidence.trace import analyze
from gpudiag.evidence.window import capture_trace, collect_evidence

__all__ = ["analyze", "capture_trace", "collect_evidence"]
