"""Turn a profiler trace (Chrome trace JSON events) into per-step evidence. Pure: tested on
recorded traces without a GPU.

Attribution, in order of preference:
- host events (operators, CUDA runtime calls) inside a source annotation belong to its line;
- backward work belongs to the line of the forward operator that created its autograd node
  (matched by the autograd sequence number the profiler records on both);
- device events (kernels, copies, memsets) belong to the runtime call that launched them
  (matched by the CUDA correlation id).
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from gpudiag.measure.evidence import shapes
from gpudiag.measure.evidence.annotation import ANNOTATION_PREFIX, in_loop, parse_annotation
from gpudiag.measure.evidence.kinds import kernel_kind, op_kind
from gpudiag.model.results import MEMORY_BOUND_KINDS, Evidence, LineCount, SourceLine

SHORT_KERNEL_US = 10.0  # kernels shorter than this are dominated by launch overhead
TOP_N = 10
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch"}
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"}
# Operators that force a device-to-host synchronisation on CUDA: counted as syncs on the CPU,
# where there is no runtime to observe.
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero"}
EMPTY_CACHE_CALLS = {"cudaFree"}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
              "aten::_addmm_activation", "aten::_scaled_mm", "aten::convolution",
              "aten::_convolution", "aten::cudnn_convolution"}
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
STEP_RANGE = "gpudiag.step"  # the capture names each profiled step so
MICROSTEP_RANGE = "gpudiag.microstep"  # a gradient-accumulation micro-step, where marked
# A DataLoader's own work on the training thread: each batch (torch's range around __next__)
# and starting a pass (gpudiag's, around __iter__): its seeds are CPU tensors read with .item().
LOADER_RANGES = ("enumerate(DataLoader)#", "gpudiag.loader_iter")
# Collectives: c10d ops on the calling thread (one per DDP bucket), and the process group's
# own work ranges on its thread (gloo/ucc/mpi on CPUs; NCCL's work is its kernels).
# FSDP2 issues the base variants (c10d::_allgather_base_, _reduce_scatter_base_) and, compiled,
# functional collectives (_c10d_functional::all_gather_into_tensor).
COLLECTIVE_OP = re.compile(r"^(c10d|_c10d_functional)::_?(?P<kind>all_?reduce|all_?gather|"
                           r"reduce_scatter|broadcast|all_to_all)")
COLLECTIVE_WORK = re.compile(r"^(gloo|ucc|mpi):")
# Gradient reduction alone (DDP also broadcasts buffers in some forwards: not a reduction).
ALLREDUCE_OP = re.compile(r"^c10d::all_?reduce")
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_GRAPH_PREFIX = re.compile(r"^graph_\d+_")  # Inductor's C++ kernels' profiled names
OPTIMIZER_RANGE = "Optimizer.step#"  # torch.optim's record_function around each step()
# FSDP2's record_function around each phase of each unit, "FSDP::pre_backward (layers.0)":
# torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py.
FSDP_RANGE = "FSDP::"
# Operators that do no work of their own (views, allocations, conjugation flags): their
# enclosing operator is the one that computes.
NO_WORK_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose",
    "aten::expand", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::select",
    "aten::slice", "aten::alias", "aten::detach", "aten::resolve_conj", "aten::resolve_neg",
    "aten::lift_fresh", "aten::split", "aten::chunk", "aten::unbind", "aten::narrow",
    "aten::expand_as", "aten::view_as", "aten::flatten", "aten::contiguous", "aten::to",
    "aten::_to_copy", "aten::set_", "aten::zeros_like", "aten::ones_like", "aten::zeros",
    "aten::ones", "aten::full", "aten::new_empty", "aten::new_empty_strided",
    "aten::new_zeros", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"})
_MEMCPY = re.compile(r"Memcpy (?P<kind>[HDP]to[HDP])(?: \((?P<src>\w+) -> (?P<dst>\w+)\))?")


@dataclass
class _Line:
    location: str
    function: str
    ops: int = 0
    kernels: int = 0
    syncs: int = 0
    memcpys: int = 0
    htod_memcpys: int = 0  # of which host-to-device: a blocking one syncs, reads nothing
    direct_calls: int = 0
    calls: int = 0
    host_us: float = 0.0
    device_us: float = 0.0
    kernel_us: list[float] = field(default_factory=list)
    vias: Counter[str] = field(default_factory=Counter)  # library frame -> calls through it
    sync_vias: Counter[str] = field(default_factory=Counter)  # library frame -> syncs there
    kind_us: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    flops: float = 0.0
    bytes: float = 0.0
    memory_bytes: float = 0.0  # of its memory-bound operators
    fused_memory_bytes: float = 0.0  # of those, what they would move fused (_count_fusion)
    fp32_kind_us: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))


def _end(e: dict[str, Any]) -> float:
    """An event's end; its start and end are read once, when the window is selected."""
    end: float = e["_end"]
    return end


# Where a host event sits: the innermost range of each kind that holds it on its thread, stored
# on the event under the kind's key. `_line`: a source annotation; `_optimizer`: an optimizer
# step; `_loader`: a DataLoader's range; `_backward`: an autograd node's evaluation; `_op`
# and `_parent`: an operator (what launched a runtime call; what an operator runs inside);
# `_matmul`: a matmul operator.
_OP_KEYS = ("_line", "_optimizer", "_loader", "_backward", "_parent", "_matmul")
_RUNTIME_KEYS = ("_line", "_optimizer", "_backward", "_matmul", "_op")
# At equal start and end, the range that encloses sorts first: annotations and other ranges
# hold operators, operators hold runtime calls, and flow points sit inside all of them.
_RANGE, _OPERATOR, _RUNTIME, _POINT = range(4)
_EMPTY: dict[str, dict[str, Any]] = {}


