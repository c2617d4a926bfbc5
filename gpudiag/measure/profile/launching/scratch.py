"""Where a re-run of a profiled script runs (a fix's run, one without fixes, a short script's
second run, a diagnosis run gpudiag stops early): a scratch copy of the working directory
gpudiag was started in, inside the run's own folder, so that what the re-run writes, appends,
overwrites or deletes there (checkpoints, logs, a checkpoint it resumes from) lands in the
copy and the user's files stay as they were. The command runs with the same arguments from the
copy; relative paths resolve to the copies, and an absolute path into the working directory
is moved into the copy too (`python /abs/train.py` runs the copy's train.py).

The copy sits where the working directory sits in its parents' folders: the folders above it
are mirrored VIEW_LEVELS deep with links to their other entries, so `../data` reads the
user's data as it does in the user's run.

Regular files are copied, cloned (FICLONE: a reflink, no data copied) where the filesystem
can. Not copied but linked (a symbolic link to the user's): version control and environment
folders, folders holding more than DATASET_ENTRIES entries (data is read, outputs are
written), and what is over the copy budget (MAX_COPY_FILES, MAX_COPY_BYTES really copied,
files of folders holding few first, then small ones; folders past MAX_WALK entries). Files
the user's own run wrote since it started are copied first, whatever the budget, disk space
allowing: those a re-run writes. A
linked file or folder is read-only to the re-run where the kernel confines its writes
(measure/childexec.py: Landlock); elsewhere the re-run runs only with the user's consent,
and each linked file's size, time and inode are compared after it. gpudiag's run folders
are left out. What no confinement refuses (a file's mode, owner, times, extended attributes;
the machine's /dev/shm) is recorded for every file walked and compared after it (userfiles.py).

After the run the copies it left unchanged are removed: the copy then holds what the re-run
wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpudiag.measure.profile import protocol
from gpudiag.measure.profile.launching import userfiles
from gpudiag.measure.profile.launching.userfiles import FileState
from gpudiag.model.results import Rerun
from gpudiag.model.runfile import RUN_MARKER

SCRATCH_DIR = "cwd"  # in the re-run's own folder: the mirrored parents, the copy inside
VIEW_LEVELS = 2  # parent folders mirrored around the copy (`../data`, `../../datasets`)
MAX_VIEW_ENTRIES = 1_000  # a parent folder with more entries is not mirrored (said so)
MAX_WALK = 50_000  # entries looked at; folders past them are linked whole
DATASET_ENTRIES = 2_000  # a folder (not the working directory) with more is linked whole
MAX_COPY_FILES = 20_000
MAX_COPY_BYTES = 2 * 2**30  # really copied (a clone costs none); larger files past it are linked
FREE_MARGIN_BYTES = 2**30  # left free on the disk when copying past the budget
LINKED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules"})
ENVIRONMENT_MARKS = ("pyvenv.cfg", "conda-meta")  # a virtualenv's, a conda environment's
MAX_LISTED = 20  # linked paths and outside writes listed in run.json; the count says the rest
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)

Key = tuple[int, int, int]  # inode, size, modification time (ns): changed when any differs


class ScratchError(Exception):
    """The copy could not be made (a full disk, an unreadable working directory): no re-run."""


def _key(stat: os.stat_result) -> Key:
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def shown(path: str | Path) -> str:
    """A path as text that can be written anywhere: a name that is not UTF-8 keeps its bytes
    as backslash escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


