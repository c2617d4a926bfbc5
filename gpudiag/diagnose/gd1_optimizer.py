"""The optimizer's implementation: torch.optim's per-tensor step where a fused or foreach one
exists, named at the script's line that builds the optimizer (the knob: `fused=True`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gpudiag.diagnose.ceilings import bandwidth
from gpudiag.diagnose.common import pct
from gpudiag.diagnose.host import step_account
from gpudiag.diagnose.ledger import StepPart
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import OptimizerFacts
from gpudiag.model.results import RunResult, Severity, StageResult

MIN_OPS, INFO_SHARE, WARNING_SHARE, CRITICAL_SHARE = 200, 0.05, 0.10, 0.40
BETTER = {"single-tensor": ("fused", "foreach"), "foreach": ("fused",)}
# The argument that selects an implementation, and what transformers' Trainer calls it
# (TrainingArguments.optim, transformers/training_args.py's OptimizerNames).
ARGUMENT = {"fused": "fused=True", "foreach": "foreach=True"}
TRAINER_OPTIM = {"AdamW": "adamw_torch_fused", "Adam": "adamw_torch_fused"}
# What a fused step still moves per parameter element: Adam/AdamW read the parameter, its
# gradient and both moments and write the parameter and both moments (7 accesses); SGD with
# momentum 5; fp32 (4 bytes), the dtype of the parameters and states torch.optim keeps by
# default. An optimizer not listed is taken as Adam's (the most torch.optim moves).
FP32_BYTES = 4
ACCESSES_PER_ELEMENT = {"SGD": 5, "Adagrad": 5, "RMSprop": 5}
ADAM_ACCESSES = 7
# Every implementation of torch.optim's step still walks the parameters in Python (its
# `_init_group`: each parameter's grad and state read and listed; fused and foreach then group
# the lists by device and dtype): a fused step keeps about one of the single-tensor step's
# operators per tensor on the host. (On a CPU, 800 tensors of 1,072 elements: single-tensor
# AdamW 48.6 ms, fused 11.2 ms a step, ~1.8 operators' worth per tensor kept.)
KEPT_OPS_PER_TENSOR = 1.0

THRESHOLDS = (
    Threshold("min_optimizer_ops_per_step", MIN_OPS,
              "launches (operators on a CPU) per step inside optimizer.step(): below this a "
              "per-tensor step costs a few hundred microseconds at most"),
    Threshold("info_share", INFO_SHARE, "the optimizer's step reported at all"),
    Threshold("warning_share", WARNING_SHARE, "a tenth of the step is worth a one-word change"),
    Threshold("critical_share", CRITICAL_SHARE, "the optimizer is the step's largest part"),
    Threshold("fused_accesses_per_element", ADAM_ACCESSES,
              "parameter, gradient and both moments read, parameter and moments written: what a "
              "fused Adam(W) step still moves per element (SGD, Adagrad, RMSprop: 5)"),
    Threshold("bytes_per_element", FP32_BYTES, "fp32 parameters and optimizer states"),
    Threshold("kept_ops_per_tensor", KEPT_OPS_PER_TENSOR,
              "host operators' worth a fused step still spends per parameter tensor (its "
              "Python walk over the parameters)"),
)


@rule(
    "GD106", "optimizer-implementation", concern="launch",
    summary="The optimizer steps its parameters one tensor at a time where a fused step exists.",
    why=("torch.optim's single-tensor implementation (foreach=False, and the default on a CPU) "
         "runs several small ops per parameter tensor every step: a model of hundreds of "
         "small tensors launches thousands of kernels in optimizer.step(), and the GPU waits "
         "for the host to launch them. The foreach implementation groups tensors; the fused one "
         "(Adam, AdamW, SGD, Adagrad) does a group's whole update in one kernel. PyTorch's "
         "profiler pattern matcher flags the same case (OptimizerSingleTensorPattern)."),
    fix=("Build the optimizer with fused=True (foreach=True where fused is not offered), at the "
         "line that constructs it; transformers' Trainer: TrainingArguments(optim="
         "\"adamw_torch_fused\")."),
    prices=StepPart("torch"),
    thresholds=THRESHOLDS,
    references=("https://pytorch.org/docs/stable/optim.html#algorithms "
                "(foreach and fused implementations)",
                "torch/profiler/_pattern_matcher.py (OptimizerSingleTensorPattern)"),
)
def optimizer_implementation(run: RunResult) -> Iterator[Draft]:
    """A profiled script's optimizer built single-tensor (or foreach where fused exists) whose
    step issues at least 200 launches per step; priced the step's share the optimizer
    held (the host's part of it only while the GPU idles) less what a fused step still costs:
    its memory traffic (every parameter, gradient and moment read or written once) at the
    device's bandwidth, a lower bound of its cost (the share less it: an upper bound of the
    saving), and its host walk over the parameters (KEPT_OPS_PER_TENSOR): an estimate (H200:
    56% priced, 57% measured by --try-fixes, 57-70% by the script's own timer). Where no
    bandwidth is known (a CPU run without a peak stage) the traffic is not subtracted, said
    so."""
    for stage in run.stages_with_evidence():
        found = slow_optimizer(stage)
        if found is None:
            continue
        optimizer, better = found
        ev = stage.evidence
        time = optimizer_time(stage, optimizer)
        if ev is None or time is None:
            continue
        per_tensor = ev.optimizer_ops_per_step / max(optimizer.parameters, 1)
        saving = fused_saving(run, optimizer, time, per_tensor)
        price = saving.estimate
        if price < INFO_SHARE:
            continue
        unit = "kernel launches" if ev.backend == "cuda" else "operator calls"
        where = f" at {optimizer.site}" if optimizer.site else ""
        yield Draft(
            severity=optimizer_severity(price),
            stage=stage.name, location=optimizer.edit_at or optimizer.site,
            title=(f"{optimizer.name}{where} steps its {optimizer.parameters:,} parameter "
                   f"tensors {_how(optimizer)}: {ev.optimizer_ops_per_step:,.0f} {unit} per "
                   f"step; optimizer.step() holds the host {time.host_ms:.1f} ms of each "
                   f"{time.step_ms:.1f} ms step ({time.measured_by}): a faster step saves "
                   f"about {pct(price)}"),
            impact=price,
            evidence={"optimizer": optimizer.name, "implementation": optimizer.implementation,
                      "chosen_by": optimizer.chosen, "parameter_tensors": optimizer.parameters,
                      "parameter_elements": optimizer.numel, "built_at": optimizer.site,
                      "stepped_at": optimizer.step_site,
                      "optimizer_ops_per_step": round(ev.optimizer_ops_per_step, 1),
                      "ops_per_tensor": round(per_tensor, 1),
                      "optimizer_host_ms_per_step": round(time.host_ms, 2),
                      "step_ms": round(time.step_ms, 2), "measured_by": time.measured_by,
                      "profiled_optimizer_host_ms_per_step":
                          round(ev.optimizer_host_ms_per_step, 2),
                      "optimizer_device_ms_per_step":
                          round(ev.device_ms_by_kind.get("optimizer", 0.0), 2),
                      "fused_traffic_ms": round(saving.traffic_ms, 3),
                      "fused_host_ms": round(saving.kept_host_ms, 2),
                      "price": saving.said,
                      "better": better},
            fix=_fix(optimizer, better))


@dataclass
class FusedSaving:
    """What a fused step saves of the optimizer's share: at most `bound` (the share less its
    memory traffic), about `estimate` (less its host walk over the parameters too)."""

    bound: float
    estimate: float
    traffic_ms: float
    kept_host_ms: float
    said: str  # the price model, for the finding's evidence


def fused_saving(run: RunResult, optimizer: OptimizerFacts, time: OptimizerTime,
                 ops_per_tensor: float) -> FusedSaving:
    """The saving of `optimizer`'s fused step: its share of the step (`time`) less what the
    fused step still costs, its traffic and its host walk (a share of the host time as
    KEPT_OPS_PER_TENSOR is of the `ops_per_tensor` the step issues now)."""
    traffic_ms, how = fused_floor_ms(run, optimizer)
    bound = max(0.0, time.price - traffic_ms / time.step_ms)
    kept_host_ms = time.host_ms * min(1.0, KEPT_OPS_PER_TENSOR / max(ops_per_tensor, 1e-9))
    estimate = max(0.0, bound - min(kept_host_ms / time.step_ms, time.host_price))
    return FusedSaving(bound, estimate, traffic_ms, kept_host_ms, (
        f"estimate: the optimizer's share of the step less {how} and its host walk over the "
        f"parameters ({kept_host_ms:.1f} ms: {KEPT_OPS_PER_TENSOR:g} of the {ops_per_tensor:.0f} "
        f"operators per tensor); at most {pct(bound)}; --try-fixes measures it"))


def fused_floor_ms(run: RunResult, optimizer: OptimizerFacts) -> tuple[float, str]:
    """(ms, how it was priced): the least a fused step of `optimizer` still costs a step, its
    memory traffic at the device's bandwidth (measured by the peak stage, else the
    datasheet); 0 where no bandwidth is known (a CPU run without a peak stage)."""
    gbps, source = bandwidth(run)
    if not gbps:
        return 0.0, ("nothing for a fused step's own cost (no memory bandwidth known: it still "
                     "reads and writes every parameter, gradient and moment)")
    moved = optimizer.numel * ACCESSES_PER_ELEMENT.get(optimizer.name, ADAM_ACCESSES) \
        * FP32_BYTES
    ms = moved / (gbps * 1e9) * 1e3
    return ms, (f"a fused step's memory traffic ({moved / 1e6:,.0f} MB at {gbps:,.0f} GB/s, "
                f"{source}: {ms:.2f} ms, the least it still costs)")


def slow_optimizer(stage: StageResult) -> tuple[OptimizerFacts, str] | None:
    """The stage's optimizer whose step issues the window's optimizer work one tensor at a time
    (or grouped, where fused exists), and the implementation to use instead."""
    ev, script = stage.evidence, stage.facts.script
    if ev is None or script is None or ev.optimizer_ops_per_step < MIN_OPS:
        return None
    candidates = []
    for optimizer in script.optimizers:
        offered = [b for b in BETTER.get(optimizer.implementation, ())
                   if getattr(optimizer, f"{b}_supported")]
        if offered and optimizer.steps:
            candidates.append((optimizer, offered[0]))
    return max(candidates, key=lambda c: c[0].parameters, default=None)


@dataclass
class OptimizerTime:
    """The optimizer's step in one step: its host time, where it was measured, and what a
    faster implementation would save (a share of the step)."""

    host_ms: float
    step_ms: float
    measured_by: str  # "host samples" or "the profiler window"
    price: float  # what a faster implementation saves, as a share of the step (estimated)
    host_price: float = 0.0  # of which the host's part (on a GPU: only while it idles)


def optimizer_time(stage: StageResult, optimizer: OptimizerFacts | None = None,
                   ) -> OptimizerTime | None:
    """What `stage`'s optimizer step costs. The host samples of the un-instrumented steps give
    the line that calls step() (when it is no more than the step: not `trainer.train()`); the
    profiler window gives the optimizer's own ranges, slowed by the profiler like the rest of
    its step. The lesser share is taken. On a GPU, host time counts only while the GPU idles,
    and the optimizer's kernels add their time."""
    ev = stage.evidence
    if ev is None or ev.step_ms <= 0:
        return None
    host = min(1.0, ev.optimizer_host_ms_per_step / ev.step_ms)
    measured = OptimizerTime(ev.optimizer_host_ms_per_step, ev.step_ms, "the profiler window",
                             host)
    account = step_account(stage)
    line = next((x for x in account.lines if x.location == optimizer.step_site), None) \
        if account is not None and optimizer is not None else None
    if account is not None and line is not None and line.share < host:
        measured = OptimizerTime(line.ms_per_step, account.step_ms, "host samples", line.share)
    measured.host_price = measured.price
    if ev.backend == "cuda":
        pace = ev.window_step_ms or ev.step_ms
        device = ev.device_ms_by_kind.get("optimizer", 0.0) / pace
        measured.host_price = min(measured.price, ev.idle_fraction or 0.0)
        measured.price = min(1.0, measured.host_price + device)
    return measured


