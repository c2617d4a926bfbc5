"""`gpudiag gate --base-ref REF`: the base and the head measured in one job, on one machine,
interleaved, so that drift between machines or hours never enters the comparison.

The base is a temporary git worktree of REF (removed afterwards); each trial is a fresh
`python -m gpudiag run` whose working directory is the side's checkout, so relative paths
(`--model models/net.py`) and the side's own modules resolve to that side's code: Python puts a
`-m` run's working directory first on sys.path, and `src/` is added where the repository has
one. Trials alternate base/head, head/base, ... (ABBA), so a slow drift over the job weighs on
both sides alike. How many trials to run is the caller's decision (`next_count`), made after
each round from the runs so far.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpudiag.measure.interrupts import child_stopped, stop_error, wait_child
from gpudiag.model.errors import BadInput, HeadBroke
from gpudiag.model.options import RunOptions, to_argv
from gpudiag.model.results import RunResult, load_run


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        message = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise BadInput(f"git {' '.join(args)}: {message}")
    return done.stdout.strip()


@contextmanager
def base_checkout(ref: str, cwd: Path) -> Iterator[Path]:
    """A detached worktree of `ref`, positioned at `cwd`'s place in the repository; removed on
    exit, whatever happens."""
    if shutil.which("git") is None:
        raise BadInput("--base-ref needs git on PATH")
    try:
        top = Path(_git(cwd, "rev-parse", "--show-toplevel"))
    except BadInput:
        raise BadInput(f"--base-ref: {cwd} is not inside a git repository") from None
    try:
        commit = _git(cwd, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except BadInput:
        raise BadInput(f"--base-ref {ref!r}: no such commit in {top} (fetch it first, "
                       "e.g. `git fetch origin main`)") from None
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-base-"))
    _git(top, "worktree", "add", "--detach", "--quiet", str(tmp / "tree"), commit)
    # Our worktree's own entry in the repository (.git/worktrees/<name>): cleaned up alone.
    # `git worktree prune` would also drop the user's worktrees whose directory is missing
    # at that moment (an unmounted drive, a moved folder).
    admin: Path | None = None
    try:
        admin = Path(_git(tmp / "tree", "rev-parse", "--absolute-git-dir"))
        yield tmp / "tree" / cwd.resolve().relative_to(top.resolve())
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "tree")], cwd=top,
                       capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        if admin is not None and admin.parent.name == "worktrees" and admin.is_dir():
            shutil.rmtree(admin, ignore_errors=True)


def side_env(root: Path) -> dict[str, str]:
    """The environment of a trial run from checkout `root`: its `src/` ahead of installed
    packages (an editable install would otherwise import the head's code on both sides)."""
    env = dict(os.environ)
    paths = [str(root / "src")] if (root / "src").is_dir() else []
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_one(options: RunOptions, checkout: Path, out_dir: Path) -> RunResult | None:
    """One fresh `gpudiag run` of `checkout`'s code into `out_dir`; None if it wrote nothing.
    Raises KeyboardInterrupt after the child (which got the Ctrl-C too) has written its part."""
    # No plots: a trial is evidence for gate.md, which links none (1-2 s a trial, as in
    # trialrun.py).
    command = [sys.executable, "-m", "gpudiag", "run", *to_argv(options),
               "--out", str(out_dir.resolve()), "--quiet", "--no-plots"]
    code, stopped_by = wait_child(subprocess.Popen(command, cwd=checkout,
                                                   env=side_env(checkout)))
    run = load_run(out_dir) if (out_dir / "run.json").is_file() else None
    if child_stopped(code, stopped_by):
        raise stop_error(stopped_by)
    if run is None:
        raise BadInput(f"a trial of {checkout} wrote no run.json (exit {code}); its error is "
                       "above")
    return run


@dataclass
class Interleaved:
    base: list[RunResult] = field(default_factory=list)
    head: list[RunResult] = field(default_factory=list)
    interrupted: bool = False


def run_interleaved(options: RunOptions, *, base: Path, head: Path, out_dir: Path, first: int,
                    next_count: Callable[[Interleaved], int],
                    on_trial: Callable[[str, int], None] = lambda side, k: None,
                    ) -> Interleaved:
    """Trials of both sides into out_dir/base/trial-K and out_dir/head/trial-K, in ABBA order:
    `first` a side, then one round at a time while `next_count`, asked after every round from
    the first's on, wants more than have run (so a gate stops as soon as it is decided)."""
    done = Interleaved()
    target, k = first, 0
    try:
        while k < target:
            k += 1
            sides = [("base", base, done.base), ("head", head, done.head)]
            for side, checkout, runs in (sides if k % 2 else sides[::-1]):
                on_trial(side, k)
                try:
                    run = run_one(options, checkout, out_dir / side / f"trial-{k}")
                except BadInput as exc:
                    if side == "head" and done.base:  # the base ran: the head broke, not the input
                        raise HeadBroke(f"the head (this checkout) broke where the base ran: "
                                        f"{exc}") from None
                    raise
                if run is not None:
                    runs.append(run)
            if k >= first:
                target = next_count(done)
    except KeyboardInterrupt:
        done.interrupted = True
    return done
