"""What gpudiag's profiler window costs, phase by phase and end to end (issue 39).

`phases`: in this process, steps of the kinds that made the window expensive (many small
parameters under a per-tensor optimizer, a Python loop writing embeddings row by row, gradient
logging per parameter) run plainly, then under gpudiag's ProfilerWindow, whose own clock splits
the window into start, profiled steps (profiler, shapes and the source annotator at work),
kineto's collection, the Chrome export, parsing, gpudiag's analysis; the trace's gzip is
timed beside them. Per phase: seconds, and the whole per recorded kernel (per operator on a
CPU, where there are no kernels). Beside it, the floor: torch.profiler alone over the same
steps (CPU and CUDA activities, no shapes, no stacks, no annotator) and its Chrome export, and
what each costs the script beyond its plain steps (in `gpudiag profile` parsing, analysis and
the gzip run in gpudiag's own process, beside the script); and torch.profiler with input shapes
alone, and with gpudiag's source annotator alone, to tell the two apart.

`runs`: whole `gpudiag profile` runs of example scripts, with one or more gpudiag source trees
(`--tree DIR`, e.g. a worktree of an earlier commit, and `.`), alternated script by script and
repeated, each with a plain run of the script beside it. Per run: the wall time, the window's
share of it as the run's own account reads it ("Where the run's time went"), and kernels per step.

    python benchmarks/window_cost.py phases --out window-phases.json
    git worktree add /tmp/base HEAD~3
    python benchmarks/window_cost.py runs --tree /tmp/base --tree . --repeats 2 --out runs.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from gpudiag.diagnose.timeline import stage_account
from gpudiag.measure.evidence.profiler_window import ProfilerWindow
from gpudiag.measure.evidence.source import SourceAnnotator
from gpudiag.measure.timing import synchronize
from gpudiag.model.runfile import load_run

PROFILED_STEPS = 3  # gpudiag profile's default evidence window


def per_tensor_optimizer(device: torch.device) -> Callable[[], None]:
    """examples/per_tensor_optimizer.py's step: 800 parameter tensors, AdamW foreach=False."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
                            for _ in range(200)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(256, 64, device=device)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def python_loop(device: torch.device) -> Callable[[], None]:
    """examples/python_loop.py's step: 32 x 6 row writes per forward."""
    embed = nn.Embedding(1000, 128).to(device)
    prompt = nn.Parameter(torch.randn(6, 128, device=device))
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True),
                                    1).to(device)
    head = nn.Linear(128, 1000).to(device)
    params = [*embed.parameters(), prompt, *encoder.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, 1000, (32, 64), device=device)
    slots = torch.stack([torch.randperm(64)[:6] for _ in range(32)]).to(device)

    def step() -> None:
        x = embed(tokens)
        for i in range(tokens.shape[0]):
            for j in range(6):
                x[i, slots[i, j], :] = prompt[j]
        logits = head(encoder(x))
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def gradient_logging(device: torch.device) -> Callable[[], None]:
    """A step that logs every parameter's gradient norm with .item() (a sync each on a GPU)."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU())
                            for _ in range(48)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, 256, device=device)
    logged: dict[str, float] = {}

    def step() -> None:
        model(x).square().mean().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            logged[name] = p.grad.norm().item()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


STEPS: dict[str, Callable[[torch.device], Callable[[], None]]] = {
    "per-tensor optimizer": per_tensor_optimizer, "python loop": python_loop,
    "gradient logging": gradient_logging}


def window_phases(name: str, device: torch.device, save_to: Path | None) -> dict[str, Any]:
    step = STEPS[name](device)
    for _ in range(3):
        step()
    synchronize(device)
    plain = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        synchronize(device)
        plain.append((time.perf_counter() - start) * 1e3)
    window = ProfilerWindow(device)
    begin = time.perf_counter()
    window.start()
    for k in range(PROFILED_STEPS):
        step()
        if k < PROFILED_STEPS - 1:
            window.next_step()
    window.stop()
    events = window.events()
    evidence = window.evidence(events, statistics.median(plain))
    with tempfile.TemporaryDirectory() as tmp:
        mark = time.perf_counter()
        saved = (save_to or Path(tmp)) / f"{name.replace(' ', '-')}.json.gz"
        with gzip.open(saved, "wb", compresslevel=6) as f:
            f.write(window.trace_json)
        window.phase_s["save"] = time.perf_counter() - mark
    whole = time.perf_counter() - begin
    assert evidence is not None
    recorded = evidence.kernels_per_step if device.type == "cuda" else evidence.ops_per_step
    in_script = sum(window.phase_s.get(k, 0.0) for k in ("start", "steps", "collect", "export"))
    plain_steps = statistics.median(plain) * PROFILED_STEPS / 1e3
    bare = bare_window(step, device)
    return {"step": name, "plain_step_ms": statistics.median(plain),
            "in_script_s": in_script,
            "beyond_plain_steps_ms_per_recorded": (in_script - plain_steps) * 1e3
            / max(1.0, recorded * PROFILED_STEPS),
            "bare_profiler": {**bare, "beyond_plain_steps_ms_per_recorded":
                              (bare["window_s"] - plain_steps) * 1e3
                              / max(1.0, recorded * PROFILED_STEPS)},
            "profiler_with_shapes": bare_window(step, device, shapes=True),
            "profiler_with_annotator": bare_window(step, device, annotate=True),
            "profiled_step_ms": statistics.fmean(window.step_ms),
            "recorded_per_step": recorded,
            "recorded": "kernels" if device.type == "cuda" else "operators",
            "trace_mb": len(window.trace_json) / 1e6, "events": len(events),
            "window_s": whole, "phase_s": window.phase_s,
            "ms_per_recorded": whole * 1e3 / max(1.0, recorded * PROFILED_STEPS),
            "window_in_plain_steps": whole * 1e3 / statistics.median(plain)}


def bare_window(step: Callable[[], None], device: torch.device, *, shapes: bool = False,
                annotate: bool = False) -> dict[str, float]:
    """The same steps under torch.profiler alone and its Chrome export: the floor of any window
    that records kernels with torch's profiler; with `shapes` or `annotate`, one of the two
    things gpudiag's window adds to it, to tell their costs apart."""
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda"
                                          else [])]
    begin = time.perf_counter()
    with profile(activities=activities, record_shapes=shapes) as prof:
        with SourceAnnotator() if annotate else contextlib.nullcontext():
            for _ in range(PROFILED_STEPS):
                step()
        synchronize(device)
        stepped = time.perf_counter()
    collected = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
    exported = time.perf_counter()
    return {"steps_s": stepped - begin, "collect_s": collected - stepped,
            "export_s": exported - collected, "window_s": exported - begin}