def _mark_enclosing(items: list[tuple[float, float, int, int, dict[str, Any],
                                      tuple[str, ...], tuple[str, ...]]]) -> None:
    """One thread's host events in one sweep, in time order: on each, under each key it
    `receives`, the innermost other event holding it that `provides` that key. Items are
    (start, -end, rank, index, event, receives, provides); the stack holds, for every open
    event, the innermost holder of each key as seen from inside it."""
    items.sort()
    stack: list[tuple[float, dict[str, dict[str, Any]]]] = []
    for ts, neg_end, _, _, e, receives, provides in items:
        end = -neg_end
        while stack and stack[-1][0] < ts:
            stack.pop()
        # Ranges nest; a range that overlaps this event without holding it is passed over.
        k = len(stack) - 1
        while k >= 0 and stack[k][0] < end:
            k -= 1
        around = stack[k][1] if k >= 0 else _EMPTY
        for key in receives:
            holder = around.get(key)
            if holder is not None:
                e[key] = holder
        if provides:
            inside = dict(around)
            for key in provides:
                inside[key] = e
            stack.append((end, inside))


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of (start, end) intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def memcpy_kind(name: str) -> str:
    """'HtoD', 'DtoH', 'DtoD'..., with '-pageable' when host memory was not pinned."""
    match = _MEMCPY.search(name)
    if not match:
        return "other"
    kind = match["kind"]
    pageable = "Pageable" in (match["src"] or "", match["dst"] or "")
    return f"{kind}-pageable" if pageable else kind


@dataclass
class _Window:
    """The profiled steps' events, by kind, with each host event marked with its source line
    (`_line`), enclosing backward node (`_backward`) and matmul operator (`_matmul`)."""

    by_cat: dict[str, list[dict[str, Any]]]
    span: tuple[float, float]  # first step's start to last step's end (or the host events')
    annotations: list[dict[str, Any]]
    ops: list[dict[str, Any]]
    runtime: list[dict[str, Any]]
    device: list[dict[str, Any]]
    backward_nodes: list[dict[str, Any]]
    matmuls: list[dict[str, Any]]
    steps: list[tuple[float, float]] = field(default_factory=list)  # each profiled step's span
    optimizer_steps: list[dict[str, Any]] = field(default_factory=list)
    microsteps: list[dict[str, Any]] = field(default_factory=list)  # MICROSTEP_RANGE's ranges
    # Compiled kernels' source lines (Inductor's provenance), for work no annotation encloses.
    kernel_lines: dict[str, list[str]] = field(default_factory=dict)
    lines: dict[str, _Line] = field(default_factory=dict)
    busy: list[tuple[float, float]] = field(default_factory=list)  # device work, merged

    def line_of(self, e: dict[str, Any]) -> dict[str, Any] | None:
        """The source annotation `e` belongs to. Backward work inside `loss.backward()` belongs
        to the forward line that created its autograd node, not to the line that called
        backward."""
        node = e if e["name"].startswith(BACKWARD_PREFIX) else e.get("_backward")
        if node is not None and node.get("_forward_line") is not None:
            return node["_forward_line"]
        return e.get("_line")

    def compiled_lines(self, name: str) -> list[_Line]:
        """The lines a compiled kernel (or, on a CPU, its profiled C++ kernel:
        `graph_0_cpp_fused_...`) was fused from, if known."""
        locations = self.kernel_lines.get(name) or self.kernel_lines.get(
            _GRAPH_PREFIX.sub("", name)) or []
        for location in locations:
            self.lines.setdefault(location, _Line(location, ""))
        return [self.lines[location] for location in locations]

    def stats(self, annotation_event: dict[str, Any]) -> _Line:
        site = parse_annotation(annotation_event["name"])
        assert site is not None
        if site.location not in self.lines:
            self.lines[site.location] = _Line(site.location, site.function)
        return self.lines[site.location]


class _Read(NamedTuple):
    complete: list[dict[str, Any]]  # "X" events, their start and end read
    flows: list[dict[str, Any]]  # forward->backward flow points
    steps: list[dict[str, Any]]  # STEP_RANGE's ranges
    microsteps: list[dict[str, Any]]  # MICROSTEP_RANGE's ranges, on the host


def _read(events: list[dict[str, Any]]) -> _Read:
    """One pass over the events (a window holds hundreds of thousands)."""
    read = _Read([], [], [], [])
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            read.complete.append(e)
            e["ts"] = ts = float(e["ts"])
            e["_end"] = ts + float(e.get("dur", 0.0))
            name = e.get("name")
            if name == STEP_RANGE:
                read.steps.append(e)
            # Kineto copies each host range onto the GPU's timeline too (gpu_user_annotation).
            elif name == MICROSTEP_RANGE and e.get("cat") == "user_annotation":
                read.microsteps.append(e)
        elif ph in _FLOW_PHASES and e.get("cat") == "fwdbwd":
            read.flows.append(e)
    return read


_FLOW_PHASES = frozenset({"s", "f"})


