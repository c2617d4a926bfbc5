"""How gpudiag starts the processes it measures (a profiled command, a trial's gpudiag, torchrun
for the ddp stage): through this file run as a program, which sets up the process and then
execs the command, so what it sets holds from the command's first instruction, whatever the
command is (a shell, torchrun, Python), and is inherited by all it starts.

- It dies with gpudiag: Linux's parent-death signal (prctl(2) PR_SET_PDEATHSIG, SIGTERM), so
  a gpudiag killed outright (SIGKILL, the out-of-memory killer) leaves nothing running on; the
  command stops as on any SIGTERM, writing what it measured.
- A re-run's writes confined (`--writable`) to the places gpudiag gives it, by the kernel:
  Linux's Landlock (https://docs.kernel.org/userspace-api/landlock.html), which an
  unprivileged process may apply to itself and to everything it starts. A re-run may then
  write only to its own folder (its scratch copy, its parts and traces), a temporary folder of
  its own, the machine's device and process files, and the caches compilers and hubs keep;
  anything else, a file of the user's linked into the copy or a path the script names outside
  it, fails to open for writing, remove, rename or truncate (EACCES), so a re-run cannot change
  what the user had. The write watch (profile/inscript/writewatch.py) still names what it
  tried. Beyond the files: /proc is read-only but for the command's own /proc/PID; /dev/shm
  (a tmpfs of ordinary files, which DataLoader workers, semaphores and NCCL need to write) is
  one of its own where the kernel lets this process make one (a mount namespace: root, or an
  unprivileged user namespace), else the machine's, compared afterwards (scratch.py); from
  Landlock ABI 6 it may neither signal nor connect to an abstract unix socket of a process
  outside its confinement, from ABI 9 neither connect to a pathname socket outside its own
  folders ("Scope flags" and LANDLOCK_ACCESS_FS_RESOLVE_UNIX in the kernel's Landlock
  documentation). confine.py's `beyond_files` says what this kernel leaves open.

`python -I -S childexec.py --parent PID [--writable JSON] -- COMMAND...`: standard library
only, no gpudiag import, ~15 ms: it runs before anything else in the process.
"""
# Paths as strings: the program half runs with only the standard library, before any import.
# ruff: noqa: PTH100, PTH112, PTH123

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import stat
import sys
from collections.abc import Iterable, Sequence

