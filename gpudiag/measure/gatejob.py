"""`gpudiag gate --base-ref REF`: the base and the head measured in one job, on one machine,
interleaved, so that drift between machines or hours never enters the comparison.

The base is a temporary git worktree of REF (removed afterwards; its submodules cloned from
the user's own copies, offline; a killed gate's removed by the next); each trial is a fresh
`python -m gpudiag run` (or, for the user's own command, `gpudiag profile -- COMMAND`) whose
working directory is the side's checkout, so relative paths (`--model models/net.py`,
`python train.py`) and the side's own modules resolve to that side's code: Python puts a `-m`
run's working directory first on sys.path, and `src/` is added where the repository has one.
A user's command runs the head in a worktree too (this checkout's tracked changes and
untracked files copied in), so that what the script writes never lands on the user's files.
Trials alternate base/head, head/base, ... (ABBA), so a slow drift over the job weighs on
both sides alike. How many trials to run is the caller's decision (`next_count`), made after
each round from the runs so far. `calibrate -- COMMAND`'s trials run the same way, of one side:
this checkout as it is, in a worktree, one after another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpudiag.measure.bytecode import shared_bytecode
from gpudiag.measure.childexec import child_command
from gpudiag.measure.confine import ConfinementPolicy, confined, confinement_policy, how_kept
from gpudiag.measure.interrupts import (
    STOP_SAID_BY_PARENT,
    child_stopped,
    stop_error,
    wait_child,
)
from gpudiag.measure.ownedtemp import is_stale, owned_folder, owner_pid, remove_stale
from gpudiag.model.atomic import fresh_stream
from gpudiag.model.errors import BadInput, HeadBroke
from gpudiag.model.options import ConfineOptions, GateOptions, RunOptions, to_argv
from gpudiag.model.results import RunResult
from gpudiag.model.runfile import load_run


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        message = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise BadInput(f"git {' '.join(args)}: {message}")
    return done.stdout.strip()


def repository_top(cwd: Path, who: str = "--base-ref") -> Path:
    """The top of the git repository holding `cwd`; BadInput naming `who` needs it."""
    if shutil.which("git") is None:
        raise BadInput(f"{who} needs git on PATH")
    try:
        return Path(_git(cwd, "rev-parse", "--show-toplevel"))
    except BadInput:
        raise BadInput(f"{who}: {cwd} is not inside a git repository (its temporary "
                       "checkouts are git worktrees)") from None


def _as_it_is(repo: Path) -> str:
    """A commit of `repo`'s checkout as it is: HEAD with its tracked files' changes (`git
    stash create` makes a commit of them and touches nothing else)."""
    # `stash create` fails, silently, on an index whose files' stat data went stale (a copied
    # or freshly checked-out tree, as on a CI runner): refreshed first, as `git status` does.
    subprocess.run(["git", "update-index", "-q", "--refresh"], cwd=repo, capture_output=True,
                   check=False)
    # `stash create` writes a commit: an identity of its own, as a CI runner may have none.
    return (_git(repo, "-c", "user.name=gpudiag", "-c", "user.email=gpudiag@localhost",
                 "stash", "create") or _git(repo, "rev-parse", "HEAD"))


def _submodules(tree: Path, source: Path, *, as_it_is: bool) -> None:
    """The submodules of the worktree `tree` checked out, recursively, from the user's own
    copies of them in `source` (its checkout): offline, each a clone sharing that copy's
    objects, at the commit `tree` records (the base's), or `as_it_is`, at the user's copy as
    it is (the head's). One the user's checkout has not checked out stays empty, as there."""
    gitlinks = [line.split("\t", 1) for line in _git(tree, "ls-tree", "-r", "-z", "HEAD")
                .split("\0") if line.startswith("160000 ")]
    for entry, path in gitlinks:
        origin = source / path
        if not (origin / ".git").exists():  # not checked out in the user's checkout
            continue
        commit = _as_it_is(origin) if as_it_is else entry.split()[2]
        try:
            _git(origin, "cat-file", "-e", f"{commit}^{{commit}}")
        except BadInput:
            raise BadInput(f"submodule {path}: your checkout's copy lacks commit {commit[:12]}, "
                           f"which the base records; the gate checks submodules out offline "
                           f"from your copies: fetch it first (`git -C {path} fetch`)") from None
        _git(tree, "clone", "--quiet", "--no-checkout", "--shared", str(origin), path)
        _git(tree / path, "checkout", "--quiet", "--detach", commit)
        _submodules(tree / path, origin, as_it_is=as_it_is)


@contextmanager
def _worktree(top: Path, commit: str, cwd: Path, *,
              as_it_is: bool = False) -> Iterator[tuple[Path, Path]]:
    """A detached worktree of `commit` with its submodules (`as_it_is`: the user's copies as
    they are): (its top, `cwd`'s place in it); removed on exit, whatever happens."""
    _remove_stale_worktrees(top)
    with owned_folder(GATE_FOLDERS) as tmp:
        _git(top, "worktree", "add", "--detach", "--quiet", str(tmp / "tree"), commit)
        # Our worktree's own entry in the repository (.git/worktrees/<name>): cleaned up
        # alone. `git worktree prune` would also drop the user's worktrees whose directory is
        # missing at that moment (an unmounted drive, a moved folder).
        admin: Path | None = None
        try:
            admin = Path(_git(tmp / "tree", "rev-parse", "--absolute-git-dir"))
            _submodules(tmp / "tree", top, as_it_is=as_it_is)
            yield tmp / "tree", tmp / "tree" / cwd.resolve().relative_to(top.resolve())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "tree")],
                           cwd=top, capture_output=True, check=False)
            if admin is not None and admin.parent.name == "worktrees" and admin.is_dir():
                shutil.rmtree(admin, ignore_errors=True)