def _select(events: list[dict[str, Any]]) -> _Window:
    """Sort the window's complete events by kind and mark their attribution."""
    read = _read(events)
    first = min((s["ts"] for s in read.steps), default=-math.inf)
    last = max((s["_end"] for s in read.steps), default=math.inf)
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    annotations: list[dict[str, Any]] = []
    for e in read.complete:
        # Host work outside the profiled steps (the window's own final sync) is not the step's.
        cat = e.get("cat", "")
        if cat in DEVICE_CATS or first <= e["ts"] <= last:
            # The annotator's ranges are recorded as operators (source.py: the profiler's fast
            # record function), or as user annotations by earlier versions.
            if cat in _HOST_RANGE_CATS and e["name"].startswith(ANNOTATION_PREFIX):
                annotations.append(e)
            else:
                by_cat[cat].append(e)
    ops, runtime = by_cat["cpu_op"], by_cat["cuda_runtime"] + by_cat["cuda_driver"]
    host = ops + runtime
    span = (first, last) if read.steps else (min((e["ts"] for e in host), default=0.0),
                                             max((e["_end"] for e in host), default=0.0))
    window = _Window(
        by_cat=by_cat, span=span, annotations=annotations, ops=ops, runtime=runtime,
        device=by_cat["kernel"] + by_cat["gpu_memcpy"] + by_cat["gpu_memset"],
        backward_nodes=[o for o in ops if o["name"].startswith(BACKWARD_PREFIX)],
        matmuls=[o for o in ops if o["name"] in MATMUL_OPS],
        steps=sorted((r["ts"], r["_end"]) for r in read.steps),
        optimizer_steps=[a for a in by_cat["user_annotation"]
                         if a["name"].startswith(OPTIMIZER_RANGE)],
        microsteps=read.microsteps)
    window.busy = _merge((d["ts"], d["_end"]) for d in window.device)
    _attribute(window, read.flows)
    return window


def _attribute(window: _Window, flows: list[dict[str, Any]]) -> None:
    """Mark every host event with what holds it (_mark_enclosing), thread by thread, and each
    backward node with its forward line."""
    loaders = [a for a in window.by_cat["user_annotation"]
               if a["name"].startswith(LOADER_RANGES)]
    starts, finishes = _flows(flows)
    by_thread: dict[Any, list[tuple[float, float, int, int, dict[str, Any], tuple[str, ...],
                                    tuple[str, ...]]]] = defaultdict(list)

    def add(items: Iterable[dict[str, Any]], rank: int, receives: tuple[str, ...],
            provides: Callable[[dict[str, Any]], tuple[str, ...]]) -> None:
        for e in items:
            by_thread[e["tid"]].append((e["ts"], -e["_end"], rank, len(by_thread[e["tid"]]), e,
                                        receives, provides(e)))

    add(window.annotations, _RANGE, (), lambda _: ("_line",))
    add(window.optimizer_steps, _RANGE, (), lambda _: ("_optimizer",))
    add(loaders, _RANGE, (), lambda _: ("_loader",))
    add(window.ops, _OPERATOR, _OP_KEYS, _provided_by_operator)
    add(window.runtime, _RUNTIME, _RUNTIME_KEYS, lambda _: ())
    add(starts.values(), _POINT, ("_line",), lambda _: ())
    add(finishes, _POINT, ("_backward",), lambda _: ())
    for items in by_thread.values():
        _mark_enclosing(items)
    _link_backward(starts, finishes, window.ops, window.backward_nodes)


_HOST_RANGE_CATS = frozenset({"cpu_op", "user_annotation"})


def _provided_by_operator(op: dict[str, Any]) -> tuple[str, ...]:
    name = op["name"]
    if name.startswith(BACKWARD_PREFIX):
        return ("_op", "_parent", "_backward")
    if name in MATMUL_OPS:
        return ("_op", "_parent", "_matmul")
    return ("_op", "_parent")


def _flows(flows: list[dict[str, Any]],
           ) -> tuple[dict[Any, dict[str, Any]], list[dict[str, Any]]]:
    """The profiler's forward->backward flow events as points on their threads: each start
    (at the forward operator that made an autograd node) by id, and the finishes (at the
    node's evaluation) whose start is in the trace."""
    starts = {f["id"]: {"ts": float(f["ts"]), "_end": float(f["ts"]), "tid": f["tid"]}
              for f in flows if f["ph"] == "s"}
    finishes = [{"ts": float(f["ts"]), "_end": float(f["ts"]), "tid": f["tid"], "id": f["id"]}
                for f in flows if f["ph"] == "f" and f["id"] in starts]
    return starts, finishes


def _link_backward(starts: dict[Any, dict[str, Any]], finishes: list[dict[str, Any]],
                   ops: list[dict[str, Any]], backward_nodes: list[dict[str, Any]]) -> None:
    """Set `_forward_line` on backward nodes: the annotation around the forward op that created
    the node. The profiler's forward->backward flow events say which op that was, in-place
    writes into views (CopySlices) included; traces without them fall back to the autograd
    sequence number, taking the last forward op that recorded it (the one that made the node).
    """
    for finish in finishes:
        node, start = finish.get("_backward"), starts[finish["id"]]
        if node is not None and start.get("_line") is not None:
            node["_forward_line"] = start["_line"]
    forward_by_seq: dict[Any, dict[str, Any]] = {}
    for o in sorted(ops, key=lambda o: o["ts"]):
        seq = o.get("args", {}).get("Sequence number")
        # Ops running inside a backward node carry its sequence number too; skip them.
        if (seq is not None and "_backward" not in o
                and not o["name"].startswith(BACKWARD_PREFIX)):
            forward_by_seq[seq] = o
    for node in backward_nodes:
        if "_forward_line" in node:
            continue
        forward = forward_by_seq.get(node.get("args", {}).get("Sequence number"))
        if forward is not None and forward.get("_line") is not None:
            node["_forward_line"] = forward["_line"]


def _top_level(ops: list[dict[str, Any]], key: str = "_parent") -> list[dict[str, Any]]:
    """Operators not nested inside another operator (of the kind `key` marks) on their
    thread."""
    return [o for o in ops if key not in o]