def optimizer_price(run: RunResult, stage: StageResult) -> float:
    """GD106's price of `stage`'s optimizer (0 where it names none): what GD102 and GD104
    defer to, so they never outrank it."""
    found = slow_optimizer(stage)
    time = optimizer_time(stage, found[0] if found else None)
    if found is None or time is None or stage.evidence is None:
        return time.price if time is not None else 0.0
    per_tensor = stage.evidence.optimizer_ops_per_step / max(found[0].parameters, 1)
    return fused_saving(run, found[0], time, per_tensor).estimate


def optimizer_severity(price: float) -> Severity:
    return severity_for(price, warning=WARNING_SHARE, critical=CRITICAL_SHARE)


def _how(optimizer: OptimizerFacts) -> str:
    chosen = "" if optimizer.chosen == "default" else f", {optimizer.chosen}"
    if optimizer.implementation == "single-tensor":
        return (f"one at a time (the single-tensor step{chosen}"
                + (", torch's default for tensors on a CPU)" if not chosen else ")"))
    return f"in foreach groups{chosen}"


def _fix(optimizer: OptimizerFacts, better: str) -> str:
    argument = ARGUMENT[better]
    if optimizer.framework == "transformers" and optimizer.name in TRAINER_OPTIM \
            and better == "fused":
        at = f" at {optimizer.edit_at}" if optimizer.edit_at else ""
        return (f"The Trainer builds {optimizer.name} from its arguments: "
                f"TrainingArguments(..., optim=\"{TRAINER_OPTIM[optimizer.name]}\"){at}.")
    at = f" at {optimizer.site}" if optimizer.site else ""
    drop = (f" and drop {optimizer.chosen}" if optimizer.chosen not in ("default", argument)
            else "")
    what = ("one kernel per parameter group does the whole update" if better == "fused" else
            "one launch per group of tensors replaces one per tensor")
    return (f"Build it with {optimizer.name}(..., {argument}){at}{drop}: {what}. "
            "`gpudiag profile --try-fixes` measures it on this script.")