# The kind of gpudiag's owned temporary folders (ownedtemp.py) holding a gate's worktrees.
GATE_FOLDERS = "gate"


def _remove_stale_worktrees(top: Path) -> None:
    """What killed gates and calibrations left: their folders in the temporary directory, and
    this repository's entries (.git/worktrees/<name>) of the worktrees that were in them. Only
    those: a live gate's are locked, and `git worktree prune` would also drop the user's
    worktrees whose folder is missing at that moment."""
    common = top / _git(top, "rev-parse", "--git-common-dir")
    entries = common / "worktrees"
    for admin in sorted(entries.iterdir()) if entries.is_dir() else []:
        try:  # `gitdir` names the worktree's .git file: <folder>/tree/.git
            folder = Path((admin / "gitdir").read_text().strip()).parent.parent
        except OSError:
            continue
        if owner_pid(folder, GATE_FOLDERS) is not None and is_stale(folder, GATE_FOLDERS):
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(admin, ignore_errors=True)
    remove_stale(GATE_FOLDERS)  # another repository's: its entry goes at its next gate


@contextmanager
def base_checkout(ref: str, cwd: Path) -> Iterator[Path]:
    """A detached worktree of `ref`, positioned at `cwd`'s place in the repository; removed on
    exit, whatever happens."""
    top = repository_top(cwd)
    try:
        commit = _git(cwd, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except BadInput:
        raise BadInput(f"--base-ref {ref!r}: no such commit in {top} (fetch it first, "
                       "e.g. `git fetch origin main`)") from None
    place = cwd.resolve().relative_to(top.resolve())
    if place.parts:
        try:  # before any worktree exists: the trial would start in a missing folder
            _git(cwd, "cat-file", "-e", f"{commit}:{place.as_posix()}")
        except BadInput:
            raise BadInput(f"--base-ref {ref!r} has no {place.as_posix()}/, the folder this "
                           "gate runs from: run it from a folder both sides have (e.g. the "
                           "repository's top)") from None
    with _worktree(top, commit, cwd) as (_, place_in_tree):
        yield place_in_tree


# Untracked files the head's worktree copies: beyond these, they are data or an environment,
# not code under review (a venv git does not ignore holds ~10,000 files).
MAX_UNTRACKED_FILES = 2_000
MAX_UNTRACKED_BYTES = 256 * 2**20


def _untracked(top: Path) -> list[Path]:
    """The untracked files git does not ignore, checked against the copy's budget before any
    worktree is made."""
    found = [Path(p) for p in _git(top, "ls-files", "--others", "--exclude-standard",
                                   "-z").split("\0") if p]
    files = [p for p in found if (top / p).is_file() and not (top / p).is_symlink()]
    size = sum((top / p).stat().st_size for p in files)
    if len(files) > MAX_UNTRACKED_FILES or size > MAX_UNTRACKED_BYTES:
        folders = sorted({p.parts[0] for p in files},
                         key=lambda f: -sum(1 for p in files if p.parts[0] == f))
        raise BadInput(f"{len(files):,} untracked files ({size / 2**20:,.0f} MiB, most under "
                       f"{folders[0]}) would be copied into the head's checkout: list them in "
                       ".gitignore (pass inputs with --share) or commit them")
    return files


@contextmanager
def head_checkout(cwd: Path) -> Iterator[Path]:
    """This checkout as it is, in a worktree of its own: HEAD with the tracked files' changes
    (`_as_it_is`), its submodules' likewise, and the untracked files git does not ignore
    copied in (not links: one would write through to the user's files; within a budget; a
    submodule's are not); positioned at `cwd`'s place, removed on exit."""
    top = repository_top(cwd)
    commit = _as_it_is(top)
    untracked = _untracked(top)
    with _worktree(top, commit, cwd, as_it_is=True) as (tree, place):
        for relative in untracked:
            (tree / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(top / relative, tree / relative)
        yield place


def share_into(paths: list[Path], cwd: Path, checkouts: list[Path]) -> None:
    """Link each --share path (data, a tokenizer, outside git: relative to `cwd`) into every
    checkout at the same place, so both sides read the same inputs."""
    for path in paths:
        source = (cwd / path).resolve()
        if not source.exists():
            raise BadInput(f"--share {path}: no such file or directory")
        try:
            relative = source.relative_to(cwd.resolve())
        except ValueError:
            raise BadInput(f"--share {path}: not inside {cwd}; give a path under the working "
                           "directory (a path outside it is read from where it is)") from None
        for checkout in checkouts:
            target = checkout / relative
            if target.exists() or target.is_symlink():
                raise BadInput(f"--share {path}: the checkout has its own {relative} (it is "
                               "in git): nothing to share")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source, target_is_directory=source.is_dir())


def side_env(root: Path) -> dict[str, str]:
    """The environment of a trial run from checkout `root`: its `src/` ahead of installed
    packages (an editable install would otherwise import the head's code on both sides); a
    stop is said by the gate, not by the trial."""
    env = dict(os.environ)
    env[STOP_SAID_BY_PARENT] = "1"
    paths = [str(root / "src")] if (root / "src").is_dir() else []
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@dataclass(frozen=True)
class TrialCommand:
    """What one trial runs: `gpudiag run` with the gate's run options, or `gpudiag profile`
    of the user's command, whose absolute paths into the repository are moved into the side's
    checkout (else `python /repo/train.py` would run the head's file on both sides)."""

    options: RunOptions | None = None
    command: tuple[str, ...] = ()
    top: Path | None = None  # the user's repository, for the command's absolute paths
    samples_per_step: int | None = None
    # The user's command runs confined to its checkout (confine.py); None: gpudiag's own
    # workload (`--model`), which writes only its run folder.
    policy: ConfinementPolicy | None = None
    # The command's program from the user's checkout, where no checkout has it (`kept_program`).
    program: str | None = None

    def argv(self, checkout: Path, out_dir: Path) -> list[str]:
        out = ["--out", str(out_dir.resolve())]
        # No plots: a trial is evidence for gate.md, which links none (1-2 s a trial, as in
        # trialrun.py).
        if self.options is not None:
            return [sys.executable, "-m", "gpudiag", "run", *to_argv(self.options), *out,
                    "--quiet", "--no-plots"]
        declared = ([] if self.samples_per_step is None
                    else ["--samples-per-step", str(self.samples_per_step)])
        # One process a trial: a short script is timed on the steps it has.
        command = [self.program, *self.command[1:]] if self.program else self.command
        return [sys.executable, "-m", "gpudiag", "profile", *out, "--no-plots", "--no-rerun",
                *declared, "--", *(self._moved(arg, checkout) for arg in command)]

    def _moved(self, arg: str, checkout: Path) -> str:
        if self.top is None or not arg.startswith("/") or arg == self.program:
            return arg
        try:
            inside = Path(arg).resolve().relative_to(self.top.resolve())
        except ValueError:
            return arg
        # The checkout stands at the working directory's place in the repository: its top is
        # as many folders up as that place is deep.
        depth = len(Path.cwd().resolve().relative_to(self.top.resolve()).parts)
        return str((checkout.parents[depth - 1] if depth else checkout) / inside)


def run_one(trial: TrialCommand, checkout: Path, out_dir: Path) -> RunResult | None:
    """One fresh gpudiag process on `checkout`'s code into `out_dir`; None if it wrote nothing.
    Raises KeyboardInterrupt after the child (which got the Ctrl-C too) has written its part.
    A profiled command's own output goes to `out_dir`.log; its tail is shown if it fails."""
    log = out_dir.with_name(out_dir.name + ".log") if trial.options is None else None
    out_dir.mkdir(parents=True, exist_ok=True)  # the trial may write only in it (confined)
    env = side_env(checkout)
    with ExitStack() as stack:
        sink = stack.enter_context(fresh_stream(log)) if log is not None else None
        writable = None if trial.policy is None else stack.enter_context(
            confined([*_own_git(checkout), out_dir], Path.cwd().resolve(), env, trial.policy))
        code, stopped_by = wait_child(subprocess.Popen(
            child_command(trial.argv(checkout, out_dir), writable), cwd=checkout, env=env,
            stdout=sink, stderr=subprocess.STDOUT if sink is not None else None))
    run = load_run(out_dir) if (out_dir / "run.json").is_file() else None
    if child_stopped(code, stopped_by):
        raise stop_error(stopped_by)
    if run is None:
        where = (f"; the end of its output ({log}):\n{_tail(log)}" if log is not None
                 else "; its error is above")
        raise BadInput(f"a trial of {checkout} wrote no run.json (exit {code})"
                       f"{CONFINED_HINT if writable is not None else ''}{where}")
    if writable is not None:
        for stage in run.stages:  # the gate's summary quotes a failed stage's error
            if stage.error and any(word in stage.error for word in _REFUSED):
                stage.error += CONFINED_HINT
    return run


# A write the kernel refused, as Python and the C library word it (an EACCES).
_REFUSED = ("PermissionError", "Permission denied", "[Errno 13]")
CONFINED_HINT = ("; the trial ran confined to its checkout, where a write elsewhere fails "
                 "(--rerun-writable FOLDER allows a folder of yours)")


def _own_git(checkout: Path) -> list[Path]:
    """The temporary worktree holding `checkout`, and its entry in the user's repository
    (.git/worktrees/<name>: its index and HEAD), which git in the trial writes."""
    return [Path(_git(checkout, "rev-parse", "--show-toplevel")),
            Path(_git(checkout, "rev-parse", "--absolute-git-dir"))]


TAIL_LINES = 12


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return "\n".join(f"  {line}" for line in lines[-TAIL_LINES:])


@dataclass
class Interleaved:
    out_dir: Path  # holding base/trial-K and head/trial-K
    base: list[RunResult] = field(default_factory=list)
    head: list[RunResult] = field(default_factory=list)
    interrupted: bool = False


@shared_bytecode()  # its processes compile their modules once, not each
def run_interleaved(trial: TrialCommand, *, base: Path, head: Path, out_dir: Path, first: int,
                    next_count: Callable[[Interleaved], int],
                    on_trial: Callable[[str, int], None] = lambda side, k: None,
                    ) -> Interleaved:
    """Trials of both sides into out_dir/base/trial-K and out_dir/head/trial-K, in ABBA order:
    `first` a side, then one round at a time while `next_count`, asked after every round from
    the first's on, wants more than have run (so a gate stops as soon as it is decided)."""
    done = Interleaved(out_dir)
    target, k = first, 0
    try:
        while k < target:
            k += 1
            sides = [("base", base, done.base), ("head", head, done.head)]
            for side, checkout, runs in (sides if k % 2 else sides[::-1]):
                on_trial(side, k)
                try:
                    run = run_one(trial, checkout, out_dir / side / f"trial-{k}")
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


@shared_bytecode()  # its processes compile their modules once, not each
def run_repeated(trial: TrialCommand, checkout: Path, out_dir: Path, count: int,
                 on_trial: Callable[[int], None] = lambda k: None) -> list[RunResult]:
    """`count` fresh processes of one side, one after another, into out_dir/trial-K (a
    calibration's trials). Stops at a Ctrl-C with the trials that finished."""
    runs: list[RunResult] = []
    try:
        for k in range(1, count + 1):
            on_trial(k)
            run = run_one(trial, checkout, out_dir / f"trial-{k}")
            if run is not None:
                runs.append(run)
    except KeyboardInterrupt:
        if not runs:
            raise
    return runs


def trials_policy(confine: ConfineOptions, command: Sequence[str],
                  who: str) -> ConfinementPolicy | None:
    """How the trials of the user's `command` may write, checked before any checkout is made;
    None for gpudiag's own workload (it writes only its run folders)."""
    if not command:
        return None
    # A trial's writes outside its checkout are not watched (a profile's re-runs' are).
    return confinement_policy(confine.rerun_writable, unconfined=confine.unconfined_reruns,
                              isolated=f"{who} runs your command in temporary checkouts",
                              watched=False)


def command_note(shared: Sequence[str], policy: ConfinementPolicy, *,
                 who: str = "gate: each side runs", program: str | None = None) -> str:
    """What running the user's command does with the user's files, said before it runs."""
    note = (f"{who} in a temporary checkout (this checkout with its uncommitted changes and "
            "untracked files, for the head); what the command writes there is removed with "
            f"it{how_kept(policy, 'its checkout', watched=False)}")
    if program is not None:  # git ignores it: no checkout has it
        note += (f"; its program is your {program} (ignored by git), "
                 f"{'read-only' if policy.confined else 'as it is'}")
    if not shared:
        return note
    return note + (f"; {', '.join(shared)} linked into it read-only (--share)" if policy.confined
                   else f"; {', '.join(shared)} linked into it (--share): what the command "
                   "writes there reaches your files")


def kept_program(command: Sequence[str], cwd: Path, top: Path) -> str | None:
    """The user's own path of the command's program where it lies in the repository and git
    ignores it: a virtual environment in the project (`.venv/bin/python train.py`, as uv and
    poetry make it), which no worktree holds. Trials run that interpreter from the user's
    checkout (only reading it: a trial writes in its own checkout alone); None for a program
    found on PATH or one the checkouts have."""
    program = command[0] if command else ""
    if "/" not in program:
        return None
    # Its folder resolved, not the file: a venv's python is a link out of the venv, and its
    # pyvenv.cfg is found beside the path it is started by.
    given = cwd / program
    path = given.parent.resolve() / given.name
    if not path.is_file() or not path.parent.is_relative_to(top.resolve()):
        return None
    ignored = subprocess.run(["git", "check-ignore", "-q", "--", str(path)], cwd=top,
                             capture_output=True, check=False)
    return str(path) if ignored.returncode == 0 else None


def command_trial(command: Sequence[str], policy: ConfinementPolicy | None, cwd: Path, *,
                  who: str = "--base-ref", samples_per_step: int | None = None) -> TrialCommand:
    """What each trial of the user's `command` runs, from `cwd` (`who` needs a repository)."""
    top = repository_top(cwd, who)
    return TrialCommand(command=tuple(command), top=top, samples_per_step=samples_per_step,
                        policy=policy, program=kept_program(command, cwd, top))


def gate_trial(options: RunOptions, gate: GateOptions, command: Sequence[str],
               policy: ConfinementPolicy | None, cwd: Path) -> TrialCommand:
    """What each of `gate --base-ref`'s trials runs, checked before anything is checked out
    or created: gpudiag's workload with `options`, or the user's `command`."""
    if command:
        return command_trial(command, policy, cwd, samples_per_step=gate.samples_per_step)
    from gpudiag.measure.plan import check_run_options  # noqa: PLC0415  (torch)

    check_run_options(options)
    return TrialCommand(options=options)


def gate_job(trial: TrialCommand, base_ref: str, cwd: Path, *, share: Sequence[str],
             first: int, out_dir: Callable[[], Path], next_count: Callable[[Interleaved], int],
             on_start: Callable[[Path], None] = lambda out: None,
             on_trial: Callable[[str, int], None] = lambda side, k: None) -> Interleaved:
    """`gate --base-ref`'s job: `base_ref` checked out (and for a user's command the head too,
    `share` linked into both), then the run folder made (`out_dir`: only once the base exists,
    so a bad ref leaves no empty one behind) and the trials run into it, interleaved
    (`run_interleaved`). The checkouts are removed whatever happens."""
    with ExitStack() as checkouts:
        base = checkouts.enter_context(base_checkout(base_ref, cwd))
        head = checkouts.enter_context(head_checkout(cwd)) if trial.command else cwd
        if trial.command:
            share_into([Path(p) for p in share], cwd, [base, head])
        where = out_dir()
        on_start(where)
        return run_interleaved(trial, base=base, head=head, out_dir=where, first=first,
                               next_count=next_count, on_trial=on_trial)


def calibration_job(trial: TrialCommand, cwd: Path, count: int, *, share: Sequence[str],
                    out_dir: Callable[[], Path],
                    on_start: Callable[[Path], None] = lambda out: None,
                    on_trial: Callable[[int], None] = lambda k: None) -> list[RunResult]:
    """`calibrate -- COMMAND`'s job: `count` trials of the user's command one after another
    (`run_repeated`), in a temporary checkout of this one (the user's files untouched, `share`
    linked in), into the run folder `out_dir` makes once the checkout exists."""
    with head_checkout(cwd) as checkout:
        share_into([Path(p) for p in share], cwd, [checkout])
        where = out_dir()
        on_start(where)
        return run_repeated(trial, checkout, where, count, on_trial=on_trial)