@dataclass
class Scratch:
    """A copy of `source` at `root` (inside `top`, the mirrored parents), and what it holds:
    copies (with their state as made), links made, and the user's files linked (with theirs).
    `confined`: the re-run's writes are confined (childexec.py), so linked files are read-only
    to it."""

    source: Path
    top: Path
    root: Path
    copies: dict[Path, Key] = field(default_factory=dict)
    links: dict[Path, str] = field(default_factory=dict)
    dirs: list[Path] = field(default_factory=list)  # made, parents first
    linked: dict[Path, Key | None] = field(default_factory=dict)  # user's path -> file's key
    unmirrored: list[str] = field(default_factory=list)  # parents too large to mirror
    confined: bool = False
    # The user's files walked and /dev/shm's, as they were: what no confinement refuses.
    states: dict[Path, FileState] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {protocol.ENV_SCRATCH: str(self.root), "PWD": str(self.root)}

    def command(self, command: Sequence[str]) -> list[str]:
        """`command` with each absolute path into the source moved to its copy (an
        `--option=PATH` too); paths the copy only links to stay as they are."""
        return [self._moved(arg) for arg in command]

    def _moved(self, arg: str) -> str:
        head, equals, path = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        if not equals:
            head, path = "", arg
        if not Path(path).is_absolute():
            return arg
        try:
            rel = Path(os.path.normpath(path)).relative_to(self.source)
        except ValueError:
            return arg
        copy = self.root / rel
        real = Path(os.path.realpath(copy))
        if not os.path.lexists(copy) or not (real == self.root or real.is_relative_to(self.root)):
            return arg  # not in the copy, or only linked there: the user's own path
        return f"{head}{equals}{copy}"

    def why_linked(self, path: str) -> str | None:
        """Why `path` (one of the user's, which a confined re-run was refused writing) is
        only linked into the copy, read-only, with what the user can do about it; None for a
        path outside the working directory (--rerun-writable can allow its folder)."""
        target = Path(path)
        if not target.is_relative_to(self.source):
            return None
        for linked, key in self.linked.items():
            if linked == target and key is not None:
                return (f"{shown(linked.relative_to(self.source))} ({_size(key[1])}) is past "
                        f"the scratch copy's budget ({_size(MAX_COPY_BYTES)} copied, "
                        f"{MAX_COPY_FILES:,} files), so the copy links it read-only: "
                        "move it out of this folder (or have the script start a new one) and "
                        "each run writes its own")
            if target.is_relative_to(linked) and key is None:
                return (f"{shown(linked.relative_to(self.source))}/ is linked whole into the "
                        "scratch copy, read-only (version control, an environment, or a "
                        f"folder of more than {DATASET_ENTRIES:,} entries): have the script "
                        "write its outputs to a folder of their own")
        return None

    def finish(self, label: str, parts_dir: Path) -> Rerun:
        """The re-run's record: linked files that changed, what it wrote outside; the copies
        it left unchanged removed."""
        changed = [path for path, key in self.linked.items()
                   if key is not None and _stat_key(path) != key]
        touched = userfiles.touched(self.states, contents_said=changed)
        self._prune()
        outside, more = outside_writes(parts_dir)
        named = [shown(p.relative_to(self.source)) + ("/" if key is None else "")
                 for p, key in self.linked.items() if p.is_relative_to(self.source)]
        return Rerun(label=label, source=shown(self.source), cwd=shown(self.root),
                     copied=len(self.copies), linked=named[:MAX_LISTED],
                     linked_count=len(named), wrote_outside=outside, more_outside=more,
                     changed_linked=[shown(p) for p in changed[:MAX_LISTED]],
                     touched=touched[:MAX_LISTED], touched_count=len(touched),
                     confined=self.confined, unmirrored=self.unmirrored, mirrored=True)

    def _prune(self) -> None:
        for path, key in self.copies.items():
            if _stat_key(path) == key:
                path.unlink()
        for path, target in self.links.items():
            with contextlib.suppress(OSError):
                if str(path.readlink()) == target:
                    path.unlink()
        for path in reversed(self.dirs):
            with contextlib.suppress(OSError):  # not empty: the re-run wrote there
                path.rmdir()