def _count_call(line: _Line, annotation_event: dict[str, Any]) -> None:
    site = parse_annotation(annotation_event["name"])
    assert site is not None
    line.calls += 1
    line.direct_calls += int(site.direct)
    line.host_us += float(annotation_event.get("dur", 0.0))
    if site.via:
        line.vias[site.via] += 1  # the line's 'via' is the library frame most calls went through


def _count_host(w: _Window, backend: str) -> tuple[list[dict[str, Any]], int]:
    """Per line: calls, host time, top-level operators (and syncing operators on a CPU, where
    no runtime shows syncs). Returns the top-level operators and those CPU syncs."""
    for a in w.annotations:
        _count_call(w.stats(a), a)
    for node in w.backward_nodes:
        if node.get("_forward_line") is not None:  # unmapped nodes are inside their backward()
            w.stats(node["_forward_line"]).host_us += float(node.get("dur", 0.0))
    top_ops = _top_level(w.ops)
    for o in top_ops:
        owner = w.line_of(o)
        if owner is not None:
            w.stats(owner).ops += 1
    syncs = 0
    if backend != "cuda":
        for o in w.ops:
            # torch.optim's step counters are CPU tensors on any device (unless capturable),
            # and so are a DataLoader's seeds: read with .item(), never a device sync.
            if o["name"] in SYNCING_OPS and "_optimizer" not in o and "_loader" not in o:
                syncs += 1
                owner = w.line_of(o)
                if owner is not None:
                    _count_sync(w, owner)
    return top_ops, syncs


def _count_sync(w: _Window, owner: dict[str, Any]) -> _Line:
    """One sync, charged to its line and to the library line it went through: there a library
    syncs (HF Trainer's NaN check of every step's loss), which the host samples see the
    thread blocked at."""
    line = w.stats(owner)
    line.syncs += 1
    site = parse_annotation(owner["name"])
    if site is not None and site.via:
        line.sync_vias[site.via] += 1
    return line


@dataclass
class _Runtime:
    """CUDA runtime calls: launches, syncs and frees, and each call by correlation id."""

    launches: int = 0
    syncs: int = 0
    sync_us: float = 0.0
    empty_cache: int = 0
    free_us: float = 0.0
    sync_ends: list[float] = field(default_factory=list)
    line_sync_ends: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    by_correlation: dict[Any, dict[str, Any]] = field(default_factory=dict)


def _count_runtime(w: _Window) -> _Runtime:
    counts = _Runtime()
    for r in w.runtime:
        name = r["name"]
        corr = r.get("args", {}).get("correlation")
        if corr is not None:
            counts.by_correlation[corr] = r
        if name in LAUNCH_CALLS:
            counts.launches += 1
        elif name in SYNC_CALLS:
            counts.syncs += 1
            counts.sync_us += float(r.get("dur", 0.0))
            counts.sync_ends.append(_end(r))
            owner = w.line_of(r)
            if owner is not None:
                counts.line_sync_ends[_count_sync(w, owner).location].append(_end(r))
        elif name in EMPTY_CACHE_CALLS:
            counts.empty_cache += 1
            counts.free_us += float(r.get("dur", 0.0))
    return counts


@dataclass
class _Device:
    """Kernels, copies and matmul time, each charged to the line whose call launched it."""

    kernels: int = 0
    short: int = 0
    kernel_us: float = 0.0
    memcpy: Counter[str] = field(default_factory=Counter)
    # Float totals: Counter is typed for int counts, so these are float-valued defaultdicts.
    memcpy_us: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    # "HtoD" / "DtoH" -> bytes
    copy_bytes: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    step_kernel_us: list[float] = field(default_factory=list)  # per profiled step
    matmul_us: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    kernel_time: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    kind_us: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))


def _count_kernel(counts: _Device, kernel: dict[str, Any], launcher: dict[str, Any] | None,
                  owner: dict[str, Any] | None, step: int | None) -> str:
    """Count a kernel; its kind (gpudiag/measure/evidence/kinds.py)."""
    dur = float(kernel.get("dur", 0.0))
    counts.kernels += 1
    counts.kernel_us += dur
    counts.short += dur < SHORT_KERNEL_US
    counts.kernel_time[kernel["name"]] += dur
    kind = kernel_kind(kernel["name"],
                       in_optimizer=launcher is not None and "_optimizer" in launcher)
    counts.kind_us[kind] += dur
    if launcher is not None and "_matmul" in launcher:
        counts.matmul_us[_dtype(owner)] += dur
    if step is not None:
        counts.step_kernel_us[step] += dur
    return kind


def _count_device(w: _Window, runtime: _Runtime, backend: str) -> _Device:
    counts = _Device(step_kernel_us=[0.0] * len(w.steps))
    step_of = _step_finder(w.steps)
    for d in w.device:
        cat, dur = d.get("cat"), float(d.get("dur", 0.0))
        launcher = runtime.by_correlation.get(d.get("args", {}).get("correlation"))
        owner = w.line_of(launcher) if launcher is not None else None
        work = None  # a kernel's kind
        if cat == "kernel":
            work = _count_kernel(counts, d, launcher, owner, step_of(launcher))
            op = launcher.get("_op") if launcher is not None else None
            if op is not None and work in MEMORY_BOUND_KINDS:
                by_kind = op.setdefault("_memory_us", defaultdict(float))
                by_kind[work] += float(d.get("dur", 0.0))
        elif cat == "gpu_memcpy":
            kind = memcpy_kind(d["name"])
            counts.memcpy[kind] += 1
            counts.memcpy_us[kind] += dur
            counts.copy_bytes[kind.split("-")[0]] += float(d.get("args", {}).get("bytes", 0))
        if owner is not None:
            line = w.stats(owner)
            line.device_us += dur
            if work is not None:
                line.kernels += 1
                line.kernel_us.append(dur)
                line.kind_us[work] += dur
            elif cat == "gpu_memcpy":
                line.memcpys += 1
                line.htod_memcpys += kind.startswith("HtoD")
        elif work is not None:
            _charge_compiled(w.compiled_lines(d["name"]), dur, work)
    if backend != "cuda":
        _count_operators(w, counts)
    return counts