# linux/landlock.h and the syscall table (the same number on every architecture).
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE_ANY = sum(1 << bit for bit in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
RESOLVE_UNIX = 1 << 16  # ABI 9: connect to a pathname unix socket
RESOLVE_UNIX_ABI = 9
# The ruleset's `scoped` field (ABI 6): no connecting to an abstract unix socket, no signal,
# to a process outside this confinement.
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
SCOPE_ABI = 6
# The ruleset attribute's size as each ABI reads it: handled_access_fs; handled_access_net
# from ABI 4; scoped from ABI 6.
_NET_ABI = 4
CONFINE_FAILED = 126  # the program's exit status when the rules could not be applied
ENV_OFF = "GPUDIAG_NO_LANDLOCK"  # set: behave as a kernel without Landlock (tests, a bad kernel)
SHM = "/dev/shm"
# unshare(2), mount(2): a mount namespace of the command's own, for a /dev/shm of its own.
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


class _RulesetAttr(ctypes.Structure):
    _fields_ = (("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64))


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (not Linux, an older kernel,
    Landlock not enabled) or where ENV_OFF says to behave so."""
    if os.environ.get(ENV_OFF) or not sys.platform.startswith("linux"):
        return 0
    try:
        version = _libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0),
                                  ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


def write_access(abi: int) -> int:
    """Every right that changes a file or folder (and, from ABI 9, connects to a unix socket
    by its path), as far as this ABI knows them."""
    rights = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_ANY
    return (rights | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
            | (RESOLVE_UNIX if abi >= RESOLVE_UNIX_ABI else 0))


def file_access(abi: int) -> int:
    """The rights of write_access that a rule on one file (not a folder) may grant: Landlock
    refuses a rule on a file naming a folder's rights."""
    return write_access(abi) & (WRITE_FILE | TRUNCATE)


def scopes(abi: int) -> int:
    """What the ruleset keeps from reaching outside it beyond the files: abstract unix sockets
    and signals, from ABI 6; none before."""
    return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= SCOPE_ABI else 0


def ruleset_size(abi: int) -> int:
    """The bytes of _RulesetAttr this ABI reads (an older kernel refuses a larger one)."""
    fields = 3 if abi >= SCOPE_ABI else 2 if abi >= _NET_ABI else 1
    return fields * ctypes.sizeof(ctypes.c_uint64)


def child_command(command: Sequence[str], writable: Iterable[str] | None = None) -> list[str]:
    """`command`, run so that it dies with this process and, given `writable` (existing
    folders), may write only beneath them."""
    confine = [] if writable is None else ["--writable", json.dumps(sorted(set(writable)))]
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "--parent", str(os.getpid()),
            *confine, "--", *command]


def restrict_writes(writable: Iterable[str]) -> None:
    """This process, and all it starts from now on, may write only beneath `writable` (folders,
    or files such as /dev's devices), /dev/shm and its own /proc/PID, and (ABI 6) neither
    signal nor connect to an abstract socket outside. OSError when the kernel refuses."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(0, "Landlock is not available")
    libc = _libc()
    handled = write_access(abi)
    attr = _RulesetAttr(handled, 0, scopes(abi))
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr),
                           ctypes.c_size_t(ruleset_size(abi)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _errno("landlock_create_ruleset")
    try:
        # /proc/self now is the command's own /proc/PID: exec keeps the process.
        for path in [*writable, SHM, "/proc/self"]:
            _allow(libc, ruleset, path, abi)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:
            raise _errno("prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise _errno("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, abi: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:  # gone meanwhile: nothing to allow there
        return
    try:
        folder = stat.S_ISDIR(os.fstat(fd).st_mode)
        rule = _PathBeneathAttr(write_access(abi) if folder else file_access(abi), fd)
        if libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
            raise _errno(f"landlock_add_rule({path})")
    finally:
        os.close(fd)


def private_shm() -> bool:
    """A /dev/shm of this process's own (an empty tmpfs, in a mount namespace of its own and
    all it starts), so that the machine's, the user's files there among them, is out of its
    reach; False where the kernel lets it make none (not root, and no unprivileged user
    namespaces), and this process keeps the machine's."""
    if not sys.platform.startswith("linux") or not os.path.isdir(SHM):
        return False
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        made = libc.unshare(_CLONE_NEWNS) == 0
    else:
        made = libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) == 0 and _map_ids(uid, gid)
    if not made:
        return False
    # Private first: the tmpfs must not propagate back into the machine's namespace.
    return (libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0
            and libc.mount(b"tmpfs", SHM.encode(), b"tmpfs", 0, b"mode=1777") == 0)


def _map_ids(uid: int, gid: int) -> bool:
    """In a new user namespace: the same user and group inside as outside."""
    try:
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    except OSError:
        return False
    return True


def _errno(call: str) -> OSError:
    number = ctypes.get_errno()
    return OSError(number, f"{call}: {os.strerror(number)}")


def die_with(parent: int) -> bool:
    """SIGTERM to this process when its parent thread ends; False when the parent is gone
    already (it died before the signal was set) or prctl is missing."""
    if sys.platform.startswith("linux"):
        # OSError, AttributeError: no C library to load, or no prctl in it.
        with contextlib.suppress(OSError, AttributeError):
            _libc().prctl(_PR_SET_PDEATHSIG, 15, 0, 0, 0)  # SIGTERM
    return os.getppid() == parent


def main(argv: list[str]) -> int:
    """`childexec.py --parent PID [--writable JSON] -- COMMAND...`: set up, then become the
    command."""
    if argv == ["--shm-probe"]:  # confine.shm_of_its_own: can a run have a /dev/shm of its own
        return 0 if private_shm() else 1
    options: dict[str, str] = {}
    while len(argv) >= 2 and argv[0] in ("--parent", "--writable"):
        options[argv[0]], argv = argv[1], argv[2:]
    if len(argv) < 2 or argv[0] != "--" or "--parent" not in options:
        sys.stderr.write("usage: childexec.py --parent PID [--writable JSON] -- COMMAND...\n")
        return 2
    if not die_with(int(options["--parent"])):
        return 128 + 15  # as a SIGTERM would have ended it: gpudiag is gone
    try:
        if "--writable" in options:
            private_shm()  # else the machine's /dev/shm, compared afterwards (scratch.py)
            restrict_writes(json.loads(options["--writable"]))
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"gpudiag: cannot confine the re-run's writes: {exc}\n")
        return CONFINE_FAILED
    command = argv[1:]
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"gpudiag: cannot run {command[0]!r}: {exc.strerror or exc}\n")
        return 127
    return 0  # not reached: exec replaced the program


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
