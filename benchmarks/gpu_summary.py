"""What one GPU call's `gpudiag profile` runs found, for its summary.txt: the exit of each
(exits.txt), then per run folder its findings (fixes of the GD4xx memory findings too), its
measured fixes, its first saves with their callers, and its memory and owners.

    python3 benchmarks/gpu_summary.py OUT > OUT/summary.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.model.results import RunResult
from gpudiag.model.runfile import load_run


def _stage_lines(run: RunResult) -> list[str]:
    lines = []
    for stage in run.stages:
        script = stage.facts.script
        if script is None:
            continue
        for save in (script.timeline.saves if script.timeline else [])[:2]:
            lines.append(f"   save at step {save.step}: {save.blocking_ms:.1f} ms from "
                         f"{save.stack[:12]}")
        memory = script.memory
        if memory is not None:
            lines.append(f"   memory {memory.device}: allocated {memory.allocated_mib[:3]} .. "
                         f"{memory.allocated_mib[-3:]}; reserved max "
                         f"{max(memory.reserved_mib or [0])}; peak {max(memory.peak_mib or [0])};"
                         f" total {memory.device_total_mib}; retries {memory.alloc_retries}; "
                         f"steps {len(memory.resident_mib)}")
        if script.owners is not None:
            lines.append(f"   owners: {script.owners}")
        if stage.memory is not None:
            lines.append(f"   stage memory: {stage.memory}")
    return lines


def summary(out: Path) -> list[str]:
    exits = out / "exits.txt"
    lines = [exits.read_text()] if exits.is_file() else []
    for folder in sorted(p for p in out.iterdir() if (p / "run.json").is_file()):
        run = load_run(folder)
        lines.append(f"== {folder.name}")
        for f in run.findings:
            share = f.account.share if f.account is not None else f.impact
            lines.append(f"   {f.id} {f.severity} {f.location} {share:.0%}: {f.title}")
            if f.id.startswith("GD40"):
                lines.append(f"      fix: {f.fix}")
        lines += [f"   fix {fix.remedy}: {fix.status} {fix.speedup} ({fix.speedup_low}-"
                  f"{fix.speedup_high}) {fix.equivalence}; {fix.note}" for fix in run.fixes]
        lines += _stage_lines(run)
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]))))
