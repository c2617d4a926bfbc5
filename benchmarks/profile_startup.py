"""What `gpudiag profile` adds around a script: time from the command to the script's first
line, and from the script's last line to gpudiag's exit, against running the script alone.

    python benchmarks/profile_startup.py [--repeat 5] [--tree PATH ...] [--out FILE.json]

Each `--tree` is a gpudiag source tree (a checkout of another commit) measured interleaved with
the others, so machine drift does not favour one; without it, the installed gpudiag.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Marks its first and last line's wall-clock time; three optimizer steps, so gpudiag records.
SCRIPT = """
import sys, time
first = time.time()
import torch
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
for _ in range(3):
    opt.step()
open(sys.argv[1], "w").write(f"{first} {time.time()}")
"""


def _once(command: list[str], marks: Path, env: dict[str, str]) -> tuple[float, float]:
    start = time.time()
    subprocess.run(command, env=env, check=True, capture_output=True)
    end = time.time()
    first, last = (float(x) for x in marks.read_text().split())
    return first - start, end - last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[],
                        help="a gpudiag source tree to measure (repeatable)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = args.tree or [""]
    results: dict[str, dict[str, list[float]]] = {
        name: {"before_script_s": [], "after_script_s": []} for name in ["plain", *trees]}
    with tempfile.TemporaryDirectory() as tmp:
        script, marks = Path(tmp) / "script.py", Path(tmp) / "marks.txt"
        script.write_text(SCRIPT)
        for _ in range(args.repeat):
            for name in results:
                env = dict(os.environ)
                if name == "plain":
                    command = [sys.executable, str(script), str(marks)]
                else:
                    if name:
                        env["PYTHONPATH"] = name
                    command = [sys.executable, "-m", "gpudiag", "profile", "--out",
                               str(Path(tmp) / "run"), "--telemetry", "off",
                               "--", sys.executable, str(script), str(marks)]
                before, after = _once(command, marks, env)
                results[name]["before_script_s"].append(before)
                results[name]["after_script_s"].append(after)
    summary = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in
               results.items()}
    for name, row in summary.items():
        print(f"{name or 'installed':>40}: before the script {row['before_script_s']:.2f} s, "
              f"after it {row['after_script_s']:.2f} s")
    if args.out:
        args.out.write_text(json.dumps({"samples": results, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