def _size(count: int) -> str:
    """Bytes as a reader says them: 2.2 GiB, 40 MiB, 500 bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:,.1f} {unit}".replace(".0 ", " ")
    return f"{count:,} bytes"


def _stat_key(path: Path) -> Key | None:
    try:
        return _key(path.lstat())
    except OSError:
        return None


@dataclass
class _Plan:
    """What a copy of the source is made of (relative paths)."""

    dirs: dict[Path, None] = field(default_factory=dict)  # to make, parents first
    files: list[tuple[Path, os.stat_result]] = field(default_factory=list)
    links: list[tuple[Path, str]] = field(default_factory=list)  # the user's, made again
    whole: list[Path] = field(default_factory=list)  # folders linked whole


def _walk(source: Path, leave_out: Path) -> _Plan:
    """Breadth first, so the script's own folder's files come before deep data trees; a
    folder holding more than DATASET_ENTRIES entries is linked whole unread, and past
    MAX_WALK entries the folders not yet read are."""
    plan = _Plan()
    queue, seen = deque([Path()]), 0
    while queue and seen <= MAX_WALK:
        rel = queue.popleft()
        try:
            entries = list(os.scandir(source / rel))
        except (PermissionError, FileNotFoundError) as exc:
            if rel == Path():
                raise
            del plan.dirs[rel]
            if isinstance(exc, PermissionError):  # unreadable to the script too: so is a link
                plan.whole.append(rel)
            continue
        if rel != Path() and len(entries) > DATASET_ENTRIES:
            del plan.dirs[rel]
            plan.whole.append(rel)
            continue
        seen += len(entries)
        for entry in entries:
            if _planned(plan, rel / entry.name, entry, source, leave_out):
                queue.append(rel / entry.name)
    for rel in queue:
        del plan.dirs[rel]
        plan.whole.append(rel)
    return plan


def _planned(plan: _Plan, rel: Path, entry: os.DirEntry[str], source: Path,
             leave_out: Path) -> bool:
    """`entry` (at `rel`) put in the plan; True for a folder to read."""
    path = source / rel
    if entry.is_symlink():
        plan.links.append((rel, _link_target(path, source)))
    elif entry.is_dir():
        if path == leave_out or (path / RUN_MARKER).exists():
            return False
        if entry.name in LINKED_DIRS or any((path / m).exists() for m in ENVIRONMENT_MARKS):
            plan.whole.append(rel)
            return False
        plan.dirs[rel] = None
        return True
    elif entry.is_file():
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile (a lock, a rotated log)
            plan.files.append((rel, entry.stat()))
    return False


def _link_target(path: Path, source: Path) -> str:
    """A link of the user's, to make again in the copy: relative when it stays inside the
    source (it then points into the copy), else to the same place, absolute."""
    target = path.readlink()
    resolved = Path(os.path.normpath(path.parent / target))
    return str(target if target.is_absolute() or resolved.is_relative_to(source) else resolved)


def make_scratch(source: Path, top: Path, leave_out: Path, *,
                 written_since: float | None = None, confined: bool = False) -> Scratch:
    """Copy `source` into `top` (which must not exist), in its mirrored parents, leaving out
    `leave_out` (the re-run's own folder) and gpudiag's run folders; files modified since
    `written_since` (a time.time()) first. ScratchError when it cannot (a full disk), with
    nothing of the copy left; a stop (KeyboardInterrupt) meanwhile leaves nothing either."""
    parents = list(source.parents)[:VIEW_LEVELS]
    root = top.joinpath(*(p.name for p in reversed(parents[:-1])), source.name or "root")
    scratch = Scratch(source=source, top=top, root=root, confined=confined)
    try:
        plan = _walk(source, leave_out.resolve())
        top.mkdir(parents=True)
    except OSError as exc:
        raise ScratchError(f"cannot copy {source} for a re-run: {exc.strerror or exc}") from None
    try:
        # Folders linked whole (a dataset, .git) by their own state only: not walked.
        scratch.states = userfiles.record([*(source / rel for rel, _ in plan.files),
                                           *(source / rel for rel in plan.whole),
                                           *userfiles.shm_files()])
        _mirror(scratch, parents)
        _fill(scratch, plan, written_since)
    except BaseException as exc:
        shutil.rmtree(top, ignore_errors=True)  # gpudiag's own; links are removed, not followed
        if isinstance(exc, OSError):
            raise ScratchError(f"cannot copy {source} to {root} for a re-run: "
                               f"{exc.strerror or exc}") from None
        raise
    return scratch


def _mirror(scratch: Scratch, parents: list[Path]) -> None:
    """The folders above the copy, each holding links to its real counterpart's other
    entries (the root folder's are not mirrored: `../usr` is no one's data)."""
    for level, parent in enumerate(parents):
        here = scratch.top.joinpath(*(p.name for p in reversed(parents[level:-1])))
        if here != scratch.top:
            here.mkdir()
            scratch.dirs.insert(0, here)
        inner = parents[level - 1] if level else scratch.source
        if parent == Path(parent.anchor):
            continue
        try:
            entries = [e for e in os.scandir(parent) if e.name != inner.name]
        except OSError:  # unreadable: `../x` fails in the re-run as it would in the user's
            continue
        if len(entries) > MAX_VIEW_ENTRIES:
            scratch.unmirrored.append(shown(parent))
            continue
        for entry in entries:
            (here / entry.name).symlink_to(entry.path)
            scratch.links[here / entry.name] = entry.path
    scratch.root.mkdir()
    scratch.dirs.append(scratch.root)


def _fill(scratch: Scratch, plan: _Plan, written_since: float | None) -> None:
    for rel in plan.dirs:
        (scratch.root / rel).mkdir()
        scratch.dirs.append(scratch.root / rel)
    for rel, target in plan.links:
        (scratch.root / rel).symlink_to(target)
        scratch.links[scratch.root / rel] = target
    for rel in plan.whole:
        _link(scratch, rel, None)
    since_ns = None if written_since is None else int(written_since * 1e9)

    def written(stat: os.stat_result) -> bool:
        return since_ns is not None and stat.st_mtime_ns >= since_ns

    # Outputs before data: what the user's run wrote, then files of folders with few files (a
    # log, a checkpoint, a config) before those of folders with many (a dataset's shards), then
    # the smaller.
    siblings = Counter(rel.parent for rel, _ in plan.files)
    copied_bytes = 0
    for rel, stat in sorted(plan.files, key=lambda item: (
            not written(item[1]), siblings[item[0].parent], item[1].st_size)):
        copy = scratch.root / rel
        must = written(stat) and _room_for(scratch.root, stat.st_size)
        if must or len(scratch.copies) < MAX_COPY_FILES:
            how = _copy(scratch.source / rel, copy,
                        may_copy=must or copied_bytes + stat.st_size <= MAX_COPY_BYTES)
            if how == "gone":
                continue
            if how is not None:
                copied_bytes += 0 if how == "cloned" else stat.st_size
                scratch.copies[copy] = _key(copy.lstat())
                continue
        _link(scratch, rel, _key(stat))


def _room_for(folder: Path, size: int) -> bool:
    return shutil.disk_usage(folder).free > size + FREE_MARGIN_BYTES


def _link(scratch: Scratch, rel: Path, key: Key | None) -> None:
    """A link to the user's file (`key` its state now) or folder (None), in place of a copy."""
    original = scratch.source / rel
    (scratch.root / rel).symlink_to(original)
    scratch.links[scratch.root / rel] = str(original)
    scratch.linked[original] = key


def _copy(source: Path, copy: Path, *, may_copy: bool) -> str | None:
    """"cloned" (a reflink: no data copied) or "copied" (only when `may_copy`), with the
    original's mode and times; None when neither (over the budget, or unreadable); "gone" when
    the original was removed meanwhile."""
    try:
        with source.open("rb") as original, copy.open("xb") as made:
            try:
                fcntl.ioctl(made.fileno(), FICLONE, original.fileno())
                how = "cloned"
            except OSError:  # not a filesystem that shares extents, or another one
                how = "copied"
        if how == "copied":
            if not may_copy:
                copy.unlink()
                return None
            shutil.copyfile(source, copy)  # in the kernel (sendfile), over the empty file
        shutil.copystat(source, copy)
    except (PermissionError, FileNotFoundError) as exc:
        copy.unlink(missing_ok=True)
        # Unreadable to the script as well: a link keeps it so.
        return None if isinstance(exc, PermissionError) else "gone"
    return how


def outside_writes(parts_dir: Path) -> tuple[list[str], bool]:
    """The paths the re-run's processes wrote (or, confined, tried to write) outside its copy
    (writewatch.py), the first MAX_LISTED, and whether there were more."""
    found: set[str] = set()
    for path in sorted(parts_dir.glob(protocol.WRITES_GLOB)):
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="surrogateescape").splitlines():
                with contextlib.suppress(ValueError):
                    found.add(shown(str(json.loads(line))))
    more = protocol.WRITES_MORE in found
    listed = sorted(found - {protocol.WRITES_MORE})
    return listed[:MAX_LISTED], more or len(listed) > MAX_LISTED
