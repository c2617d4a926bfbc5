"""Where `gpudiag run` spends its wall time: the runner's phases (stage builds, FLOP counting,
timed windows, evidence passes, memory release) each timed by wrapping runner.py's module-level
functions, printed to stderr at exit, while the command runs as usual (issue 39).

    python benchmarks/ladder_phases.py run --model dgca --no-plots --out /tmp/ladder
"""

from __future__ import annotations

import atexit
import functools
import sys
import time
from collections import defaultdict
from typing import Any

START = time.perf_counter()

from gpudiag.cli.program import main  # noqa: E402
from gpudiag.measure import runner  # noqa: E402 (timed: the import is a phase)
from gpudiag.measure.stages import StageDef  # noqa: E402

LOG: list[tuple[str, str, float]] = [("import gpudiag", "", time.perf_counter() - START)]
PHASES = ("_run_stage", "_add_evidence", "_launch_stage", "count_flops", "collect_evidence",
          "record_window", "time_steps", "_release_memory", "measure_window")


def _timed(name: str, fn: Any, stage: str | None = None) -> Any:
    """`fn`, its calls logged under `name` and the stage (its own, or its first argument's)."""
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            of = stage if stage is not None else getattr(args[0], "name", "") if args else ""
            LOG.append((name, str(of), time.perf_counter() - start))
    return inner


def _with_timed_build(get_stage: Any) -> Any:
    def get(name: str) -> StageDef:
        definition: StageDef = get_stage(name)
        build = definition.build
        if build is None or getattr(build, "_timed", False):
            return definition
        timed = _timed("build", build, stage=name)
        timed._timed = True
        object.__setattr__(definition, "build", timed)  # a frozen dataclass
        return definition
    return get


@atexit.register
def _show() -> None:
    print(f"--- ladder phases (total {time.perf_counter() - START:.1f} s)", file=sys.stderr)
    sums: dict[str, float] = defaultdict(float)
    for name, stage, seconds in LOG:
        print(f"  {seconds:7.2f} s  {name} {stage}", file=sys.stderr)
        sums[name] += seconds
    print("  sums: " + ", ".join(f"{k} {v:.1f}" for k, v in sums.items()), file=sys.stderr)


for _name in PHASES:
    if hasattr(runner, _name):  # an earlier tree's runner may lack one (--tree comparisons)
        setattr(runner, _name, _timed(_name, getattr(runner, _name)))
runner.get_stage = _with_timed_build(runner.get_stage)
if hasattr(runner._Session, "finish_reading"):  # the wait for windows read beside the pass
    runner._Session.finish_reading = _timed("finish_reading", runner._Session.finish_reading,
                                            stage="")

if __name__ == "__main__":
    sys.argv = ["gpudiag", *sys.argv[1:]]
    main()
