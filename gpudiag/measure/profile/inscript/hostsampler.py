"""Where a profiled script's host time goes, by line: the training thread's Python stack,
sampled at a fixed period, each sample standing for the time since the previous one.

Who takes a sample: when the training thread is the main thread (on Linux), a timer signal
to that thread (gpudiag/measure/profile/inscript/threadtimer.py), whose handler runs in it
between two bytecodes with its frame (~30 us a sample on a Python loop; reports/examples/h100-host).
Otherwise a daemon thread reads its stack (`sys._current_frames`, the in-process form of
what py-spy reads from outside): to do so it
must take the GIL, and from a thread running Python it gets it only by a forced switch after
the switch interval (5 ms), which stalls the training thread ~100 us (two thread wake-ups;
`stalls` in benchmarks/host_sampler.py) and shifts the sample to where the GIL was let go.
A signal arriving while the thread is inside one long C call (a device sync, a GIL-holding
numpy call) is handled when the call returns, on the call's line: the sample stands for the
timer's periods since the previous one, all spent in that call. The interpreter looks for a
signal only after a call, at a function's start and at a loop's jump back, so long work that
is no call (an operator or a subscript on a large numpy array) is charged to the next call.

A sample is charged to the innermost frame of the user's own code (a library frame below it
kept as `via`, as device work is charged in gpudiag/measure/evidence/source.py), looking no
further out than the training loop (a library's loop is charged to its own lines), and to
what the thread was doing there (gpudiag.model.facts.HOST_KINDS), read from the innermost frame:
- in torch's own Python code (a module's forward, backward(), an optimizer) -> torch; under
  torch.utils.data -> data; in torch's tensor printing or a synchronize() -> sync; in
  torch.compile's own work (Dynamo's guards, a compilation) -> compile;
- at a call whose target the source names (`loss.item()`, `np.rot90(x)`, `torch.cat(...)`,
  found from the call instruction's source position): a read-back (.item(), .cpu(), .tolist(),
  .numpy(), .nonzero()...) -> sync on a GPU; a name that resolves through the frame's globals
  to torch -> torch, to anything else -> python; a method of a local (x.sum()) or an operator
  (a @ b) -> call, which the profiler window's record of the line's torch calls decides;
- anything else (bytecode running, a library's Python) -> python.

Steps after warm-up are kept apart from the slow ones (over SLOW_STEP x the median of the steps
around them: an evaluation, a save): the steady steps' samples are summed by line, a slow step
keeps which lines of the training loop held it. The profiler window's steps are not sampled (the
profiler slows their host work).
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import linecache
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from types import (
    BuiltinFunctionType,
    CodeType,
    FrameType,
    FunctionType,
    MappingProxyType,
    ModuleType,
)
from typing import Literal, NamedTuple, cast

import torch

from gpudiag.measure.evidence.source import code_role, display_path, frame_role
from gpudiag.measure.profile.inscript import threadtimer
from gpudiag.model.config import HOST_SAMPLE_HZ
from gpudiag.model.facts import HostKind, HostLine, HostSamples, HostStep

PERIOD_S = 1 / HOST_SAMPLE_HZ  # 50 Hz: a 100 ms step gets 5 samples, a 2 ms step one in 10
MAX_WEIGHT_PERIODS = 4  # a thread's sample taken late (the GIL held) counts at most this many
# A timer signal unanswered for this many periods means the training thread blocks it: the
# sampler goes on from a thread.
UNANSWERED_PERIODS = 20
SLOW_STEP = 1.5  # a step this many times the median around it is slow: kept apart...
# ... and this much above it: a sample delays the step it lands in (the training thread waits
# for the GIL while the sampler holds it), which must not make sampled steps "slow".
SLOW_STEP_MIN_EXTRA_MS = 1.0
RECENT_STEPS = 48  # steps before a step that its "usual" is the median over...
LOOKAHEAD = 16  # ... and steps after it: a step is filed once these have ended
MIN_RECENT = 5  # with fewer steps around it than this, no step is slow
USUAL_EVERY = 8  # steps between two readings of that median
MAX_SLOW_STEPS = 2_000  # slow steps kept one by one
# The rate fitted at the end of warm-up: at least this many samples over the timed steps'
# length (a 60-step script of 3.5 ms steps got ~10 samples in its whole run at 50 Hz), never
# faster than MIN_PERIOD_S: the timed steps are sampled too, and a sample costs ~25 us in the
# handler on a 2-core VM (benchmarks/host_sampler.py), 1% of the host at 400 Hz.
TARGET_SAMPLES = 200
MIN_PERIOD_S = 2.5e-3
MAX_KEYS = 5_000  # distinct (line, via, kind) kept; later ones are summed as "other lines"
MAX_LINES = 40  # lines written to run.json, busiest first
MAX_STEP_LINES = 5  # training-loop lines kept per slow step
FILE_EVERY = 128  # steps filed at once (at a sample: one in ~12 at 50 Hz and 2 ms steps)

# Calls that read a device value back to the host: each waits for the GPU's queue to drain.
SYNC_CALLS = frozenset({"item", "tolist", "cpu", "numpy", "synchronize", "nonzero",
                        "argwhere", "unique", "masked_select", "_local_scalar_dense"})
_TORCH = "torch"
_DATA_DIR = "/torch/utils/data/"
_SYNC_FILES = ("/torch/_tensor_str.py",)
# torch.compile's own work: its guards (generated code, file "<string>"), and compiling, which
# always runs under Dynamo's convert_frame (Inductor too). Not the rest of torch/_dynamo: its
# eval_frame.py wraps every torch._disable_dynamo function (torch.optim's step, with
# compile=False), and a compiled call runs compiled code, whose work is the torch calls'.
_COMPILING_FILE = "/torch/_dynamo/convert_frame.py"
_DYNAMO_GUARDS = frozenset({"guard", "___make_guard_fn"})
_OPERATORS = frozenset({"BINARY_OP", "BINARY_SUBSCR", "STORE_SUBSCR", "COMPARE_OP",
                        "UNARY_NEGATIVE", "UNARY_INVERT", "CONTAINS_OP", "BINARY_MATRIX_MULTIPLY"})
OTHER_LINES = "(other lines)"


class Callee(NamedTuple):
    """What a call instruction calls, as its source spells it: `root.a.b(...)`."""

    root: str | None  # the leftmost name, when the callee is a (dotted) name
    chain: tuple[str, ...]  # the attributes after it
    name: str  # the last name: the method or function called


_OPERATOR = Callee(None, (), "")  # an operator: a @ b, x[i] = y
_UNKNOWN = Callee(None, (), "?")  # a call whose source is not read
MAX_PARSED_BYTES = 64_000


@functools.cache
def _calls_by_end(filename: str) -> dict[tuple[int, int], Callee]:
    """Every call in a source file, by where it ends (line, column): a call instruction's
    source position ends where its call expression does (CPython moves only its start). A
    library's file over MAX_PARSED_BYTES is not read: parsing it would hold the GIL, so the
    training thread, for tens of ms; its calls stay unknown."""
    try:
        path = Path(filename)
        if frame_role(filename) != "user" and path.stat().st_size > MAX_PARSED_BYTES:
            return {}
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return {}
    calls = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or node.end_lineno is None:
            continue
        chain: list[str] = []
        func = node.func
        while isinstance(func, ast.Attribute):
            chain.append(func.attr)
            func = func.value
        root = func.id if isinstance(func, ast.Name) else None
        name = chain[0] if chain else (root or "")
        calls[(node.end_lineno, node.end_col_offset or 0)] = Callee(root, tuple(reversed(chain)),
                                                                    name)
    return calls


def _callees(code: CodeType) -> dict[int, Callee]:
    """Instruction offset -> its callee, for a code object's calls and operators (Python
    3.11+: instructions carry source positions; on 3.10 none are known). Kept by the code's
    id, with the code: hashing a code object hashes its bytecode and constants (microseconds
    at every sample)."""
    known = _CALLEES.get(id(code))
    if known is None:
        known = _CALLEES[id(code)] = (code, _find_callees(code))
    return known[1]


_CALLEES: dict[int, tuple[CodeType, dict[int, Callee]]] = {}


def _find_callees(code: CodeType) -> dict[int, Callee]:
    found: dict[int, Callee] = {}
    if sys.version_info < (3, 11):
        return found
    calls = _calls_by_end(code.co_filename)
    for instr in dis.get_instructions(code):
        if instr.opname in _OPERATORS:
            found[instr.offset] = _OPERATOR
        elif instr.opname.startswith(("CALL", "PRECALL")) and instr.positions is not None:
            end = (instr.positions.end_lineno, instr.positions.end_col_offset)
            found[instr.offset] = calls.get(end, _UNKNOWN) if None not in end else _UNKNOWN
    return found


def _resolves_to_torch(frame: FrameType, callee: Callee) -> bool | None:
    """Whether a named callee is torch's, by what its leftmost name is in the frame's globals
    (a module-level training loop's names all are): a module (torch, F, np), a function or
    class (where it is defined), an object (its type's module: a global tensor's `x.cuda()`).
    None for a local's method (`x.sum()`): unknown. Nothing is called or looked into: that
    could run the user's code."""
    code = frame.f_code
    root = callee.root
    if root is None or root in code.co_varnames or root in code.co_cellvars \
            or root in code.co_freevars:
        return None
    target = frame.f_globals.get(root, getattr(builtins, root, None))
    if isinstance(target, ModuleType):
        owner = target.__name__
    elif isinstance(target, (type, FunctionType, BuiltinFunctionType)):
        owner = getattr(target, "__module__", None) or ""
    else:
        owner = type(target).__module__
    return owner.split(".")[0] == _TORCH


def _call_kind(frame: FrameType, cuda: bool) -> tuple[HostKind, Callee | None]:
    """What the innermost frame is doing at its current instruction; and the callee when the
    frame's globals decided it (None otherwise: the code and instruction alone did)."""
    callee = _callees(frame.f_code).get(frame.f_lasti)
    if callee is None:
        return "python", None
    if callee is _OPERATOR or callee is _UNKNOWN:
        return "call", None
    if callee.name in SYNC_CALLS:
        return ("sync" if cuda else "torch"), None
    torch_call = _resolves_to_torch(frame, callee)
    if torch_call is None:  # (a local's method: known from the code alone)
        return "call", None
    return ("torch" if torch_call else "python"), callee


class Key(NamedTuple):
    location: str
    function: str
    via: str
    kind: HostKind
    # Charged to a library's own line: no line of the user's code below the training loop
    # (a framework's loop: Lightning's, HF Trainer's), so nothing the script could edit.
    library: bool = False


class Sample(NamedTuple):
    key: Key
    loop_line: str | None


# A step no sample landed in (most steps, at 50 Hz): its samples and loop lines, shared.
_NO_SAMPLES: Mapping[Key, float] = MappingProxyType({})
_NO_LINES: Mapping[str, float] = MappingProxyType({})


class _Walk(NamedTuple):
    user: FrameType | None  # innermost frame of the user's code
    library: FrameType | None  # innermost library frame below it
    data: bool  # torch.utils.data below it: the DataLoader
    sync: bool  # torch's printing or a synchronize() below it
    compile: bool  # torch.compile's own code below it: a guard, Dynamo, Inductor
    loop_line: str | None  # the training loop's current line


def _walk(frame: FrameType, loop_code: CodeType | None) -> _Walk:
    """The stack from the innermost frame out to the training loop's. It stops there: above
    the loop every sample shares the same lines, so a loop that is a library's (HF Trainer's
    inner loop, Lightning's) charges its samples to that library's lines rather than all to
    the script's one `trainer.train()`."""
    user = library = None
    data = sync = compiling = False
    f: FrameType | None = frame
    while f is not None:
        code = f.f_code
        role = code_role(code)
        # The DataLoader anywhere below the loop: its own code, or the Dataset's and
        # collate_fn's it calls on this thread (num_workers=0), is the wait for data that
        # GD201 prices; as host-only work too, the same ms were priced twice (81% + 76% of
        # one step).
        data = data or (role == "torch" and _DATA_DIR in code.co_filename)
        if user is None:
            if role == "user":
                user = f
            elif role == "library":
                library = library or f
            elif role == "torch":
                sync = sync or code.co_filename.endswith(_SYNC_FILES) or \
                    code.co_name == "synchronize"
                compiling = compiling or code.co_name in _DYNAMO_GUARDS or \
                    code.co_filename.endswith(_COMPILING_FILE)
        if code is loop_code:
            return _Walk(user, library, data, sync, compiling,
                         _location(code.co_filename, f.f_lineno))
        f = f.f_back
    return _Walk(user, library, data, sync, compiling, None)


def classify(frame: FrameType, loop_code: CodeType | None, cuda: bool) -> Sample:
    """One stack: the user's line it is charged to, and what the thread was doing there."""
    return _classify(frame, loop_code, cuda)[0]


def _classify(frame: FrameType, loop_code: CodeType | None, cuda: bool
              ) -> tuple[Sample, Callee | None]:
    """classify(), and the callee whose kind the innermost frame's globals decided (None:
    the frames' code and instructions alone decided the sample)."""
    walk = _walk(frame, loop_code)
    innermost = code_role(frame.f_code)
    kind: HostKind
    callee = None
    if walk.data:
        kind = "data"
    elif walk.sync:
        kind = "sync" if cuda else "torch"
    elif walk.compile:
        kind = "compile"
    elif innermost in ("gpudiag", "torch"):
        kind = innermost
    else:
        kind, callee = _call_kind(frame, cuda)
    charged = walk.user or walk.library or frame
    via = "" if walk.user is None or walk.library is None else \
        _location(walk.library.f_code.co_filename, walk.library.f_lineno)
    return Sample(Key(_location(charged.f_code.co_filename, charged.f_lineno),
                      charged.f_code.co_name, via, kind,
                      library=walk.user is None and walk.library is not None),
                  walk.loop_line), callee


MAX_CLASSIFIED = 4_096  # stacks remembered by a Classifier; past this it starts again


class _Known(NamedTuple):
    codes: tuple[CodeType, ...]  # held, so that no other code object takes their ids
    sample: Sample
    # The callee the innermost frame's globals resolve, and the sample as torch's and as not.
    by_globals: tuple[Callee, Sample, Sample] | None


class Classifier:
    """classify(), remembered by stack: a training loop's stacks repeat, and classifying one
    (roles, display paths, callee lookups) costs several times reading it (in the signal
    handler at 50 Hz on a 2-core VM, ~22 us against ~6: benchmarks/host_sampler.py
    --handler). A stack is the frames from the innermost out to the training loop's, each as
    its code's id and its current instruction (f_lasti): all that classify() reads of a
    frame but its globals.
    - a frame's line is a function of its code and instruction, but where a trace function
      is set on it (a debugger's jump moves its line; on 3.10 the line is the tracer's): such
      a stack is classified afresh;
    - the code objects of the stacks remembered are held, so an id in a stack is the same
      code's while the stack is;
    - a name the innermost frame calls through its globals (`model(x)`, `helper(x)` at a
      module-level loop's line) is resolved again at every sample: a global rebound to other
      code (`helper = torch.abs`, later `abs`) changes what the same instruction calls;
    - a file's display path is the one it had when its stack was first seen (one line, one
      name, if the script later changes its working directory);
    - at most MAX_CLASSIFIED stacks are kept (a script whose stacks never repeat)."""

    def __init__(self, loop_code: CodeType | None, cuda: bool) -> None:
        self.loop_code, self.cuda = loop_code, cuda
        self.known: dict[tuple[int, ...], _Known] = {}

    def __call__(self, frame: FrameType) -> Sample:
        loop_code = self.loop_code
        stack_key: list[int] = []
        f: FrameType | None = frame
        while f is not None:
            code = f.f_code
            if f.f_trace is not None:
                return classify(frame, loop_code, self.cuda)
            stack_key.append(id(code))
            stack_key.append(f.f_lasti)
            if code is loop_code:
                break
            f = f.f_back
        key = tuple(stack_key)
        known = self.known.get(key)
        if known is None:
            known = self._learn(key, frame)
        if known.by_globals is None:
            return known.sample
        callee, torch_sample, other_sample = known.by_globals
        return torch_sample if _resolves_to_torch(frame, callee) else other_sample

    def _learn(self, key: tuple[int, ...], frame: FrameType) -> _Known:
        sample, callee = _classify(frame, self.loop_code, self.cuda)
        codes = []
        f: FrameType | None = frame
        while f is not None:
            codes.append(f.f_code)
            if f.f_code is self.loop_code:
                break
            f = f.f_back
        by_globals = None
        if callee is not None:
            torch_sample, other_sample = (sample._replace(key=sample.key._replace(kind=kind))
                                          for kind in ("torch", "python"))
            by_globals = (callee, torch_sample, other_sample)
        if len(self.known) >= MAX_CLASSIFIED:
            self.known.clear()
        known = self.known[key] = _Known(tuple(codes), sample, by_globals)
        return known


def _location(filename: str, line: int | None) -> str:
    path = display_path(filename)
    _FILES.setdefault(path, filename)
    return f"{path}:{line or 0}"


_FILES: dict[str, str] = {}  # display path -> the file, for the source text of named lines


def loop_frame(before: Sequence[FrameType], now: FrameType | None) -> FrameType | None:
    """The training loop's frame: the innermost frame, not torch's or gpudiag's, that is on
    the stack at two step boundaries (a wrapper's `step()` is a new frame each time; the loop
    that calls it is not). Works for a plain loop, HF Trainer's inner loop, Lightning's."""
    held = {id(f) for f in before}
    f = now
    while f is not None:
        if id(f) in held and code_role(f.f_code) in ("user", "library"):
            return f
        f = f.f_back
    return None


def stack(frame: FrameType | None) -> list[FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


Clock = Literal["auto", "signal", "thread"]


class HostSampler:
    """Samples one thread's stack until stopped; `marks` are the recorder's step marks
    (perf_counter seconds: the start, then each step's end), read, never written, here.
    `clock` "auto" takes the samples by a timer signal where the thread can get one, else by
    a thread; "signal" or "thread" insists (tests)."""

    def __init__(self, marks: list[float], *, thread_id: int, loop_code: CodeType | None,
                 cuda: bool, warmup: int, skip: Container[int], max_steps: int,
                 period_s: float = PERIOD_S, clock: Clock = "auto") -> None:
        self.marks, self.thread_id, self.loop_code, self.cuda = marks, thread_id, loop_code, cuda
        self.warmup, self.skip, self.max_steps, self.period_s = warmup, skip, max_steps, period_s
        self.clock = clock
        self.classifier = Classifier(loop_code, cuda)
        self.result = HostSamples(period_ms=period_s * 1e3)
        self.timer: threadtimer.ThreadTimer | None = None
        self.timer_start = 0.0
        self.ticks = 0  # timer periods accounted for by the samples so far
        self.in_handler = False
        self.dynamo_kept_out = False
        self.open_step = len(marks) - 1
        self.unfiled = self.open_step  # the first step not filed yet
        self.current: dict[Key, float] = defaultdict(float)
        self.current_loop: dict[str, float] = defaultdict(float)
        self.steady: dict[Key, float] = defaultdict(float)
        self.steady_loop: dict[str, float] = defaultdict(float)
        # Ended steps that samples landed in, not filed yet: (step, samples, loop lines).
        self.sampled: deque[tuple[int, dict[Key, float], dict[str, float]]] = deque()
        self.walls: list[float | None] = []  # ms of each ended step (None: a skipped one)
        self.last_skipped = -1  # the last step whose wall is None
        self.usual: float | None = None  # the median step around the last one filed ...
        self.usual_at: int | None = None  # ... taken at this step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpudiag-host-sampler",
                                        daemon=True)

    def start(self) -> None:
        """Start sampling, from the thread sampled."""
        reason = self._start_timer() if self.clock != "thread" else "asked for a thread"
        if reason is None:
            self.result.clock = "signal"
            return
        if self.clock == "signal":
            raise OSError(f"no timer signal: {reason}")
        self.result.clock, self.result.clock_note = "thread", reason
        self._thread.start()

    def _start_timer(self) -> str | None:
        if threading.get_ident() != self.thread_id:
            return "started from another thread than the one sampled"
        try:
            self.timer = threadtimer.ThreadTimer(self.period_s, self._on_signal)
            self._keep_dynamo_out()
            self.timer_start = self.timer.start()
        except OSError as exc:
            self.timer = None
            return str(exc)
        return None

    def _on_signal(self, _signum: int, frame: FrameType | None) -> None:
        """A timer signal, in the training thread: one sample standing for every period of
        the timer since the previous (those the thread spent in one C call come at once)."""
        if self.in_handler or frame is None or self.timer is None \
                or threadtimer.in_handling(frame):
            return  # a signal handled inside this handler (or on its way in), or after stop()
        ticks = int((time.perf_counter() - self.timer_start) / self.period_s)
        if ticks <= self.ticks:
            return
        periods, self.ticks = ticks - self.ticks, ticks
        self.in_handler = True
        try:
            if not self.take(periods * self.period_s * 1e3, frame):
                self._stop_timer()
        except Exception as exc:  # the handler runs inside the script: never raise into it
            self._stop_timer()
            self.result.clock_note = f"sampling stopped: {type(exc).__name__}: {exc}"
        finally:
            self.in_handler = False

    def _keep_dynamo_out(self) -> None:
        """Once torch.compile is in use, the handler runs under torch.compiler.disable: while
        the thread runs compiled code Dynamo sees every new frame, the handler's too, and
        would try to compile it (graph breaks counted against the script's)."""
        if self.timer is not None and not self.dynamo_kept_out and \
                "torch._dynamo" in sys.modules:
            self.timer.wrap(torch.compiler.disable)
            self.dynamo_kept_out = True

    def watch(self, now: float) -> None:
        """At a step's end (in the thread sampled): once torch.compile is in use, keep it
        out of the handler; a timer signal never answered (the thread blocks the signal), or
        whose handler the script replaced, hands sampling to a thread."""
        self._keep_dynamo_out()
        if self.timer is None:
            return
        if not threadtimer.handled(self.timer.signum):
            self._hand_to_thread(f"the script replaced the timer signal's handler by step "
                                 f"{len(self.marks) - 1}")
        elif not self.ticks and now - self.timer_start >= UNANSWERED_PERIODS * self.period_s:
            self._hand_to_thread("the timer signal never came")

    def fit(self, step_ms: float, steps: int) -> None:
        """Sample faster where `steps` steps of `step_ms` would get fewer than TARGET_SAMPLES
        (never slower than asked, never faster than MIN_PERIOD_S). Called at the end of
        warm-up, whose samples are not kept: the change falls between two counted steps."""
        wanted = max(MIN_PERIOD_S, step_ms / 1e3 * steps / TARGET_SAMPLES)
        if wanted >= self.period_s:
            return
        self.period_s = wanted
        self.result.period_ms = wanted * 1e3
        if self.timer is not None:
            self.timer.period_s = wanted
            self.ticks = 0
            self.timer_start = self.timer.start()

    def _hand_to_thread(self, why: str) -> None:
        self._stop_timer()
        self.result.clock, self.result.clock_note = "thread", why
        self._thread.start()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None

    def _run(self) -> None:
        previous = next_at = time.perf_counter()
        while True:
            period = self.period_s  # (fit() may shorten it)
            next_at += period
            if self._stop.wait(max(0.0, next_at - time.perf_counter())):
                return
            now = time.perf_counter()
            next_at = max(next_at, now - period)  # late: no burst of catch-up samples
            if not self.take(min(now - previous, MAX_WEIGHT_PERIODS * period) * 1e3):
                return
            previous = now

    def take(self, weight_ms: float, frame: FrameType | None = None) -> bool:
        """One sample of the training thread (its `frame`, else read from here), standing for
        the `weight_ms` before it; False once the run is past the steps sampled."""
        step = len(self.marks) - 1
        if step >= self.max_steps:
            return False
        if frame is None:
            frame = sys._current_frames().get(self.thread_id)
        self._close_steps(step)
        if frame is None or step < self.warmup or step in self.skip:
            return True
        sample = self.classifier(frame)
        del frame
        self.result.samples += 1
        self.current[sample.key] += weight_ms
        if sample.loop_line is not None:
            self.current_loop[sample.loop_line] += weight_ms
        return True

    def _close_steps(self, step: int) -> None:
        """Every step before `step` has ended: a step is filed once the LOOKAHEAD steps after
        it tell whether it was slow, FILE_EVERY steps at a time."""
        # This runs in the training thread at every sample, ~10 steps after the previous one
        # (a 2 ms step at 50 Hz), few of which a sample landed in. Filing steps a few at every
        # sample cost ~5 us a step (cold caches, each time); in a batch, ~1.
        if self.open_step < step:
            if self.current:  # (only the open step can hold samples: it is the one sampled)
                self.sampled.append((self.open_step, self.current, self.current_loop))
                self.current, self.current_loop = defaultdict(float), defaultdict(float)
            self.open_step = step
        if self.unfiled + LOOKAHEAD + FILE_EVERY < step:
            self._file_before(step - LOOKAHEAD)

    def _file_before(self, end: int) -> None:
        """File every ended step before `end` not filed yet, but the warm-up's and those
        skipped (the profiler window's)."""
        sampled, warmup, skip = self.sampled, self.warmup, self.skip
        for step in range(self.unfiled, end):
            held = sampled.popleft() if sampled and sampled[0][0] == step else None
            if step < warmup or step in skip:
                continue
            if held is None:
                self._file(step, _NO_SAMPLES, _NO_LINES)
            else:
                self._file(*held)
        self.unfiled = max(self.unfiled, end)

    def _file(self, step: int, current: Mapping[Key, float], loop: Mapping[str, float]) -> None:
        """A step's samples, to the steady steps' sums or kept apart as a slow step's: slow
        against the median of the steps around it (before and after, warm-up included, the
        profiler window's and the start-up's not), so the first steps are judged too."""
        # This runs in the training thread at every step: each step's wall is read once, and
        # the median around it, which moves slowly, is taken every USUAL_EVERY steps.
        marks, walls, skip = self.marks, self.walls, self.skip
        hi = min(len(marks) - 1, step + LOOKAHEAD + 1)
        while len(walls) < hi:
            k = len(walls)
            if k in skip:
                walls.append(None)
                self.last_skipped = k
            else:
                walls.append((marks[k + 1] - marks[k]) * 1e3)
        if self.usual_at is None or step - self.usual_at >= USUAL_EVERY \
                or hi < step + LOOKAHEAD + 1:
            lo = max(1, step - RECENT_STEPS)
            around = walls[lo:hi]
            if self.last_skipped >= lo:  # (the profiler window's steps, rarely: no None else)
                around = [w for w in around if w is not None]
            self.usual = _median(cast(list[float], around)) if len(around) >= MIN_RECENT \
                else None
            self.usual_at = step
        wall, usual = walls[step], self.usual  # (a step filed is never skipped: a wall)
        assert wall is not None
        slow = usual is not None and wall > max(SLOW_STEP * usual, usual + SLOW_STEP_MIN_EXTRA_MS)
        result = self.result
        if slow:
            if len(result.slow_steps) < MAX_SLOW_STEPS:
                top = sorted(loop.items(), key=lambda kv: -kv[1])[:MAX_STEP_LINES]
                result.slow_steps.append(HostStep(step, round(wall, 3),
                                                  {k: round(v, 3) for k, v in top}))
            return
        result.steady_steps += 1
        result.steady_wall_ms += wall
        if not current:
            return
        for key, ms in current.items():
            full = key not in self.steady and len(self.steady) >= MAX_KEYS
            self.steady[Key(OTHER_LINES, "", "", key.kind) if full else key] += ms
            result.sampled_ms += ms
        for line, ms in loop.items():
            self.steady_loop[line] += ms

    def stop(self) -> HostSamples:
        """Stop sampling; the steps that ended are filed (the one in progress is not a step)."""
        self._stop_timer()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._close_steps(min(len(self.marks) - 1, self.max_steps))
        self._file_before(self.open_step)
        result = self.result
        kinds: dict[str, float] = defaultdict(float)
        for key, ms in self.steady.items():
            kinds[key.kind] += ms
        result.kind_ms = {k: round(v, 3) for k, v in kinds.items()}
        busiest = sorted(self.steady.items(), key=lambda kv: -kv[1])[:MAX_LINES]
        result.lines = [HostLine(k.location, k.function, k.kind, round(ms, 3), k.via,
                                 library=k.library)
                        for k, ms in busiest]
        result.loop_ms = {k: round(v, 3) for k, v in
                          sorted(self.steady_loop.items(), key=lambda kv: -kv[1])}
        if self.loop_code is not None:
            result.loop = _location(self.loop_code.co_filename, self.loop_code.co_firstlineno)
        named = {line.location for line in result.lines} | set(result.loop_ms) | {
            line for step in result.slow_steps for line in step.loop_ms}
        result.text = {loc: text for loc in sorted(named) if (text := _source(loc))}
        return result


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _source(location: str) -> str:
    path, _, line = location.rpartition(":")
    filename = _FILES.get(path)
    if filename is None or not line.isdigit():
        return ""
    return linecache.getline(filename, int(line)).strip()
