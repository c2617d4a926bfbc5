"""Runs gpudiag makes away from the user's folder, and how they are kept from its files.

gpudiag runs the user's script in a place of its own several times: a short script's second
run and every --try-fixes run in a scratch copy of the working directory (scratch.py), each
trial of `gate --base-ref REF -- COMMAND` and of `calibrate -- COMMAND` in a temporary git
worktree (gpudiag/measure/gatejob.py). Such a run may write only its own place, gpudiag's
folders for it, a temporary folder of its own, the device files and the caches; the kernel
refuses the rest (Linux Landlock, set up by gpudiag/measure/childexec.py before the command
starts). Where the kernel cannot, nothing runs there without the user's consent
(--unconfined-reruns), asked before anything runs.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudiag.measure import childexec
from gpudiag.measure.childexec import RESOLVE_UNIX_ABI, SCOPE_ABI, SHM, landlock_abi
from gpudiag.measure.ownedtemp import owned_folder, remove_stale
from gpudiag.model.errors import BadInput

# A confined run's folders it may write (os.pathsep between them), as its environment names
# them: a re-run's write watch (profile/inscript/writewatch.py) does not list writes there.
ENV_WRITABLE = "GPUDIAG_PROFILE_WRITABLE"
# The caches compilers and hubs keep, which a re-run may write (the launching side confines
# it to them, the write watch leaves them out): the folders these variables name, else their
# defaults under the home folder. A cold cache would time a re-run's first steps differently.
CACHE_VARIABLES = ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                   "TORCH_HOME", "HF_HOME", "HF_DATASETS_CACHE", "CUDA_CACHE_PATH",
                   "TORCH_EXTENSIONS_DIR", "PYTHONPYCACHEPREFIX")
HOME_CACHES = (".cache", ".triton", ".nv")


@dataclass(frozen=True)
class ConfinementPolicy:
    """How a run away from the user's folder may write: `unconfined`, the user's consent to
    run it where the kernel cannot confine its writes; `writable`, folders of the user's it may
    write too (--rerun-writable); files the user's own run wrote since `written_since`
    (time.time()) are copied into a scratch copy first (scratch.py)."""

    unconfined: bool = False
    writable: tuple[str, ...] = ()
    written_since: float | None = None

    @property
    def confined(self) -> bool:
        return landlock_abi() > 0


# Nothing of the user's writable, no consent to run unconfined: what a run gets unless told.
DEFAULT_POLICY = ConfinementPolicy()


def confinement_refusal(policy: ConfinementPolicy, what: str, *,
                        watched: bool = True) -> str | None:
    """Why `what` (runs away from the user's folder, and where) may not run here: the kernel
    cannot confine their writes and the user did not consent; None when they may. `watched`:
    the runs' writes outside are listed afterwards (a profile's scratch copies; a gate's trials
    are not watched)."""
    if policy.confined or policy.unconfined:
        return None
    return (f"{what}, but this machine cannot keep it from writing to your files (the kernel "
            f"has no Linux Landlock: {platform.release()}): a file of yours it writes through "
            "a link, or a path it names outside, would change. --unconfined-reruns runs it "
            "anyway" + (" (what it writes outside is listed afterwards)" if watched else ""))


# Landlock refuses truncate(2) by path from its ABI 3 (Linux 6.2) on
# (docs.kernel.org/userspace-api/landlock.html, "File truncation").
TRUNCATE_ABI = 3


def how_kept(policy: ConfinementPolicy, where: str, *, watched: bool = True) -> str:
    """How a run away from the user's folder is kept from its files, as the clause that ends
    the line announcing it ("... in a scratch copy of this folder{how_kept}"); `watched` as
    for confinement_refusal."""
    listed = f": what it writes outside {where} is listed afterwards" if watched else ""
    if not policy.confined:
        return f"; this kernel cannot keep it from writing elsewhere (--unconfined-reruns){listed}"
    clause = ", and the kernel refuses its writes to your files elsewhere"
    abi = landlock_abi()
    if abi < TRUNCATE_ABI:
        clause += (f" (but not a truncate by path, which this kernel's Landlock, ABI {abi}, "
                   "cannot refuse" + (": one is listed afterwards)" if watched else ")"))
    return clause + beyond_files(abi, shm_of_its_own(), watched=watched)


def beyond_files(abi: int, own_shm: bool, *, watched: bool) -> str:
    """What a confined run may and may not reach beyond writing files, on a kernel of this
    Landlock `abi` where a run gets a /dev/shm of its own or not (`own_shm`), as the clause
    that ends how_kept's; `watched`: the user's files are compared after it (a profile's
    re-runs)."""
    kept = ["/proc is read-only to it", *(["/dev/shm its own"] if own_shm else [])]
    if abi >= SCOPE_ABI:
        kept.append("it cannot signal your other processes or reach their abstract sockets")
    if abi >= RESOLVE_UNIX_ABI:
        kept.append("nor connect to a unix socket outside its own folders")
    compared = " (compared afterwards and put back)" if watched else ""
    loose = [f"a file's mode, owner, times and extended attributes{compared}",
             "the network"]
    if not own_shm:
        loose.insert(0, "/dev/shm's files" + (" (compared afterwards)" if watched else ""))
    if abi < SCOPE_ABI:
        loose.append(f"signalling your other processes and connecting to their abstract "
                     f"unix sockets "
                     f"(Landlock ABI {SCOPE_ABI}; this kernel's is {abi})")
    if abi < RESOLVE_UNIX_ABI:
        loose.append(f"connecting to a unix socket by its path (Landlock ABI {RESOLVE_UNIX_ABI})")
    if os.geteuid() == 0:
        loose.append("as root, a file's flags (chattr)")
    return f"; {', '.join(kept)}; not confined: {', '.join(loose)}"


@functools.cache
def shm_of_its_own() -> bool:
    """Whether a confined run gets a /dev/shm of its own here (childexec.private_shm: root,
    or unprivileged user namespaces), asked of a process made for the question (~20 ms), as
    the run's own process will make it."""
    if landlock_abi() < 1:
        return False
    try:
        done = subprocess.run([sys.executable, "-I", "-S", childexec.__file__, "--shm-probe"],
                              capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def confinement_policy(writable: Sequence[str], *, unconfined: bool, isolated: str | None,
                       watched: bool = True) -> ConfinementPolicy:
    """How runs away from the user's folder may write, checked before anything runs: the
    `writable` folders (--rerun-writable) exist, outside the working directory, and
    a command whose every run is away from it (`isolated` says which and where) may run here
    at all. Starts the clock of what the user's own run writes."""
    here = Path.cwd().resolve()
    for folder in writable:
        path = Path(folder).resolve()
        if not path.is_dir():
            raise BadInput(f"--rerun-writable {folder}: not a folder")
        if here.is_relative_to(path):
            raise BadInput(f"--rerun-writable {folder}: it holds the working directory, "
                           "whose files a run in a copy must not change")
        if path.is_relative_to(here):
            # A run in a copy or checkout has its own of it, where its relative writes land
            # already; allowing the user's would let it change the very files it is kept off.
            raise BadInput(f"--rerun-writable {folder}: it is inside the working directory, "
                           "whose files a run in a copy must not change (its writes there "
                           "land in the copy's own); name a folder outside it")
    policy = ConfinementPolicy(unconfined=unconfined,
                               writable=tuple(str(Path(f).resolve()) for f in writable),
                               written_since=time.time())
    refused = None if isolated is None else confinement_refusal(policy, isolated,
                                                                watched=watched)
    if refused is not None:
        raise BadInput(refused)
    return policy


@contextlib.contextmanager
def confined(own: Sequence[Path], source: Path, env: dict[str, str],
             policy: ConfinementPolicy) -> Iterator[list[str] | None]:
    """Where a run away from `source` (the user's working directory) may write, for
    childexec.child_command: the folders gpudiag made for it (`own`: its copy or checkout, its
    run folder), a temporary folder of its own (which `env` names from now on, removed on
    exit), the device and process files, the caches, and the folders the user allowed; never
    a folder holding `source`. None where the kernel cannot confine it (policy.unconfined)."""
    if not policy.confined:
        yield None
        return
    remove_stale(CONFINED_FOLDERS)  # a killed job's
    # Short: a Unix socket's path there (multiprocessing's) must fit 108 bytes, which a run
    # folder's may not.
    with owned_folder(CONFINED_FOLDERS) as folder:
        temporary = str(folder)
        writable = confined_writable([*own, folder], source, env, policy.writable)
        env.update({"TMPDIR": temporary, "TEMP": temporary, "TMP": temporary,
                    ENV_WRITABLE: os.pathsep.join(writable)})
        yield writable


# The kind of gpudiag's owned temporary folders (ownedtemp.py): a confined run's TMPDIR.
CONFINED_FOLDERS = "tmp"


def confined_writable(own: Sequence[Path], source: Path, env: dict[str, str],
                      allowed: Sequence[str]) -> list[str]:
    """The folders of `confined`'s list that exist and hold no part of `source`, the caches
    made where missing. Inductor's
    cache stays the one the user's runs fill (it lives in the temporary folder, which a
    confined run's TMPDIR replaces)."""
    inductor = Path(tempfile.gettempdir()) / f"torchinductor_{_user()}"
    if "TORCHINDUCTOR_CACHE_DIR" not in env and inductor.is_dir():
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    home = Path.home()
    caches = [*(home / name for name in HOME_CACHES),
              *(Path(env[v]) for v in CACHE_VARIABLES if env.get(v))]
    for cache in caches:
        # One the run would make itself (a fresh machine's first download or compile): made
        # now, empty, as a folder beneath it could not be allowed before it exists.
        with contextlib.suppress(OSError):
            cache.mkdir(parents=True, exist_ok=True)
    # /dev's devices, not /dev/shm (ordinary files, the user's among them: childexec gives the
    # run one of its own where it can); /proc read-only but the run's own /proc/PID
    # (childexec allows both).
    places = [*own, *_devices(), *caches]
    # The user's folders: never one inside `source` either (confinement_policy refused it).
    users = [Path(os.path.realpath(p)) for p in allowed]
    places += [p for p in users if not p.is_relative_to(source)]
    writable = []
    for place in places:
        real = Path(os.path.realpath(place))
        if real.exists() and not source.is_relative_to(real):
            writable.append(str(real))
    return writable


def _devices() -> list[Path]:
    """/dev's entries but /dev/shm, links (/dev/fd, /dev/stdin: into /proc) and block devices
    (a disk, written raw, would be the user's files too)."""
    try:
        entries = list(os.scandir("/dev"))
    except OSError:
        return []
    return [Path(e.path) for e in entries if e.path != SHM and not e.is_symlink()
            and not stat.S_ISBLK(e.stat(follow_symlinks=False).st_mode)]


def _user() -> str:
    """The user name as Inductor puts it in its cache folder's name (torch/_inductor/
    runtime/cache_dir_utils.py: getpass.getuser(), path separators dropped)."""
    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"