def phases(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for name in args.steps or list(STEPS):
        row = window_phases(name, device, args.traces)
        rows.append(row)
        parts = "  ".join(f"{k} {v:.2f}" for k, v in row["phase_s"].items())
        print(f"{name:22s} {row['recorded_per_step']:8,.0f} {row['recorded']}/step  plain "
              f"{row['plain_step_ms']:7.1f} ms  window {row['window_s']:6.2f} s "
              f"({row['ms_per_recorded']:.3f} ms per recorded)  [{parts}]; in the script "
              f"{row['in_script_s']:.2f} s, beyond its plain steps "
              f"{row['beyond_plain_steps_ms_per_recorded']:.3f} ms per recorded; torch.profiler "
              f"alone {row['bare_profiler']['window_s']:.2f} s, "
              f"{row['bare_profiler']['beyond_plain_steps_ms_per_recorded']:.3f} ms", flush=True)
    return rows


GRAD_LOGGING_SCRIPT = '''
import torch
from torch import nn
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU())
                        for _ in range(48)]).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(512, 256, device=device)
for step in range(60):
    model(x).square().mean().backward()
    norms = {name: p.grad.norm().item() for name, p in model.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
'''


def _scripts(scratch: Path, ddp: bool) -> dict[str, list[str]]:
    logging = scratch / "gradient_logging.py"
    logging.write_text(GRAD_LOGGING_SCRIPT)
    repo = Path(__file__).resolve().parents[1] / "examples"
    scripts = {"per-tensor optimizer": [str(repo / "per_tensor_optimizer.py")],
               "python loop": [str(repo / "python_loop.py"), "60"],
               "gradient logging": [str(logging)],
               "checkpoint every 5 steps": [str(repo / "blocking_save.py")]}
    if ddp:
        scripts["DDP, 8 micro-steps, 2 GPUs"] = [
            "-m", "torch.distributed.run", "--nproc-per-node", "2",
            str(repo / "tiny_ddp.py"), "30", "8"]
        scripts["DDP BERT-base, batch 64, 2 GPUs"] = [
            "-m", "torch.distributed.run", "--nproc-per-node", "2",
            str(repo / "ddp_bert.py"), "--steps", "30"]
        # The DDP row: ~9,900 kernels and ~0.3 s a step in 8 micro-steps.
        scripts["DDP BERT-base, 8 micro-steps of 32, 2 GPUs"] = [
            "-m", "torch.distributed.run", "--nproc-per-node", "2",
            str(repo / "ddp_bert.py"), "--steps", "30", "--batch", "32", "--accum", "8"]
    return scripts


def _profiled(tree: Path, script: list[str], out: Path) -> dict[str, Any]:
    # The tree's gpudiag first on the path, in gpudiag's process and (inherited) the script's.
    path = os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    start = time.perf_counter()
    # Not from this folder: `python -m` puts the working directory before PYTHONPATH.
    done = subprocess.run([sys.executable, "-m", "gpudiag", "profile", "--out", str(out), "--",
                           sys.executable, *script], env=env, capture_output=True, text=True,
                          check=False, cwd=out.parent)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"tree": str(tree), "wall_s": wall, "rc": done.returncode}
    if done.returncode not in (0, 2, 3):
        row["error"] = done.stderr[-2000:]
        return row
    run = load_run(out / "run.json")
    stage = run.stages[0]
    account = stage_account(stage)
    if stage.evidence is not None:
        row["kernels_per_step"] = stage.evidence.kernels_per_step
        row["ops_per_step"] = stage.evidence.ops_per_step
        row["profiled_steps"] = stage.evidence.steps
    # What a cheaper window must not change.
    row["findings"] = sorted(f"{f.id} {f.severity} {f.location}" for f in run.findings)
    if account is not None:
        row["window_ms"] = account.window_ms
        row["run_ms"] = account.wall_ms
        row["window_share"] = account.share(account.window_ms)
    return row


def runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        scripts = _scripts(scratch, args.ddp)
        for repeat in range(args.repeats):
            for name, script in scripts.items():
                if args.only and name not in args.only:
                    continue
                start = time.perf_counter()
                subprocess.run([sys.executable, *script], capture_output=True, check=True,
                               cwd=scratch)
                plain = time.perf_counter() - start
                # Trees alternate, their order reversed every other repeat (ABBA).
                trees = args.tree if repeat % 2 == 0 else args.tree[::-1]
                for tree in trees:
                    out = scratch / f"run-{len(rows)}"
                    row = _profiled(tree, script, out)
                    row.update(script=name, repeat=repeat, plain_wall_s=plain)
                    if args.keep is not None:  # the run's files, its profiler trace included
                        shutil.copytree(out, args.keep / out.name, dirs_exist_ok=True)
                        row["kept"] = out.name
                    rows.append(row)
                    print(f"{name:28s} {Path(row['tree']).name:10s} wall {row['wall_s']:6.1f} s "
                          f"(plain {plain:5.1f} s)  window "
                          f"{row.get('window_ms', float('nan')) / 1e3:6.1f} s "
                          f"({row.get('window_share', float('nan')):.0%})  kernels/step "
                          f"{row.get('kernels_per_step', float('nan')):,.0f}  profiled steps "
                          f"{row.get('profiled_steps')}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    ph = sub.add_parser("phases")
    ph.add_argument("--device", default=None)
    ph.add_argument("--steps", action="append", choices=list(STEPS))
    ph.add_argument("--traces", type=Path, default=None, help="keep each window's trace here")
    rn = sub.add_parser("runs")
    rn.add_argument("--tree", type=Path, action="append", required=True,
                    help="a gpudiag source tree (repeat to compare)")
    rn.add_argument("--repeats", type=int, default=2)
    rn.add_argument("--ddp", action="store_true", help="also the two-GPU DDP script")
    rn.add_argument("--only", action="append", help="a script's name (repeatable)")
    rn.add_argument("--keep", type=Path, default=None, help="copy each run's folder here")
    for p in (ph, rn):
        p.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = phases(args) if args.mode == "phases" else runs(args)
    if args.out:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name()
                if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d")}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
