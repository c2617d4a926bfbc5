"""Plain A/B of the framework knobs gpudiag's findings name, with each example script's own
timer (no gpudiag in the process): examples/per_tensor_optimizer.py as written (AdamW
foreach=False) against FUSED=1 (fused=True, GD106), examples/loader_restarts.py as written (8
workers, not persistent) against PERSISTENT=1 (GD204), examples/cnn_layout.py in NCHW against
CHANNELS_LAST=1 (a channels_last model and input, GD306), examples/step_reads.py reading
its loss and accuracy every step against DEFERRED=1 (read every 50 steps, GD103), and on two
GPUs (torchrun, 2 ranks) examples/tiny_fsdp2.py against RESHARD=0 (reshard_after_forward=False,
GD805) and
examples/tiny_ddp.py accumulating 4 micro-steps against NO_SYNC=1 (GD802), each in fresh
processes alternated A B B A over `--pairs` pairs. Prints and writes each side's figures
and the ratio unfixed / fixed, with the spread over pairs: what `gpudiag profile
--try-fixes` reports for the same change is held against this (reports/examples/h200-knobs,
h200x2-knobs).

    python benchmarks/knobs_ab.py --pairs 3 --out knobs_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
CASES: dict[str, tuple[tuple[str, ...], str, dict[str, str]]] = {
    # command, the timer's figure (lower is better), the environment that applies the fix
    "optimizer": ((sys.executable, "examples/per_tensor_optimizer.py"), "median_ms",
                  {"FUSED": "1"}),
    "loader": ((sys.executable, "examples/loader_restarts.py"), "later_epochs_s",
               {"PERSISTENT": "1"}),
    "layout": ((sys.executable, "examples/cnn_layout.py"), "median_ms",
               {"CHANNELS_LAST": "1"}),
    "reads": ((sys.executable, "examples/step_reads.py"), "median_ms", {"DEFERRED": "1"}),
    "fsdp-reshard": ((*TORCHRUN, "examples/tiny_fsdp2.py", "60"), "median_ms",
                     {"RESHARD": "0"}),
    "ddp-no-sync": ((*TORCHRUN, "examples/tiny_ddp.py", "40", "4"), "median_ms",
                    {"NO_SYNC": "1"}),
}
SINGLE_PROCESS = ("optimizer", "loader", "layout", "reads")


def _timed(command: tuple[str, ...], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, **env}, check=True, cwd=ROOT)
    line = next(x for x in done.stdout.splitlines() if x.startswith("SCRIPT_TIMER "))
    return json.loads(line.removeprefix("SCRIPT_TIMER "))


def measure(case: str, pairs: int) -> dict[str, Any]:
    command, figure, fix = CASES[case]
    unfixed: list[float] = []
    fixed: list[float] = []
    for i in range(pairs):
        order = [(unfixed, {}), (fixed, fix)] if i % 2 == 0 else [(fixed, fix), (unfixed, {})]
        for side, env in order:
            side.append(_timed(command, env)[figure])
    ratios = [a / b for a, b in zip(unfixed, fixed, strict=True)]
    return {"command": " ".join(command[1:]), "figure": figure, "fix": fix, "unfixed": unfixed,
            "fixed": fixed, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "saved_share": 1 - statistics.median(fixed) / statistics.median(unfixed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cases", default=",".join(SINGLE_PROCESS),
                        help=f"of {', '.join(CASES)} (the last two need two GPUs)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {case: measure(case, args.pairs) for case in args.cases.split(",")}
    for case, r in results.items():
        print(f"{case}: {r['figure']} {statistics.median(r['unfixed']):.3f} -> "
              f"{statistics.median(r['fixed']):.3f}, {r['ratio_median']:.2f}x "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}), saved {r['saved_share']:.0%}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