def _count_operators(w: _Window, counts: _Device) -> None:
    """Without kernels: matmul work is the host time of the outermost matmul operators, and
    each top-level operator's host time is its kind's."""
    for o in _top_level(w.matmuls, "_matmul"):
        counts.matmul_us[_dtype(w.line_of(o))] += float(o.get("dur", 0.0))
    for o in w.ops:
        compiled = w.compiled_lines(o["name"]) if w.kernel_lines else []
        if compiled:  # a compiled C++ kernel, nested in the compiled graph's call
            _charge_compiled(compiled, float(o["dur"]), op_kind(o["name"]))
    for o in _top_level(w.ops):
        kind, dur = op_kind(o["name"], in_optimizer="_optimizer" in o), float(o["dur"])
        counts.kind_us[kind] += dur
        owner = w.line_of(o)
        if owner is not None:
            w.stats(owner).kind_us[kind] += dur


def _working_ops(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operators that do the work: ATen operators with no working operator inside them
    (aten::addmm, not the aten::linear around it; a cast's aten::copy_, not its aten::to)."""
    working = [o for o in ops if o["name"].startswith("aten::") and o["name"] not in NO_WORK_OPS]
    for o in working:
        o["_working"] = True
    for o in working:
        if o["name"] in shapes.CASTS:  # a copy inside an operator is that operator's work
            continue
        parent = o.get("_parent")
        while parent is not None and not parent.get("_has_work"):
            parent["_has_work"] = True
            parent = parent.get("_parent")
    return [o for o in working if not o.get("_has_work")
            and not (o["name"] in shapes.CASTS and _inside_working(o))]


def _inside_working(op: dict[str, Any]) -> bool:
    parent = op.get("_parent")
    while parent is not None:
        if parent.get("_working"):
            return True
        parent = parent.get("_parent")
    return False


def _count_shapes(w: _Window, backend: str) -> None:
    """Per line: FLOPs and bytes of its working operators (gpudiag/measure/evidence/shapes.py),
    what its memory-bound ones would move fused (_count_fusion), and the memory-bound time of
    those that computed in fp32 (casts aside). On a GPU that time is the kernels each operator
    launched; on a CPU, the operator's own."""
    working = _working_ops(w.ops)
    for o in working:  # read once: _count_fusion reads them too, lines or not
        o["_moved"] = shapes.bytes_moved(o)
        o["_kind"] = op_kind(o["name"], in_optimizer="_optimizer" in o)
    for o in working:
        owner = w.line_of(o)
        if owner is None:
            continue
        line = w.stats(owner)
        moved, kind = o["_moved"], o["_kind"]
        line.flops += shapes.flops(o)
        line.bytes += moved
        if kind in MEMORY_BOUND_KINDS:
            line.memory_bytes += moved
        if backend != "cuda" and kind in MEMORY_BOUND_KINDS and _fp32_island(o):
            line.fp32_kind_us[_island_kind(o, kind)] += float(o.get("dur", 0.0))
    _count_fusion(w, working)
    if backend != "cuda":
        return
    for o in w.ops:
        owner = w.line_of(o) if o.get("_memory_us") else None
        if owner is not None and _fp32_island(o):
            fp32 = w.stats(owner).fp32_kind_us
            for kind, us in o["_memory_us"].items():
                fp32[_island_kind(o, kind)] += us


def _count_fusion(w: _Window, working: list[dict[str, Any]]) -> None:
    """What each line's memory-bound operators would move fused, as a compiler fuses them: a
    run of consecutive memory-bound operators on one thread, in one pass of one step (no
    matmul, attention, collective or optimizer step between them; forward and backward
    compiled apart) becomes one kernel that reads its inputs and writes its output once,
    modelled as moving the run's largest operator's bytes; each operator's share of that is in
    proportion to its own bytes (`_moved` and `_kind`: _count_shapes read them)."""
    run: list[tuple[dict[str, Any], float]] = []

    def close() -> None:
        total = sum(moved for _, moved in run)
        fused = max((moved for _, moved in run), default=0.0)
        for o, moved in run:
            owner = w.line_of(o)
            if owner is not None and total > 0:
                w.stats(owner).fused_memory_bytes += moved * fused / total
        run.clear()

    step_of = _step_finder(w.steps) if w.steps else lambda _: None
    where: tuple[Any, ...] | None = None
    for o in sorted(working, key=lambda o: (o["tid"], o["ts"])):
        memory = o["_kind"] in MEMORY_BOUND_KINDS
        here = (o["tid"], step_of(o), o.get("_backward") is not None)
        if here != where or not memory:
            close()
            where = here
        if memory:
            run.append((o, o["_moved"]))
    close()


def _island_kind(op: dict[str, Any], kind: str) -> str:
    return "cast" if op["name"] in shapes.CASTS else kind


def _fp32_island(op: dict[str, Any]) -> bool:
    """An operator computing in fp32 that mixed precision could have run in 16 bits, or a
    cast into fp32; not a cast out of it (autocast's casts of fp32 weights are those), not
    the accumulation of an fp32 parameter's gradient."""
    node = op.get("_backward")
    if node is not None and "AccumulateGrad" in node["name"]:
        return False
    if op["name"] in shapes.CASTS:  # into fp32: an island's way in (autocast's own included)
        return shapes.upcast(op)
    return shapes.compute_dtype(op) == "fp32"


def _charge_compiled(lines: list[_Line], dur: float, kind: str) -> None:
    """A fused kernel's time, split evenly between the lines whose operators it fused."""
    for line in lines:
        line.kernels += 1
        line.device_us += dur / len(lines)
        line.kernel_us.append(dur / len(lines))
        line.kind_us[kind] += dur / len(lines)


def _step_finder(steps: list[tuple[float, float]],
                 ) -> Callable[[dict[str, Any] | None], int | None]:
    """The index of the step range (sorted, disjoint) holding a host event's start, or None."""
    starts = [a for a, _ in steps]

    def find(event: dict[str, Any] | None) -> int | None:
        if event is None:
            return None
        t = float(event["ts"])
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t <= steps[i][1] else None

    return find


def _line_counts(w: _Window, runtime: _Runtime, per: float) -> list[LineCount]:
    """Every attributed line's counts per step, by location."""
    return sorted(
        (LineCount(location=line.location, function=line.function, ops=line.ops * per,
                   kernels=line.kernels * per, syncs=line.syncs * per,
                   sync_vias={via: n * per for via, n in sorted(line.sync_vias.items())},
                   copies=line.memcpys * per, device_ms=line.device_us * per / 1e3,
                   sync_idle_ms=_idle_after(runtime.line_sync_ends[line.location],
                                            w.busy) * per / 1e3,
                   kind_ms={k: round(v * per / 1e3, 4) for k, v in sorted(line.kind_us.items())
                            if v > 0},
                   flops=line.flops * per, bytes=line.bytes * per,
                   memory_bytes=line.memory_bytes * per,
                   fused_memory_bytes=line.fused_memory_bytes * per,
                   fp32_ms_by_kind={k: round(v * per / 1e3, 4)
                                    for k, v in sorted(line.fp32_kind_us.items()) if v > 0})
         for line in w.lines.values()),
        key=lambda c: c.location)


def _source_lines(w: _Window, runtime: _Runtime, per: float, step_ms: float,
                  roots: tuple[Path, ...]) -> list[SourceLine]:
    """The busiest lines (device ops, kernels and copies per step), at most TOP_N; `roots`:
    where their files are looked up first (annotation.in_loop)."""
    step_us = step_ms * 1e3
    found = [
        SourceLine(
            location=line.location, function=line.function, calls_per_step=line.calls * per,
            direct_calls_per_step=line.direct_calls * per, ops_per_step=line.ops * per,
            kernels_per_step=line.kernels * per, syncs_per_step=line.syncs * per,
            memcpys_per_step=line.memcpys * per, htod_copies_per_step=line.htod_memcpys * per,
            host_ms_per_step=line.host_us * per / 1e3,
            device_ms_per_step=line.device_us * per / 1e3,
            median_kernel_us=statistics.median(line.kernel_us) if line.kernel_us else None,
            sync_idle_ms_per_step=_idle_after(runtime.line_sync_ends[line.location],
                                              w.busy) * per / 1e3,
            share_of_step_time=min(1.0, line.host_us * per / step_us) if step_us else 0.0,
            in_loop=in_loop(line.location, roots),
            via=line.vias.most_common(1)[0][0] if line.vias else None)
        for line in w.lines.values()]
    found.sort(key=lambda s: (s.ops_per_step + s.kernels_per_step + s.memcpys_per_step),
               reverse=True)
    return found[:TOP_N]


def analyze(events: list[dict[str, Any]], *, steps: int, step_ms: float, backend: str,
            timed_step_ms: float | None = None,
            kernel_lines: dict[str, list[str]] | None = None,
            roots: tuple[Path, ...] = ()) -> Evidence:
    """Per-step evidence from the trace events of `steps` profiled steps; `kernel_lines`:
    compiled kernels' source lines, for kernels no source annotation launched; `roots`: where
    the profiled process found its files (analysed in another process: its working directory
    and sys.path)."""
    w = _select(events)
    w.kernel_lines = kernel_lines or {}
    top_ops, cpu_syncs = _count_host(w, backend)
    runtime = _count_runtime(w)
    device = _count_device(w, runtime, backend)
    _count_shapes(w, backend)
    busy_ms = _length(w.busy) / 1e3 if w.device else None
    htod = [d for d in w.by_cat["gpu_memcpy"] if memcpy_kind(d["name"]).startswith("HtoD")]
    launched_at = {corr: float(r["ts"]) for corr, r in runtime.by_correlation.items()}
    coll = _collectives(w.microsteps, w.ops, w.by_cat, w.device, backend, w.span, launched_at)
    per = 1.0 / steps
    pace = timed_step_ms or step_ms
    return Evidence(
        steps=steps, step_ms=step_ms, backend=backend,
        kernels_per_step=device.kernels * per, launches_per_step=runtime.launches * per,
        ops_per_step=len(top_ops) * per, syncs_per_step=(runtime.syncs + cpu_syncs) * per,
        memcpy_per_step={k: v * per for k, v in sorted(device.memcpy.items())},
        memcpy_ms_per_step={k: v * per / 1e3 for k, v in sorted(device.memcpy_us.items())},
        htod_overlap_fraction=_overlap_fraction(htod, w.by_cat["kernel"]),
        memset_per_step=len(w.by_cat["gpu_memset"]) * per,
        sync_ms_per_step=runtime.sync_us * per / 1e3,
        sync_idle_ms_per_step=_idle_after(runtime.sync_ends, w.busy) * per / 1e3,
        matmul_ms_by_dtype={k: v * per / 1e3 for k, v in sorted(device.matmul_us.items())},
        device_ms_by_kind={k: v * per / 1e3 for k, v in sorted(device.kind_us.items())},
        device_ms_per_step=device.kernel_us * per / 1e3,
        empty_cache_per_step=runtime.empty_cache * per,
        empty_cache_ms_per_step=runtime.free_us * per / 1e3,
        device_busy_ms_per_step=busy_ms * per if busy_ms is not None else None,
        # Device busy time is what the kernels took; the instrumented window's host overhead
        # would inflate idle time, so idleness is judged against the timed step when known.
        idle_fraction=(max(0.0, 1.0 - busy_ms * per / pace)
                       if busy_ms is not None and pace else None),
        short_kernels_per_step=device.short * per,
        collective_ms_per_step=coll.raw_us * per / 1e3,
        collective_wall_ms_per_step=coll.wall_us * per / 1e3,
        collective_calls_per_step=coll.calls * per,
        collective_ms_by_call=coll.by_call_ms,
        collective_calls_by_kind={k: v * per for k, v in coll.by_kind.items()},
        collective_overlap_fraction=coll.overlap,
        collective_exposed_ms_per_step=(None if coll.exposed_us is None
                                        else coll.exposed_us * per / 1e3),
        compute_busy_ms_per_step=(None if coll.compute_us is None
                                  else coll.compute_us * per / 1e3),
        window_step_ms=coll.window_us * per / 1e3,
        microsteps_per_step=coll.microsteps * per,
        microsteps_with_collectives_per_step=coll.microsteps_reduced * per,
        top_ops_by_count=[{"name": n, "per_step": c * per} for n, c in
                          Counter(o["name"] for o in top_ops).most_common(TOP_N)],
        top_ops_by_time=_top_by_time(device.kernel_time, top_ops, per),
        source_lines=_source_lines(w, runtime, per, step_ms, roots),
        line_counts=_line_counts(w, runtime, per),
        copy_bytes_per_step={k: v * per for k, v in sorted(device.copy_bytes.items())},
        device_ms_by_step=([us / 1e3 for us in device.step_kernel_us] if backend == "cuda"
                           else []),
        window_overhead=step_ms / timed_step_ms if timed_step_ms else None,
        optimizer_host_ms_per_step=_optimizer_us(w) * per / 1e3,
        optimizer_ops_per_step=_optimizer_ops(w, top_ops, backend) * per,
        fsdp_host_ms_per_step={phase: us * per / 1e3 for phase, us in _fsdp_us(w).items()},
    )


def _optimizer_us(w: _Window) -> float:
    """Host time inside optimizer.step() within the profiled steps: the step clock's post-hook
    runs inside the step's range, and closing the window there is gpudiag's, not the step's."""
    spans = _merge((float(a["ts"]), _end(a)) for a in w.optimizer_steps)
    return sum(_length(_clip(spans, step)) for step in w.steps) if w.steps else _length(spans)


def _fsdp_us(w: _Window) -> dict[str, float]:
    """Host time inside FSDP2's ranges within the profiled steps, by phase (one unit's range
    inside another's of the same phase counted once)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a in w.by_cat["user_annotation"]:
        if a["name"].startswith(FSDP_RANGE):
            spans[a["name"].split(" ", 1)[0]].append((float(a["ts"]), _end(a)))
    return {phase: (sum(_length(_clip(_merge(s), step)) for step in w.steps) if w.steps
                    else _length(_merge(s))) for phase, s in sorted(spans.items())}


def _optimizer_ops(w: _Window, top_ops: list[dict[str, Any]], backend: str) -> int:
    """What the optimizer's steps issued: kernel launches on a GPU, operators on a CPU."""
    if backend == "cuda":
        return sum(1 for r in w.runtime if r["name"] in LAUNCH_CALLS and "_optimizer" in r)
    return sum(1 for o in top_ops if "_optimizer" in o)


def _dtype(annotation_event: dict[str, Any] | None) -> str:
    """The matmul dtype the source annotator recorded for the call that issued this work."""
    parsed = parse_annotation(annotation_event["name"]) if annotation_event else None
    return parsed.dtype if parsed and parsed.dtype else "unknown"


def _idle_after(moments: list[float], busy: list[tuple[float, float]]) -> float:
    """Device idle time from each moment to the next device activity (`busy`: the device's
    work, merged; the queue a sync drained stays empty until the host issues more work).
    Moments with the device busy cost nothing."""
    if not moments or not busy:
        return 0.0
    starts = [a for a, _ in busy]
    gaps = []
    for t in moments:
        i = bisect.bisect_right(starts, t)
        if i > 0 and busy[i - 1][1] > t:
            continue  # still busy with earlier work
        if i < len(busy):
            gaps.append((t, busy[i][0]))
    return sum(b - a for a, b in _merge(gaps))  # two syncs in one gap idle it once


@dataclass
class _Collectives:
    calls: int
    by_kind: dict[str, int]  # "all_reduce", "all_gather", "reduce_scatter", ... -> calls
    raw_us: float  # NCCL kernel durations summed (GPU) or gloo work ranges summed (CPU)
    wall_us: float  # their union, clipped to the window
    exposed_us: float | None  # the union's part with no compute beside it (GPU only)
    compute_us: float | None  # union of the non-collective device work (GPU only)
    window_us: float  # the window's length: shares of it never exceed 1
    by_call_ms: list[float]  # each collective's own time, in the order they started
    microsteps: int
    microsteps_reduced: int

    @property
    def overlap(self) -> float | None:
        if self.exposed_us is None or self.wall_us <= 0:
            return None
        return 1.0 - self.exposed_us / self.wall_us


def _collectives(micro: list[dict[str, Any]], ops: list[dict[str, Any]],
                 by_cat: dict[str, list[dict[str, Any]]], device: list[dict[str, Any]],
                 backend: str,
                 host_window: tuple[float, float],
                 launched_at: dict[Any, float]) -> _Collectives:
    """Collective calls and their time, all measured inside one window: raw (summed), wall
    (union), exposed (see _blocking) and the window they are shares of; and how many
    accumulation micro-steps issued any collective (more than one per optimizer step means the
    reduction ran on every micro-step: no_sync missing or wrapping only the backward).

    A collective kernel starts when its bucket is ready and spins until every peer arrives, so
    its raw time includes waiting for slower ranks and can exceed the step; only exposed time
    holds the step back, and it never exceeds the window."""
    calls = [o for o in ops if COLLECTIVE_OP.match(o["name"])]
    reductions = sorted(float(o["ts"]) for o in calls if ALLREDUCE_OP.match(o["name"]))
    if backend == "cuda":
        comm = [k for k in by_cat["kernel"] if "nccl" in k["name"].lower()]
        other = [d for d in device if "nccl" not in d["name"].lower()]
        span = _merge((float(d["ts"]), _end(d)) for d in device)
        device_window = (span[0][0], span[-1][1]) if span else host_window
        window = (min(host_window[0], device_window[0]), max(host_window[1], device_window[1]))
    else:
        comm = [a for a in by_cat["user_annotation"] if COLLECTIVE_WORK.match(a["name"])]
        other, window = [], host_window
    wall = _clip(_merge((float(c["ts"]), _end(c)) for c in comm), window)
    compute = _merge((float(d["ts"]), _end(d)) for d in other)
    exposed = compute_us = None
    if backend == "cuda":
        exposed = _blocking(wall, compute, other, launched_at)
        compute_us = _length(_clip(compute, window))
    reduced = 0
    for m in micro:
        i = bisect.bisect_left(reductions, float(m["ts"]))
        reduced += i < len(reductions) and reductions[i] <= _end(m)
    kinds = Counter(_collective_kind(o["name"]) for o in calls)
    return _Collectives(
        calls=len(calls), by_kind=dict(sorted(kinds.items())),
        raw_us=sum(float(c.get("dur", 0.0)) for c in comm),
        wall_us=_length(wall), exposed_us=exposed, compute_us=compute_us,
        window_us=max(0.0, window[1] - window[0]),
        by_call_ms=[float(c.get("dur", 0.0)) / 1e3
                    for c in sorted(comm, key=lambda c: float(c["ts"]))],
        microsteps=len(micro),
        microsteps_reduced=reduced)


def _collective_kind(name: str) -> str:
    found = COLLECTIVE_OP.match(name)
    kind = found["kind"] if found else "other"
    return {"allreduce": "all_reduce", "allgather": "all_gather"}.get(kind, kind)


def _blocking(comm: list[tuple[float, float]], busy: list[tuple[float, float]],
              other: list[dict[str, Any]], launched_at: dict[Any, float]) -> float:
    """Collective time that held the device's other work back (`busy`: the union of `other`):
    moments a collective ran with no other device work beside it *and* the next other work had
    already been queued by the host (its launch call had happened). A gap the host had not
    filled yet is the host's, not the link's: under the profiler's slower host that distinction
    keeps idle gaps from being blamed on communication. Work whose launch is not in the trace
    counts as queued."""
    starts = sorted((float(d["ts"]), launched_at.get(d.get("args", {}).get("correlation"),
                                                      -math.inf)) for d in other)
    start_times = [t for t, _ in starts]
    total = 0.0
    for lo, hi in _subtract(comm, busy):
        i = bisect.bisect_left(start_times, hi)
        queued = starts[i][1] if i < len(starts) else math.inf  # nothing after: the step's end
        total += max(0.0, hi - max(lo, queued))
    return total


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]],
              ) -> list[tuple[float, float]]:
    """Parts of the sorted, disjoint intervals `a` that no interval of the sorted, disjoint `b`
    covers: one sweep over both."""
    out, j = [], 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        start, k = lo, j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if hi > start:
            out.append((start, hi))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _clip(spans: list[tuple[float, float]], window: tuple[float, float],
          ) -> list[tuple[float, float]]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def _overlap_fraction(copies: list[dict[str, Any]],
                      kernels: list[dict[str, Any]]) -> float | None:
    """Share of the copies' time during which some kernel was running."""
    total = sum(float(c.get("dur", 0.0)) for c in copies)
    if not copies or total <= 0:
        return None
    busy = _merge((float(k["ts"]), _end(k)) for k in kernels)
    starts = [a for a, _ in busy]
    covered = 0.0
    for c in copies:
        start, end = float(c["ts"]), _end(c)
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(busy) and busy[i][0] < end:
            covered += max(0.0, min(end, busy[i][1]) - max(start, busy[i][0]))
            i += 1
    return covered / total


def _most_common(totals: dict[str, float], n: int) -> list[tuple[str, float]]:
    """Counter.most_common for float totals: the n largest, ties in insertion order."""
    return sorted(totals.items(), key=lambda kv: kv[1], reverse=True)[:n]


def _top_by_time(kernel_time: dict[str, float], top_ops: list[dict[str, Any]],
                 per: float) -> list[dict[str, Any]]:
    """Kernels by device time on a GPU; operators by host time where there are no kernels."""
    if kernel_time:
        ranked = _most_common(kernel_time, TOP_N)
    else:
        host: defaultdict[str, float] = defaultdict(float)
        for o in top_ops:
            host[o["name"]] += float(o.get("dur", 0.0))
        ranked = _most_common(host, TOP_N)
    return [{"name": n, "ms_per_step": us * per / 1e3} for n, us in ranked]
