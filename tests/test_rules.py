"""The rule engine: findings on a recorded H100 run, on a real tiny CPU run, and one firing case
plus near misses per rule on hand-built runs."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ladder_config, ladder_run

from gpudiag.diagnose import all_rules, evaluate, find_rule
from gpudiag.measure.runner import RunOutput
from gpudiag.model.facts import (
    CheckpointFacts,
    CompileEvent,
    CompileFacts,
    ConvLayout,
    DdpFacts,
    DebugSetting,
    FsdpFacts,
    FsdpUnits,
    HostLine,
    HostSamples,
    KeptTensors,
    LinkProbe,
    LoaderEpoch,
    LoaderFacts,
    LoaderUse,
    MemoryOwners,
    MemoryTimeline,
    OptimizerFacts,
    OutOfMemory,
    SaveRecord,
    ScriptFacts,
    SingleDevice,
    StageFacts,
    StepTimeline,
)
from gpudiag.model.results import (
    SEVERITY_RANK,
    Env,
    Evidence,
    Finding,
    LineCount,
    MeasuredFix,
    MemoryStats,
    RunResult,
    SourceLine,
    StageResult,
    TelemetrySummary,
)
from gpudiag.model.runfile import load_run
from gpudiag.present.findings import diagnosis_markdown

ROOT = Path(__file__).resolve().parent.parent
H100_RUN = Path(__file__).resolve().parent / "data" / "h100-dgca-run.json"
DGCA = ROOT / "gpudiag" / "measure" / "models" / "dgca.py"
MATERIAL = ("warning", "critical")
CLEAN_STAGES = ("infer", "train", "train-fp16", "full-vectorized")


def dgca_loop_line() -> int:
    """The line of the per-element assignment in dgca.apply_prompt_loop."""
    lines = DGCA.read_text().splitlines()
    hits = [n for n, text in enumerate(lines, 1)
            if re.match(r"\s*inputs_embeds\[i, blocked\[i, j\], :\] = ", text)]
    assert len(hits) == 1, hits
    return hits[0]


def material(findings: list[Finding], stage: str) -> list[Finding]:
    return [f for f in findings if f.stage == stage and f.severity in MATERIAL]


# --- The recorded H100 run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def h100_findings() -> list[Finding]:
    return evaluate(load_run(H100_RUN))


def test_h100_loop_line_is_the_first_finding(h100_findings: list[Finding]) -> None:
    # The recorded run names the line the loop had then; the live tiny ladder checks today's.
    top = h100_findings[0]
    assert (top.id, top.rule, top.stage) == ("GD101", "python-loop-launches", "full-loop")
    assert top.severity in MATERIAL
    # The line the loop had in the recorded commit; the live tiny ladder checks today's line.
    assert top.location is not None and re.fullmatch(r".*gpudiag/models/dgca\.py:\d+",
                                                     top.location)
    assert top.evidence["function"] == "apply_prompt_loop"
    assert top.evidence["counterfactual_stage"] == "full-vectorized"
    assert top.evidence["counterfactual_speedup"] >= 2
    assert top.impact >= 0.5
    # The recorded step times say the same: full-loop against its vectorized twin.
    run = load_run(H100_RUN)
    loop, twin = run.stage("full-loop"), run.stage("full-vectorized")
    assert loop is not None and twin is not None and loop.ms_per_iter and twin.ms_per_iter
    # Priced at the sustained (lower-quartile) pace, robust to host interference.
    assert loop.timing is not None and twin.timing is not None
    assert top.evidence["counterfactual_speedup"] == pytest.approx(
        loop.timing.p25_ms / twin.timing.p25_ms, abs=0.01)
    assert top.impact == pytest.approx(1 - twin.timing.p25_ms / loop.timing.p25_ms)


def test_h100_full_loop_is_gpu_starved_against_train_fp16(h100_findings: list[Finding]) -> None:
    starved = [f for f in h100_findings if f.id == "GD102" and f.stage == "full-loop"]
    assert len(starved) == 1
    f = starved[0]
    assert f.evidence["power_gap_w"] > 50
    assert f.evidence["reference_stage"] == "train-fp16" and "train-fp16" in f.title
    loop = h100_findings[0]
    assert loop.id == "GD101" and f"{loop.location} is why" in f.title  # it names the cause
    # The loop finding, the cause, ranks above it.
    assert h100_findings.index(f) > 0


@pytest.mark.parametrize("stage", [*CLEAN_STAGES])
def test_h100_clean_stages_have_no_material_finding(h100_findings: list[Finding],
                                                    stage: str) -> None:
    assert material(h100_findings, stage) == []


def test_h100_diagnosis_leads_with_the_loop(h100_findings: list[Finding]) -> None:
    run = load_run(H100_RUN)
    run.findings = h100_findings
    text = "\n".join(diagnosis_markdown(run))
    assert text.splitlines()[2].startswith("**full-loop: ")
    assert f"`{h100_findings[0].location}`" in text.splitlines()[2]
    assert "### 1. critical: GD101 python-loop-launches (full-loop)" in text
    # Information-level findings are listed apart, not numbered.
    assert "Observations (information, no action needed):" in text
    assert not re.search(r"### \d+\. info", text)


# --- The real tiny CPU ladder --------------------------------------------------------------


def test_tiny_ladder_finds_the_loop_line(tiny_ladder: RunOutput) -> None:
    findings = evaluate(tiny_ladder.run)
    loops = [f for f in findings if f.id == "GD101" and f.stage == "full-loop"]
    assert len(loops) == 1
    assert loops[0].location is not None
    assert loops[0].location.endswith(f"gpudiag/measure/models/dgca.py:{dgca_loop_line()}")
    # Priced by the vectorized twin where the two measured apart; on a loaded 2-core machine
    # the tiny preset's 4 timed steps a stage often overlap, and the finding says so instead
    # (test_a_twin_that_did_not_measure_apart_prices_nothing holds both branches).
    evidence = loops[0].evidence
    assert evidence.get("counterfactual_stage") == "full-vectorized" or str(
        evidence.get("counterfactual_unsteady", "")).startswith("full-vectorized")
    assert not [f for f in findings if f.id == "GD101" and f.stage != "full-loop"]
    # The runner measures; diagnosis is the command layer's, once, on the finished run.
    assert tiny_ladder.run.findings == []


@pytest.mark.parametrize("stage", [*CLEAN_STAGES])
def test_tiny_ladder_clean_stages_have_no_material_finding(tiny_ladder: RunOutput,
                                                           stage: str) -> None:
    assert tiny_ladder.run.stage(stage) is not None
    assert material(evaluate(tiny_ladder.run), stage) == []


# --- Hand-built runs -----------------------------------------------------------------------

STEP_MS = 100.0


def autocast() -> StageFacts:
    return StageFacts(precision="fp16-autocast")


def limit(code: str, name: str) -> float:
    rule = find_rule(code)
    assert rule is not None
    return rule.limit(name)


def make_run(*stages: StageResult, compute_capability: str | None = "9.0",
             tf32: bool | None = False) -> RunResult:
    env = Env(device="cuda", gpu_name="Test GPU", gpu_count=1,
              compute_capability=compute_capability, tf32_matmul=tf32)
    return ladder_run(*stages, env=env, config=ladder_config(batch_size=8))


def make_stage(name: str, *, ms: float = STEP_MS, evidence: Evidence | None = None,
               facts: StageFacts | None = None, power_w: float | None = None,
               gpm: dict[str, float] | None = None, kernel_active_pct: float | None = None,
               throttle: dict[str, float] | None = None, memory: MemoryStats | None = None,
               data_wait_ms: float | None = None) -> StageResult:
    telemetry = TelemetrySummary(available=True, sample_count=10, power_mean_w=power_w,
                                 kernel_active_pct=kernel_active_pct, gpm=gpm or {},
                                 throttle_share=throttle or {})
    phases = {"data_wait": [data_wait_ms] * 5} if data_wait_ms is not None else {}
    # The ladder's roles: train-fp16 is the reference the other steps are held against.
    return StageResult(name=name, status="ok", iter_ms=[ms] * 5,
                       role="reference" if name == "train-fp16" else "step",
                       samples_per_step=8, telemetry=telemetry, memory=memory,
                       phases_ms=phases, facts=facts or StageFacts(), evidence=evidence)


def make_evidence(*, backend: str = "cuda", **fields: Any) -> Evidence:
    return Evidence(steps=2, step_ms=STEP_MS, backend=backend, **fields)


def loop_source_line(*, calls: float, ops: float, share: float, syncs: float = 0.0,
                     in_loop: bool = True) -> SourceLine:
    return SourceLine(location="model.py:42", function="apply", calls_per_step=calls,
                      direct_calls_per_step=calls, kernels_per_step=ops, ops_per_step=ops,
                      syncs_per_step=syncs, share_of_step_time=share, in_loop=in_loop)


def gd101(*, calls: float | None = None, ops: float | None = None, share: float | None = None,
          in_loop: bool = True) -> RunResult:
    line = loop_source_line(
        calls=calls if calls is not None else limit("GD101", "min_direct_calls_per_step"),
        ops=ops if ops is not None else limit("GD101", "min_device_ops_per_step"),
        share=share if share is not None else limit("GD101", "critical_share"),
        in_loop=in_loop)
    ev = make_evidence(kernels_per_step=line.kernels_per_step + 50, source_lines=[line])
    return make_run(make_stage("full-loop", evidence=ev))


def gd102(*, excess: float, data_wait: float = 0.0) -> RunResult:
    ref_idle = 0.125
    ref = make_stage("train-fp16", ms=50.0, power_w=500.0, facts=autocast(),
                     evidence=make_evidence(idle_fraction=ref_idle))
    starved = make_stage("full-loop", ms=200.0, power_w=300.0, data_wait_ms=data_wait * 200.0,
                         evidence=make_evidence(idle_fraction=ref_idle + excess,
                                                launches_per_step=900.0))
    return make_run(ref, starved)


def gd103(*, syncs: float, idle_share: float = limit("GD103", "critical_idle_share"),
          backend: str = "cuda", direct: float = 1.0, htod: float | None = 0.0) -> RunResult:
    line = SourceLine(location="train.py:30", function="log", calls_per_step=1,
                      direct_calls_per_step=direct, syncs_per_step=syncs,
                      htod_copies_per_step=htod,
                      sync_idle_ms_per_step=idle_share * STEP_MS)
    # The host blocks far longer than the GPU idles: only the idle is priced.
    ev = make_evidence(backend=backend, syncs_per_step=syncs, sync_ms_per_step=80.0,
                       sync_idle_ms_per_step=idle_share * STEP_MS, source_lines=[line])
    return make_run(make_stage("train", evidence=ev))


def gd105(*, share: float, idle: float | None = 0.9) -> RunResult:
    """A profiled script's host samples: one numpy line holding `share` of a 100 ms step, the
    rest torch calls; the window saw the GPU idle `idle` of the step (None: no window)."""
    steps = 50
    numpy_ms = share * STEP_MS * steps
    lines = [HostLine("train.py:20", "augment", "python", numpy_ms, via="numpy/_methods.py:1"),
             HostLine("train.py:30", "<module>", "torch", STEP_MS * steps - numpy_ms)]
    host = HostSamples(period_ms=10.0, samples=500, steady_steps=steps,
                       steady_wall_ms=STEP_MS * steps, sampled_ms=STEP_MS * steps,
                       kind_ms={"python": numpy_ms, "torch": STEP_MS * steps - numpy_ms},
                       lines=lines, text={"train.py:20": "x = np.rot90(x)"})
    facts = StageFacts(script=ScriptFacts(steps=100, warmup=5, timed=30,
                                          step_clock="optimizer.step()", host=host))
    ev = make_evidence(idle_fraction=idle) if idle is not None else None
    return make_run(make_stage("train.py", facts=facts, evidence=ev))


def gd104(*, kernels: float, idle: float = limit("GD104", "min_idle_fraction"),
          short_share: float = limit("GD104", "min_short_kernel_share")) -> RunResult:
    ev = make_evidence(kernels_per_step=kernels, short_kernels_per_step=kernels * short_share,
                       idle_fraction=idle,
                       top_ops_by_count=[{"name": "aten::add", "per_step": kernels}])
    return make_run(make_stage("train", evidence=ev))


def gd106(*, ops: float = 200.0, share: float = 0.5, implementation: str = "single-tensor",
          fused: bool = True, backend: str = "cpu", idle: float | None = None,
          framework: str | None = None, launches: float = 250.0,
          numel: int = 10_800) -> RunResult:
    """A profiled script whose AdamW (built at train.py:12, stepped at train.py:30) over `numel`
    elements in 25 tensors issues `ops` operators (launches on a GPU) per step in
    optimizer.step() (200: AdamW's 8 per tensor), `share` of the step."""
    optimizer = OptimizerFacts(
        name="AdamW", module="torch.optim.adamw", implementation=implementation,  # type: ignore[arg-type]
        chosen="foreach=False", parameters=25, numel=numel, site="train.py:12",
        step_site="train.py:30", fused_supported=fused, steps=60, framework=framework,
        edit_at="train.py:8" if framework else None)
    ev = make_evidence(backend=backend, optimizer_ops_per_step=ops, ops_per_step=launches,
                       launches_per_step=launches, kernels_per_step=launches,
                       short_kernels_per_step=launches, optimizer_host_ms_per_step=share * STEP_MS,
                       idle_fraction=idle)
    facts = StageFacts(script=ScriptFacts(steps=60, warmup=5, timed=30,
                                          step_clock="optimizer.step()", optimizers=[optimizer]))
    return make_run(make_stage("train.py", evidence=ev, facts=facts))


def debug_run(*settings: DebugSetting, device: str = "cuda",
              speedup: float | None = None, remedy: str = "no-debug") -> RunResult:
    """A profiled script of 60 steps (30 timed) with `settings` on; on a CPU run, a host-clock
    stage; with `speedup`, --try-fixes measured `remedy` that much faster."""
    facts = StageFacts(script=ScriptFacts(steps=60, warmup=5, timed=30,
                                          step_clock="optimizer.step()", debug=list(settings)))
    stage = make_stage("train.py", facts=facts)
    run = make_run(stage)
    if device == "cpu":
        stage.timer, run.env.device = "host-clock", "cpu"
    if speedup is not None:
        run.fixes = [MeasuredFix(remedy=remedy, title="off", findings=["GD107"],
                                 before_ms=STEP_MS, after_ms=STEP_MS / speedup, speedup=speedup)]
    return run


def anomaly(*, timed: int = 30) -> DebugSetting:
    return DebugSetting(kind="anomaly-detection", set_by="torch.autograd.set_detect_anomaly(True)",
                        site="train.py:5", steps_on=max(timed, 5), timed_steps_on=timed)


def launch_blocking() -> DebugSetting:
    return DebugSetting(kind="launch-blocking", set_by="CUDA_LAUNCH_BLOCKING=1", steps_on=60,
                        timed_steps_on=30)


def deterministic(*, timed: int = 30) -> DebugSetting:
    return DebugSetting(kind="deterministic-algorithms",
                        set_by="torch.use_deterministic_algorithms(True)", site="train.py:6",
                        steps_on=max(timed, 5), timed_steps_on=timed)


def gd204(*, restart_ms: float = 30.0, passes: int = 15, persistent: bool = False,
          workers: int = 2, first_ms: float = 6.0, end_ms: float = 5.0) -> RunResult:
    """A profiled script whose training loader (built at train.py:7) makes 4-batch passes,
    each starting its workers in `restart_ms`, its first batch in `first_ms` (the usual wait
    is 1 ms) and ending the one before in `end_ms`; steps of 10 ms, a 2 s start-up."""
    steps = passes * 4
    starts = set(range(0, steps, 4))
    extra = restart_ms + first_ms - 1.0 + end_ms
    times = [2000.0] + [10.0 + (extra if i in starts else 0.0) for i in range(1, steps)]
    waits = [1.0 + (extra if i in starts else 0.0) for i in range(steps)]
    epochs = [LoaderEpoch(step=i * 4, start_ms=restart_ms, first_batch_ms=first_ms, batches=4,
                          end_ms=end_ms) for i in range(passes)]
    use = LoaderUse(site="train.py:7", settings=LoaderFacts(
        num_workers=workers, pin_memory=False, persistent_workers=persistent),
        iterated_at="train.py:11", training=True, passes=passes, epochs=epochs)
    timeline = StepTimeline(step_ms=times, steps=steps, total_ms=sum(times),
                            data_wait_ms=waits)
    facts = StageFacts(script=ScriptFacts(steps=steps, warmup=5, timed=30,
                                          step_clock="optimizer.step()", timeline=timeline,
                                          loaders=[use]))
    return make_run(make_stage("train.py", facts=facts))


def gd403(*, per_step: float, steps: int = 60, device: str = "cuda", every: int = 1,
          jump_at: int | None = None, planned: int | None = None,
          total_mib: float = 80_000.0, kept: list[KeptTensors] | None = None) -> RunResult:
    """A run whose memory at each step's end grows `per_step` MiB every `every` steps past
    step 2 (the optimizer's state made at step 1), from 2 GiB; `jump_at`: one step that
    grows 500 MiB once instead (a cache filled once); gpudiag's window at steps 35-37 adds
    300 MiB of its own buffers that stay."""
    series, now = [], 1024.0
    for i in range(steps):
        if i == 1:
            now += 1024.0  # the optimizer's state, made at its first step
        if i > 2 and jump_at is None and i % every == 0:
            now += per_step * every
        if jump_at is not None and i == jump_at:
            now += 500.0
        if i == 36:
            now += 300.0
        series.append(now)
    memory = MemoryTimeline(
        device=device,  # type: ignore[arg-type]
        allocated_mib=series if device == "cuda" else [],
        reserved_mib=[m + 512 for m in series] if device == "cuda" else [],
        peak_mib=[m + 256 for m in series] if device == "cuda" else [],
        resident_mib=[m + 3000 for m in series],
        device_total_mib=total_mib if device == "cuda" else None,
        host_total_mib=total_mib if device == "cpu" else None)
    timeline = StepTimeline(step_ms=[STEP_MS] * steps, steps=steps,
                            total_ms=STEP_MS * steps, window_start=35, window_end=37,
                            planned_steps=planned)
    facts = StageFacts(script=ScriptFacts(steps=steps, warmup=5, timed=30,
                                          step_clock="optimizer.step()", timeline=timeline,
                                          memory=memory, kept=kept or []))
    return make_run(make_stage("train.py", facts=facts))


def gd404(*, oom: bool = True, per_step: float = 0.0, cached: float = 100.0,
          numel: int = 500_000_000) -> RunResult:
    """A script that died of CUDA's out-of-memory error at step 40 asking 2 GiB, 78 GiB held by
    tensors on an 80 GB device, its AdamW stepping `numel` elements; memory grew `per_step`
    a step before; the allocator's cache held `cached` MiB beyond the tensors. `oom` False: it
    died of another error."""
    run = gd403(per_step=per_step, steps=40, total_mib=81_920.0)
    stage = run.stages[0]
    script = stage.facts.script
    assert script is not None and script.memory is not None
    stage.status, stage.error = "error", "the script raised torch.OutOfMemoryError"
    script.optimizers = [OptimizerFacts(name="AdamW", module="torch.optim.adamw",
                                        implementation="foreach", chosen="default",
                                        parameters=100, numel=numel)]
    script.memory.peak_mib = [79_000.0] * 40
    if oom:
        script.memory.oom = OutOfMemory(
            device="cuda", step=40, message="CUDA out of memory. Tried to allocate 2.00 GiB.",
            requested_mib=2048.0, allocated_mib=78_000.0, reserved_mib=78_000.0 + cached,
            device_total_mib=81_920.0, device_free_mib=1200.0, line="train.py:77")
    return run


def gd405(*, mallocs: float = 0.0, retries: int = 0, per_step: float = 0.0,
          frees: float = 0.0) -> RunResult:
    """A CUDA script of 60 steps whose allocator called cudaMalloc `mallocs` times a step past
    its start-up (the window's steps 35-37 make their own), retried `retries` times; memory
    grew `per_step` MiB a step; the script emptied the cache `frees` times a step."""
    run = gd403(per_step=per_step)
    script = run.stages[0].facts.script
    assert script is not None and script.memory is not None
    counts, made = [], 0.0
    for i in range(60):
        made += 40 if i < 3 else (25 if i in (35, 36, 37) else mallocs)
        counts.append(int(made))
    script.memory.device_allocs, script.memory.alloc_retries = counts, retries
    run.stages[0].evidence = make_evidence(empty_cache_per_step=frees)
    return run


def kept_list(mib_per_step: float, *, graph: bool = False, device: str = "cuda",
              kind: str = "list of tensors") -> KeptTensors:
    """`history`, gaining a tensor of `mib_per_step` a step between steps 4 and 39 at
    train.py:58."""
    per_step = mib_per_step * 2**20
    return KeptTensors(name="history", kind=kind, location="train.py:58",  # type: ignore[arg-type]
                       steps=(4, 39), tensors=36, added_per_step=1.0, bytes=int(36 * per_step),
                       bytes_per_step=0.0 if kind == "tensor with its graph" else per_step,
                       graph_kept=graph, device=device)


def gd406(*, held_gib: float, workers: int = 8, pinned: float | None = 2048.0) -> RunResult:
    """A script on a 64 GiB machine whose process holds 4 GiB and its `workers` DataLoader
    workers the rest of `held_gib` at step 30 (less before); `pinned` MiB page-locked."""
    steps, gib = 40, 1024.0
    own = [4 * gib] * steps
    children = [(held_gib - 4) * gib * min(1.0, (i + 10) / 40) for i in range(steps)]
    memory = MemoryTimeline(device="cuda", resident_mib=own, host_total_mib=64 * gib,
                            children=[workers] * steps, children_resident_mib=children,
                            pinned_host_mib=pinned)
    facts = StageFacts(script=ScriptFacts(steps=steps, warmup=5, timed=30,
                                          step_clock="optimizer.step()", memory=memory))
    return make_run(make_stage("train.py", facts=facts))


def gd201(*, share: float) -> RunResult:
    return make_run(make_stage("data-train", data_wait_ms=share * STEP_MS,
                               facts=StageFacts(loader=LoaderFacts(num_workers=1,
                                                                   pin_memory=True))))


def _waiting_run(*, step_ms: float, wait_ms: float, workers: int, function: str = "<module>",
                 via: str = "", timeline: StepTimeline | None = None) -> RunResult:
    """A profiled script waiting `wait_ms` of each `step_ms` step for data, the wait's host
    samples on one line (`function`, `via` a library frame below it) with `workers`."""
    steps = 50
    host = HostSamples(period_ms=1.0, samples=500, steady_steps=steps,
                       steady_wall_ms=step_ms * steps, sampled_ms=step_ms * steps,
                       kind_ms={"data": wait_ms * steps, "torch": (step_ms - wait_ms) * steps},
                       lines=[HostLine("train.py:20", function, "data", wait_ms * steps, via),
                              HostLine("train.py:30", "<module>", "torch",
                                       (step_ms - wait_ms) * steps)],
                       text={"train.py:20": "for x, y in loader:"})
    script = ScriptFacts(steps=100, warmup=5, timed=30, step_clock="optimizer.step()",
                         host=host, timeline=timeline)
    return make_run(make_stage("train.py", ms=step_ms, data_wait_ms=wait_ms, facts=StageFacts(
        loader=LoaderFacts(num_workers=workers, pin_memory=False), script=script)))


def test_a_short_data_wait_is_information_whatever_its_share_of_a_short_step() -> None:
    """0.15 ms of a 1.2 ms step (12%) is below the cost of a worker's hand-off of one batch:
    information, not a warning; 3 ms of a 20 ms step is one."""
    (short,) = findings_of("GD201", _waiting_run(step_ms=1.2, wait_ms=0.15, workers=2))
    assert short.severity == "info" and short.impact == pytest.approx(0.125)
    (longer,) = findings_of("GD201", _waiting_run(step_ms=20.0, wait_ms=3.0, workers=2))
    assert longer.severity == "warning" and "more workers" in longer.fix


def test_data_waits_adding_up_to_little_of_the_training_loop_are_information() -> None:
    """3 ms of each 10 ms step, but a 20 s evaluation in the loop: the waits are under 1% of
    it, information; without the evaluation they are 30% of it, a warning."""
    times = [2000.0] + [10.0] * 59
    waits = [0.5] + [3.0] * 59
    plain = StepTimeline(step_ms=times, steps=60, total_ms=sum(times), data_wait_ms=waits)
    (found,) = findings_of("GD201", _waiting_run(step_ms=10.0, wait_ms=3.0, workers=2,
                                                 timeline=plain))
    assert found.severity == "critical" and found.evidence["loop_share"] == pytest.approx(
        177.5 / 590.0, abs=1e-4)
    times[30] = 20_000.0
    evaluating = StepTimeline(step_ms=times, steps=60, total_ms=sum(times), data_wait_ms=waits)
    (found,) = findings_of("GD201", _waiting_run(step_ms=10.0, wait_ms=3.0, workers=2,
                                                 timeline=evaluating))
    assert found.severity == "info" and found.evidence["loop_share"] < 0.01


def test_the_loaders_own_fetching_of_in_memory_tensors_is_not_told_more_workers() -> None:
    """num_workers=0 and the wait's samples at the loop's `for` line with no dataset code of
    the script's or a library's below it: the DataLoader indexing and collating in-memory
    tensors. The fix names that and batched indexing, not workers; a Dataset's own
    __getitem__, or a library's code below the line, keeps the workers advice."""
    (found,) = findings_of("GD201", _waiting_run(step_ms=20.0, wait_ms=3.0, workers=0))
    assert "more workers" not in found.fix and "collating them" in found.fix
    assert "sampler=BatchSampler(RandomSampler(dataset), batch_size" in found.fix
    for kept in (_waiting_run(step_ms=20.0, wait_ms=3.0, workers=0, function="__getitem__"),
                 _waiting_run(step_ms=20.0, wait_ms=3.0, workers=0,
                              via="PIL/Image.py:3200")):
        (advised,) = findings_of("GD201", kept)
        assert "more workers (now 0)" in advised.fix


def test_workers_measured_slower_by_try_fixes_are_not_advised_again() -> None:
    """The run's own --try-fixes measured the loader remedy slower (interval below 1): the fix
    keeps the workers as they are and says what it measured."""
    run = _waiting_run(step_ms=20.0, wait_ms=3.0, workers=2)
    run.fixes = [MeasuredFix(remedy="loader", title="loader", status="measured", speedup=0.17,
                             speedup_low=0.12, speedup_high=0.22)]
    (found,) = findings_of("GD201", run)
    assert "more workers" not in found.fix
    assert found.fix.startswith("train.py:20 (`for x, y in loader:`) holds 3.0 ms")
    assert "--try-fixes measured workers slower (0.17x): keep num_workers as it is" in found.fix
    run.fixes[0].speedup, run.fixes[0].speedup_low, run.fixes[0].speedup_high = 1.5, 1.2, 1.8
    (faster,) = findings_of("GD201", run)
    assert "more workers (now 2)" in faster.fix

def test_the_data_wait_is_named_at_the_line_its_host_samples_land_on() -> None:
    """num_workers=0: the Dataset's own line holds the wait (host samples of kind "data"):
    GD201 is placed there and says it runs on the training thread."""
    steps = 50
    host = HostSamples(period_ms=10.0, samples=500, steady_steps=steps,
                       steady_wall_ms=STEP_MS * steps, sampled_ms=STEP_MS * steps,
                       kind_ms={"data": 0.4 * STEP_MS * steps, "torch": 0.6 * STEP_MS * steps},
                       lines=[HostLine("data.py:25", "__getitem__", "data", 0.4 * STEP_MS * steps),
                              HostLine("train.py:30", "<module>", "torch", 0.6 * STEP_MS * steps)],
                       text={"data.py:25": "tokens = tokenize(text)"})
    script = ScriptFacts(steps=100, warmup=5, timed=30, step_clock="optimizer.step()",
                         host=host)
    run = make_run(make_stage("train.py", data_wait_ms=0.4 * STEP_MS, facts=StageFacts(
        loader=LoaderFacts(num_workers=0, pin_memory=False), script=script)))
    (found,) = findings_of("GD201", run)
    assert found.location == "data.py:25" and found.evidence["line_ms_per_step"] == 40.0
    assert found.fix.startswith("data.py:25 (`tokens = tokenize(text)`) holds 40.0 ms of each "
                                "step's wait, on the training thread (num_workers=0).")


def gd202(*, share: float, count: float = 2.0) -> RunResult:
    ev = make_evidence(memcpy_per_step={"HtoD-pageable": count},
                       memcpy_ms_per_step={"HtoD-pageable": share * STEP_MS})
    return make_run(make_stage("data-train", evidence=ev))


def gd203(*, copy_share: float, overlap: float) -> RunResult:
    ev = make_evidence(memcpy_per_step={"HtoD": 1.0},
                       memcpy_ms_per_step={"HtoD": copy_share * STEP_MS},
                       htod_overlap_fraction=overlap)
    return make_run(make_stage("data-train", evidence=ev))


def gd301(*, share: float, compute_capability: str = "9.0", tf32: bool = False,
          deliberate: bool = False) -> RunResult:
    facts = StageFacts(precision="fp32", deliberate_fp32=deliberate)
    ev = make_evidence(device_ms_per_step=80.0, matmul_ms_by_dtype={"fp32": share * 80.0})
    return make_run(make_stage("train", evidence=ev, facts=facts),
                    compute_capability=compute_capability, tf32=tf32)


def gd302(*, fp16: float, fp32: float = 10.0) -> RunResult:
    ev = make_evidence(device_ms_per_step=STEP_MS, matmul_ms_by_dtype={"fp16": fp16,
                                                                       "fp32": fp32})
    return make_run(make_stage("train-fp16", evidence=ev, facts=autocast()))


def gd303(*, tensor: float, matmul_share: float = limit("GD303", "min_matmul_share"),
          idle: float = 0.1) -> RunResult:
    ev = make_evidence(device_ms_per_step=STEP_MS, idle_fraction=idle,
                       matmul_ms_by_dtype={"fp16": matmul_share * STEP_MS})
    return make_run(make_stage("train-fp16", evidence=ev, gpm={"tensor_active_pct": tensor},
                               facts=autocast()))


def gd401(*, reserved_mib: float, allocated_mib: float = 8000.0) -> RunResult:
    memory = MemoryStats(peak_allocated_mib=allocated_mib, peak_reserved_mib=reserved_mib,
                         device_total_mib=10_000.0)
    return make_run(make_stage("train", memory=memory))


def gd402(*, frees: float, idle: float | None = None) -> RunResult:
    ev = make_evidence(empty_cache_per_step=frees, empty_cache_ms_per_step=5.0,
                       idle_fraction=idle)
    return make_run(make_stage("train", evidence=ev))


def test_empty_cache_is_priced_as_the_bound_it_is() -> None:
    """5 ms of cudaFree in a 100 ms step whose GPU idles 27% of it: at least 5% (the frees'
    own time, the price), at most 32% (with the idle their device syncs cause part of), and
    the finding says which it is."""
    (found,) = findings_of("GD402", gd402(frees=2.0, idle=0.27))
    assert found.impact == pytest.approx(0.05) and found.evidence["at_most"] == 0.32
    assert found.title.endswith("at least 5% of the step (the frees alone), up to 32%")
    assert str(found.evidence["price"]).startswith("lower bound")


def gd501(*, thermal: float = 0.0, power_cap: float = 0.0) -> RunResult:
    return make_run(make_stage("train-fp16", throttle={"hw_slowdown": thermal,
                                                       "power_cap": power_cap}))


def gd601(*, shift: float) -> RunResult:
    stage = make_stage("train-fp16")
    stage.iter_ms = [50.0] * 10 + [50.0 * shift] * 10
    return make_run(stage)


def _saving_stage(name: str, stall: float) -> StageResult:
    """100 steps of 50 ms with a save every 10 steps that adds `stall` ms to its step."""
    stage = make_stage(name, ms=50.0)
    stage.iter_ms = [50.0 + (stall if i % 10 == 9 else 0.0) for i in range(100)]
    return stage


def gd701(*, stall: float) -> RunResult:
    return make_run(_saving_stage("checkpoint-sync", stall))  # step times alone, no records


def gd702(*, wait: float) -> RunResult:
    stage = _saving_stage("checkpoint-async", wait + 1.0)
    stage.facts.checkpoint = CheckpointFacts(mode="async", every=10, saves=[
        SaveRecord(step=i, blocking_ms=wait + 1.0, waited_ms=wait, total_ms=600.0)
        for i in range(9, 100, 10)])
    return make_run(stage)


def gd703(*, extra: float) -> RunResult:
    """A profiled script (every torch.save is seen: none here) evaluating every 10 steps."""
    stage = _saving_stage("train.py", extra)
    stage.facts.script = ScriptFacts(steps=130, warmup=5, timed=100, step_clock="optimizer.step()")
    return make_run(stage)


def gd801(*, efficiency: float) -> RunResult:
    stage = make_stage("ddp", ms=50.0, facts=StageFacts(ddp=DdpFacts(
        world_size=2, per_device_batch=64, accum=1, scaling_efficiency=efficiency,
        single_device=SingleDevice(ms_per_iter=40.0, samples_per_s=1600.0),
        grad_bytes_per_round=440_000_000, transfer_ms_per_step=9.0,
        allreduce_probe=LinkProbe(bytes=2**28, ms=11.2, algbw_gbps=24.0, busbw_gbps=48.0))))
    return make_run(stage)


def gd802(*, rounds: float) -> RunResult:
    evidence = make_evidence(microsteps_per_step=4.0, microsteps_with_collectives_per_step=rounds)
    stage = make_stage("ddp", ms=100.0, evidence=evidence,
                       facts=StageFacts(ddp=DdpFacts(world_size=2,
                                                     transfer_ms_per_step=40.0 * rounds)))
    return make_run(stage)


def gd803(*, share: float) -> RunResult:
    # The window's host runs slower (200 ms) than the timed step (50 ms); exposed time is
    # device time, held against the timed step.
    evidence = make_evidence(collective_calls_per_step=2.0, window_step_ms=200.0,
                             collective_exposed_ms_per_step=share * 50.0)
    return make_run(make_stage("train.py[rank0]", ms=50.0, evidence=evidence))


def gd805(*, resharding: int, share: float = 0.6) -> RunResult:
    """8 FSDP2 units made at train.py:20, `resharding` of them freeing their parameters after
    forward (gathered again in backward); the collectives hold `share` of the 50 ms step."""
    kinds = {"all_gather": 8.0 + resharding, "reduce_scatter": 8.0}
    evidence = make_evidence(collective_calls_per_step=16.0 + resharding,
                             collective_calls_by_kind=kinds, window_step_ms=200.0,
                             collective_exposed_ms_per_step=share * 50.0)
    unit_bytes = 4 * 2**20
    fsdp = FsdpFacts(shard_size=2, sites=[FsdpUnits("train.py:20", 8, resharding, 8 * unit_bytes,
                                                    resharding * unit_bytes)])
    facts = StageFacts(script=ScriptFacts(steps=60, warmup=5, timed=30,
                                          step_clock="optimizer.step()", fsdp=fsdp))
    return make_run(make_stage("train.py[rank0]", ms=50.0, evidence=evidence, facts=facts))


def gd804(*, ratio: float) -> RunResult:
    """Rank 1's own device work takes `ratio` x rank 0's; rank 0 waits in the all-reduce."""
    def rank(index: int, compute: float, exposed: float) -> StageResult:
        evidence = make_evidence(collective_calls_per_step=2.0, window_step_ms=200.0,
                                 compute_busy_ms_per_step=compute,
                                 collective_exposed_ms_per_step=exposed)
        return make_stage(f"train.py[rank{index}]", ms=50.0, evidence=evidence)
    return make_run(rank(0, 30.0, 30.0 * (ratio - 1) + 1.0), rank(1, 30.0 * ratio, 1.0))


def gd304(*, share: float, idle: float = 0.05, backend: str = "cuda",
          fused: float | None = None) -> RunResult:
    """A hand-written attention block: `share` of the kernel time in softmax (attn.py:30, with
    its matmuls) and a cast (attn.py:31); the GPU idle `idle` of the step. With `fused`, the
    lines' shapes were recorded: their memory-bound operators move 1 GB, fused `fused` GB."""
    by_kind = {"matmul": 100 * (1 - share), "softmax": 60 * share, "elementwise": 40 * share}
    moved = {} if fused is None else {"memory_bytes": 1e9, "fused_memory_bytes": fused * 1e9}
    lines = [LineCount("attn.py:30", "forward", kind_ms={"softmax": 60 * share,
                                                         "matmul": 100 * (1 - share)}, **moved),
             LineCount("attn.py:31", "forward", kind_ms={"elementwise": 40 * share}, **moved)]
    ev = make_evidence(backend=backend, idle_fraction=idle, device_ms_by_kind=by_kind,
                       line_counts=lines)
    return make_run(make_stage("train", evidence=ev))


def gd305(*, share: float, low: float = 0.9, backend: str = "cuda") -> RunResult:
    """A bf16 attention block whose fp32 mask promotes its add (attn.py:31) and softmax
    (attn.py:32) to fp32: `share` of 100 ms of kernel time; `low` of the matmul time in bf16."""
    by_kind = {"matmul": 100 * (1 - share), "softmax": 50 * share, "elementwise": 50 * share}
    lines = [LineCount("attn.py:30", "forward", kind_ms={"matmul": 100 * (1 - share)}),
             LineCount("attn.py:31", "forward", kind_ms={"elementwise": 50 * share},
                       fp32_ms_by_kind={"elementwise": 50 * share}),
             LineCount("attn.py:32", "forward", kind_ms={"softmax": 50 * share},
                       fp32_ms_by_kind={"softmax": 30 * share, "cast": 10 * share})]
    matmul = 100 * (1 - share)
    ev = make_evidence(backend=backend, idle_fraction=0.0, device_ms_by_kind=by_kind,
                       line_counts=lines,
                       matmul_ms_by_dtype={"bf16": matmul * low, "fp32": matmul * (1 - low)})
    return make_run(make_stage("train", evidence=ev))


def gd306(*, memory_format: str | None = "channels_first", conv: float = 0.3,
          layout: float = 0.0, norm: float = 0.2, dtype: str = "torch.bfloat16",
          transformer: bool = False) -> RunResult:
    """A ResNet-style step on 100 ms of kernels: `conv` in convolutions, `layout` in cuDNN's
    NCHW <-> NHWC transposes, `norm` in batch norms, the rest ReLUs and adds (and a
    cross-entropy's small softmax). The script recorded its first Conv2d's input in
    `memory_format` (None: not recorded), computing in `dtype`, its model built at
    train.py:12 and called at train.py:30. `transformer`: no convolution, matmuls, attention
    and layer norms instead."""
    by_kind = ({"matmul": 60.0, "attention": 20.0, "norm": 20.0} if transformer else
               {"convolution": 100 * conv, "layout": 100 * layout, "norm": 100 * norm,
                "softmax": 0.5, "elementwise": 100 * (1 - conv - layout - norm) - 0.5})
    lines = [LineCount("train.py:30", "main", kind_ms=by_kind)]
    ev = make_evidence(idle_fraction=0.05, device_ms_by_kind=by_kind, line_counts=lines)
    layout_facts = None if memory_format is None or transformer else ConvLayout(
        memory_format=memory_format,  # type: ignore[arg-type]
        device="cuda", dtype=dtype, built_at="train.py:12", called_at="train.py:30")
    facts = StageFacts(script=ScriptFacts(steps=60, warmup=5, timed=30,
                                          step_clock="optimizer.step()",
                                          conv_layout=layout_facts))
    return make_run(make_stage("train.py", ms=100.0, evidence=ev, facts=facts))


def gd9(*, recompiles: int, limit_hit: bool = False, breaks: int = 0) -> RunResult:
    """A profiled script's compilations: model.py's forward compiled at step 0, then
    recompiled at each of the next `recompiles` steps for a new length (1 s each), then, with
    `limit_hit`, given up on; `breaks` graph breaks at a print."""
    def event(step: int, seconds: float = 1.0, **fields: Any) -> CompileEvent:
        return CompileEvent(function="forward", location="model.py:10", seconds=seconds,
                            compile_id=f"0/{step}", step=step, call_site="train.py:30",
                            **fields)
    events = [event(0)]
    events += [event(i, recompile_reason=f"0/{i - 1}: tensor 'x' size mismatch at index 1. "
                                         f"expected {i + 7}, actual {i + 8}")
               for i in range(1, recompiles + 1)]
    if limit_hit:
        events.append(event(recompiles + 1, seconds=0.0,
                            recompile_reason="0/8: tensor 'x' size mismatch at index 1",
                            failure="Dynamo recompile limit exceeded"))
    reason = "Failed to trace builtin operator: Dynamo does not know how to trace `print`"
    if breaks:
        events[0].graph_break, events[0].graph_break_at = reason, "model.py:12"
    compiles = CompileFacts(events=events, seconds=float(len(events)), recompile_limit=8,
                            graph_breaks={reason: breaks} if breaks else {})
    facts = StageFacts(script=ScriptFacts(steps=100, warmup=5, timed=30,
                                          step_clock="optimizer.step()", compiles=compiles))
    return make_run(make_stage("train.py", facts=facts))


@dataclass(frozen=True)
class Case:
    """A run where the rule fires, what it must say, and near misses where it must not."""

    fires: Callable[[], RunResult]
    stage: str
    severity: str
    evidence: dict[str, Any]  # evidence key -> expected value
    near_misses: tuple[Callable[[], RunResult], ...]


P = functools.partial
CASES: dict[str, Case] = {
    # At both count thresholds, with the loop taking the critical share of the step.
    "GD101": Case(P(gd101), "full-loop", "critical",
                  {"torch_calls_per_step": 64, "device_ops_per_step": 100,
                   "share_of_step_time": 0.4},
                  (P(gd101, calls=63), P(gd101, ops=99), P(gd101, in_loop=False))),
    "GD102": Case(P(gd102, excess=0.5), "full-loop", "critical",
                  {"idle_beyond_reference": 0.5, "power_gap_w": 200.0,
                   "reference_stage": "train-fp16", "slowdown_vs_reference": 4.0},
                  (P(gd102, excess=0.249),
                   P(gd102, excess=0.5, data_wait=limit("GD102", "max_data_wait_share")))),
    "GD103": Case(P(gd103, syncs=4), "train", "critical",
                  {"syncs_per_step": 4, "blocked_ms_per_step": 80.0,
                   "idle_after_syncs_ms_per_step": 30.0, "lines": {"train.py:30": 4}},
                  (P(gd103, syncs=3, idle_share=limit("GD103", "min_named_idle_share") - 1e-3),
                   P(gd103, syncs=3, direct=0.0),
                   P(gd103, syncs=40, idle_share=limit("GD103", "warning_idle_share") - 1e-3))),
    "GD104": Case(P(gd104, kernels=500), "train", "warning",
                  {"kernels_per_step": 500, "short_kernel_share": 0.5, "idle_fraction": 0.2},
                  (P(gd104, kernels=499), P(gd104, kernels=500, idle=0.199),
                   P(gd104, kernels=500, short_share=0.49))),
    # A numpy line at the critical share of the step, the GPU idle; below the share a line is
    # named at all, nothing; a GPU busy beside the host's work makes it cost little; without
    # a window's idle share a GPU run's finding is information only.
    "GD105": Case(P(gd105, share=limit("GD105", "critical_share")), "train.py", "critical",
                  {"host_only_share": 0.4, "host_only_ms_per_step": 40.0,
                   "gpu_idle_fraction": 0.9, "steps_sampled": 50},
                  (P(gd105, share=limit("GD105", "min_line_share") - 1e-3),
                   P(gd105, share=0.4, idle=limit("GD105", "warning_share") - 1e-3),
                   P(gd105, share=0.4, idle=None))),
    # A single-tensor AdamW at the launch count and critical share; fewer launches, a small
    # share, a fused one, or one with no faster implementation for its tensors: nothing.
    "GD106": Case(P(gd106), "train.py", "critical",
                  {"parameter_tensors": 25, "optimizer_ops_per_step": 200,
                   "built_at": "train.py:12", "better": "fused", "implementation":
                   "single-tensor", "measured_by": "the profiler window"},
                  (P(gd106, ops=limit("GD106", "min_optimizer_ops_per_step") - 1),
                   P(gd106, share=limit("GD106", "info_share") - 1e-3),
                   P(gd106, implementation="fused"), P(gd106, fused=False))),
    # 15 passes of 4 steps, each restart 40 ms over a 10 ms step: most of the loop; one pass,
    # persistent workers, or none: nothing.
    # Anomaly detection on through the timed steps, turning it off measured 1.5x; on only
    # before the timing (a first-batch check), measured to save next to nothing, or
    # CUDA_LAUNCH_BLOCKING alone on a CPU run: no warning.
    "GD107": Case(P(debug_run, anomaly(), launch_blocking(), speedup=1.5), "train.py",
                  "critical",  # a third of the step saved: critical_measured_saving
                  {"remedy": "no-debug", "measured_saving": 1 / 3,
                   "settings": {"anomaly-detection": {
                       "set_by": "torch.autograd.set_detect_anomaly(True)",
                       "site": "train.py:5", "timed_steps_on": 30, "steps_on": 30},
                       "launch-blocking": {"set_by": "CUDA_LAUNCH_BLOCKING=1", "site": None,
                                           "timed_steps_on": 30, "steps_on": 60}}},
                  (P(debug_run, anomaly(timed=0)),
                   P(debug_run, anomaly(), speedup=1 / (1 - limit("GD107", "min_measured_saving"))
                     - 1e-3),
                   P(debug_run, launch_blocking(), device="cpu"))),
    # Deterministic algorithms on a GPU, unmeasured; on a CPU (it changes little there), or
    # turned off before the timed steps: no warning.
    "GD108": Case(P(debug_run, deterministic()), "train.py", "warning",
                  {"remedy": "nondeterministic", "measured_saving": None},
                  (P(debug_run, deterministic(), device="cpu"),
                   P(debug_run, deterministic(timed=0)))),
    "GD204": Case(P(gd204), "train.py", "critical",
                  {"num_workers": 2, "passes": 15, "batches_per_pass": 4,
                   "ms_per_restart": 40.0, "usual_wait_ms": 1.0, "built_at": "train.py:7"},
                  (P(gd204, passes=1), P(gd204, persistent=True), P(gd204, workers=0),
                   # Restarts of 0.2 ms in all 14: under the share worth a word.
                   P(gd204, restart_ms=0.1, first_ms=1.0, end_ms=0.1))),
    "GD201": Case(P(gd201, share=0.3), "data-train", "critical",
                  {"data_wait_ms": 30.0, "share": 0.3, "num_workers": 1},
                  (P(gd201, share=0.099),)),
    "GD202": Case(P(gd202, share=0.02), "data-train", "warning",
                  {"pageable_htod_per_step": 2.0, "pageable_htod_ms_per_step": 2.0},
                  (P(gd202, share=0.0199), P(gd202, share=0.5, count=0.0))),
    "GD203": Case(P(gd203, copy_share=0.05, overlap=0.0), "data-train", "warning",
                  {"htod_ms_per_step": 5.0, "overlap_fraction": 0.0},
                  (P(gd203, copy_share=0.049, overlap=0.0),
                   P(gd203, copy_share=0.2, overlap=0.5))),
    "GD301": Case(P(gd301, share=0.3), "train", "warning",
                  {"share_of_kernel_time": 0.3, "fp32_matmul_ms_per_step": 24.0,
                   "tf32_matmul": False},
                  (P(gd301, share=0.299), P(gd301, share=0.9, tf32=True),
                   P(gd301, share=0.9, compute_capability="7.5"),
                   P(gd301, share=0.9, deliberate=True))),
    "GD302": Case(P(gd302, fp16=90.0), "train-fp16", "warning",
                  {"matmul_ms_by_dtype": {"fp16": 90.0, "fp32": 10.0}},
                  (P(gd302, fp16=91.0),)),
    "GD303": Case(P(gd303, tensor=9.9), "train-fp16", "info",
                  {"tensor_active_pct": 9.9, "matmul_share": 0.3},
                  (P(gd303, tensor=10.0), P(gd303, tensor=5.0, matmul_share=0.299),
                   P(gd303, tensor=5.0, idle=0.25))),
    "GD401": Case(P(gd401, reserved_mib=9000.0), "train", "warning",
                  {"peak_reserved_mib": 9000, "device_total_mib": 10000},
                  (P(gd401, reserved_mib=8999.0),)),
    "GD402": Case(P(gd402, frees=0.5), "train", "warning",
                  {"frees_per_step": 0.5, "free_ms_per_step": 5.0},
                  (P(gd402, frees=0.49),)),
    "GD403": Case(P(gd403, per_step=64.0 / 50), "train.py", "warning",
                  {"series": "allocated", "mib_per_step": 1.28, "steps_counted": 50},
                  (P(gd403, per_step=63.0 / 50), P(gd403, per_step=0.0, jump_at=20),
                   P(gd403, per_step=8.0, steps=15))),
    "GD404": Case(P(gd404), "train.py", "critical",
                  {"device": "cuda", "step": 40, "requested_mib": 2048.0,
                   "allocated_mib": 78_000.0},
                  (P(gd404, oom=False),)),
    "GD405": Case(P(gd405, mallocs=1.0), "train.py", "warning",
                  {"mallocs_per_step": 1.0, "alloc_retries": 0},
                  (P(gd405, mallocs=0.49), P(gd405, mallocs=2.0, per_step=10.0),
                   P(gd405, mallocs=2.0, frees=1.0))),
    "GD406": Case(P(gd406, held_gib=0.8 * 64), "train.py", "warning",
                  {"children": 8, "host_total_mib": 65536.0},
                  (P(gd406, held_gib=0.79 * 64),)),
    "GD501": Case(P(gd501, thermal=0.1), "train-fp16", "warning",
                  {"throttle_share": {"hw_slowdown": 0.1, "power_cap": 0.0}},
                  (P(gd501, thermal=0.099),)),
    "GD701": Case(P(gd701, stall=25.0), "checkpoint-sync", "warning",
                  {"source": "step times alone", "period_steps": 10, "saves": 10,
                   "stall_ms_per_save": 25.0, "lost_share": 0.05, "interval_for_3pct": 17},
                  (P(gd701, stall=24.9),)),
    "GD702": Case(P(gd702, wait=25.0), "checkpoint-async", "warning",
                  {"saves_waited": 10, "wait_ms_median": 25.0, "lost_share": 0.05},
                  (P(gd702, wait=24.9),)),
    "GD703": Case(P(gd703, extra=25.0), "train.py", "warning",
                  {"period_steps": 10, "occurrences": 10, "extra_ms_per_occurrence": 25.0,
                   "lost_share": 0.05, "saves_on_record": 0},
                  (P(gd703, extra=24.9),)),
    "GD801": Case(P(gd801, efficiency=0.79), "ddp", "warning",
                  {"scaling_efficiency": 0.79, "cause": "communication",
                   "added_ms_per_step": 10.0},
                  (P(gd801, efficiency=limit("GD801", "poor_efficiency")),)),
    "GD802": Case(P(gd802, rounds=2.0), "ddp", "warning",
                  {"reducing_microsteps_per_step": 2.0, "wasted_transfer_ms_per_step": 40.0},
                  (P(gd802, rounds=1.0),)),
    "GD803": Case(P(gd803, share=0.3), "train.py[rank0]", "warning",
                  {"exposed_share": 0.3, "exposed_ms_per_step": 15.0},
                  (P(gd803, share=0.299),)),
    # 8 re-gathers of 24 collective calls, the collectives 60% of the step: 20%.
    "GD805": Case(P(gd805, resharding=8), "train.py[rank0]", "warning",
                  {"regathers_per_step": 8.0, "resharding_units": 8, "units": 8,
                   "fully_shard_at": "train.py:20"},
                  (P(gd805, resharding=0), P(gd805, resharding=8, share=0.08))),
    "GD804": Case(P(gd804, ratio=1.2), "train.py[rank1]", "warning",
                  {"slow_rank": 1, "fast_rank": 0, "compute_ratio": 1.2,
                   "share_of_step_lost": 0.12},
                  (P(gd804, ratio=limit("GD804", "straggler_ratio") - 0.001),)),
    "GD304": Case(P(gd304, share=limit("GD304", "warning_share")), "train", "warning",
                  {"memory_bound_share": 0.5, "matmul_share": 0.5,
                   "lines": {"attn.py:30": {"memory_bound_ms": 30.0,
                                            "ms_by_kind": {"softmax": 30.0, "matmul": 50.0}},
                             "attn.py:31": {"memory_bound_ms": 20.0,
                                            "ms_by_kind": {"elementwise": 20.0}}}},
                  (P(gd304, share=limit("GD304", "warning_share") - 0.01),
                   P(gd304, share=0.9, idle=limit("GD304", "max_idle_fraction") + 0.01),
                   P(gd304, share=0.9, backend="cpu"))),
    # 10 + 8 ms of fp32 islands in 100 ms of kernels: 18%, past 15%, short of the warning's
    # 30%; at share 0.16, 14.4%.
    "GD305": Case(P(gd305, share=0.2), "train", "info",
                  {"fp32_memory_bound_share": 0.18, "low_precision_matmul_share": 0.9,
                   "within": "GD304"},
                  (P(gd305, share=0.16),
                   P(gd305, share=0.2, low=limit("GD305", "min_low_precision_matmul") - 0.01),
                   P(gd305, share=0.4, backend="cpu"))),
    # Convolutions and batch norms half the kernel time in bf16 on an input recorded as NCHW:
    # a warning with no transposes seen. Information only in fp32 or short of half; silent
    # for a channels_last model, a transformer, convolutions short of a fifth of the kernel
    # time, or none recorded and too few transposes seen.
    "GD306": Case(P(gd306, norm=limit("GD306", "warning_block_share") - 0.3), "train.py",
                  "warning",
                  {"memory_format": "channels_first", "compute_dtype": "torch.bfloat16",
                   "built_at": "train.py:12", "called_at": "train.py:30",
                   "convolution_share": 0.3, "layout_share": 0.0, "conv_block_share": 0.5},
                  (P(gd306, memory_format="channels_last", conv=0.8, layout=0.1, norm=0.05),
                   P(gd306, transformer=True),
                   P(gd306, norm=0.3, dtype="torch.float32"),
                   P(gd306, norm=limit("GD306", "warning_block_share") - 0.31),
                   P(gd306, memory_format=None, conv=0.5,
                     layout=limit("GD306", "min_layout_share") - 0.001),
                   P(gd306, conv=limit("GD306", "min_conv_share") - 0.01, norm=0.5))),
    # Two recompiles of one function (one is routine: a last, smaller batch).
    "GD901": Case(P(gd9, recompiles=2), "train.py", "critical",
                  {"recompiles": 2, "compilations": 3, "called_at": "train.py:30",
                   "defined_at": "model.py:10", "recompile_seconds": 2.0},
                  (P(gd9, recompiles=1),)),
    "GD902": Case(P(gd9, recompiles=7, limit_hit=True), "train.py", "warning",
                  {"recompile_limit": 8, "first_eager_step": 8, "compilations": 8},
                  (P(gd9, recompiles=7),)),
    "GD903": Case(P(gd9, recompiles=0, breaks=1), "train.py", "info",
                  {"at": {"Failed to trace builtin operator: Dynamo does not know how to trace "
                          "`print`": "model.py:12"}},
                  (P(gd9, recompiles=0),)),
    "GD601": Case(P(gd601, shift=1.3), "train-fp16", "info",
                  {"fastest_block_ms": 50.0, "slowest_block_ms": 65.0},
                  (P(gd601, shift=limit("GD601", "max_block_shift")),)),
}


def findings_of(code: str, run: RunResult) -> list[Finding]:
    return [f for f in evaluate(run) if f.id == code]


def test_memory_bound_kernels_are_priced_by_what_fusing_them_saves() -> None:
    """With shapes: fused, the lines' operators would move a quarter of their bytes, so at
    today's rate three quarters of their 50 ms goes: 37.5% of the kernel time, busy 95%.
    Without: the memory-bound kernels' whole share, and the price says it is an upper bound."""
    (modelled,) = findings_of("GD304", gd304(share=0.5, fused=0.25))
    assert modelled.impact == pytest.approx(0.375 * 0.95)
    assert modelled.evidence["fusion_saving_ms"] == pytest.approx(37.5)
    assert modelled.evidence["price"].startswith("a model in bytes")
    # Short of half the kernel time, fusing still saves 40% x 3/4 x 95% = 28.5% of the step.
    (short,) = findings_of("GD304", gd304(share=0.4, fused=0.25))
    assert short.severity == "warning" and short.impact == pytest.approx(0.285)
    assert "fused, ~28% of the step would go" in short.title
    assert not findings_of("GD304", gd304(share=0.4))  # no shapes: no model to go on
    (info,) = findings_of("GD304", gd304(share=0.2, fused=0.25))  # 14%: worth knowing
    assert info.severity == "info" and info.impact == pytest.approx(0.2 * 0.75 * 0.95)
    assert not findings_of("GD304", gd304(share=0.12, fused=0.25))  # 8.6%
    (bound,) = findings_of("GD304", gd304(share=0.5))
    assert bound.impact == pytest.approx(0.5 * 0.95) == bound.evidence["upper_bound_share"]
    assert bound.evidence["price"].startswith("an upper bound")


def test_conv_layout_is_priced_by_its_transposes_and_named_where_the_model_is_built() -> None:
    """Not recorded in the script (gpudiag run's stages, a compiled script), cuDNN's
    transposes say NCHW; their share of the step is the price, a lower bound. The fix names
    the lines, and GD304 on the same step gives no attention advice (a cross-entropy's softmax
    is no attention) but the layout's."""
    (traced,) = findings_of("GD306", gd306(memory_format=None, conv=0.5, layout=0.1))
    assert traced.severity == "warning" and traced.impact == pytest.approx(0.1 * 0.95)
    assert traced.location is None and "lower bound" in traced.evidence["price"]
    (named,) = findings_of("GD306", gd306(conv=0.3, layout=0.02, norm=0.1))
    assert named.severity == "info" and named.location == "train.py:12"
    assert "At train.py:12: `model = model.to(memory_format=torch.channels_last)`" in named.fix
    assert "at train.py:30, the input" in named.fix
    # fp32 convolutions gain less from NHWC than 16-bit ones: information, with both bounds.
    (fp32,) = findings_of("GD306", gd306(norm=0.3, dtype="torch.float32"))
    assert fp32.severity == "info" and "at most the convolution blocks' 57%" in \
        fp32.evidence["price"]
    (memory,) = findings_of("GD304", gd306(conv=0.3, norm=0.4))
    assert "attention" not in memory.fix.lower() and "channels_last" in memory.fix
    (attention,) = findings_of("GD304", gd304(share=0.5))
    assert "scaled_dot_product_attention" in attention.fix


def test_every_rule_has_a_case() -> None:
    assert set(CASES) == {r.code for r in all_rules()}


@pytest.mark.parametrize("code", sorted(CASES))
def test_rule_fires(code: str) -> None:
    case = CASES[code]
    found = findings_of(code, case.fires())
    assert len(found) == 1, found
    f = found[0]
    rule = find_rule(code)
    assert rule is not None and f.rule == rule.name
    assert (f.stage, f.severity) == (case.stage, case.severity), f
    for key, value in case.evidence.items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        assert f.evidence[key] == (pytest.approx(value) if numeric else value), (key, f)
    assert 0.0 <= f.impact <= 1.0 and f.title and f.fix


NEAR_MISSES = [(code, i) for code, case in sorted(CASES.items())
               for i in range(len(case.near_misses))]


@pytest.mark.parametrize(("code", "index"), NEAR_MISSES)
def test_rule_near_miss(code: str, index: int) -> None:
    """Just past a threshold the rule stays silent, or (for rules that always note what they
    see) reports below the firing case's severity."""
    case = CASES[code]
    found = findings_of(code, case.near_misses[index]())
    assert not [f for f in found
                if SEVERITY_RANK[f.severity] >= SEVERITY_RANK[case.severity]], found


# Rule-specific behaviour beyond the threshold pairs.


def test_host_memory_names_the_workers_share_and_the_pinned_memory() -> None:
    """The field report this project was born from: pinned batches and many DataLoader
    workers near the host's memory (60 of 64 GiB): the workers' part, each on average, the
    pinned part; critical at 95%."""
    (f,) = findings_of("GD406", gd406(held_gib=62.0))
    assert f.severity == "critical"
    assert f.title == ("The script and its child processes hold 62.00 GiB of the machine's "
                       "64.00 GiB (97%) at step 30: the process 4.00 GiB, its 8 child "
                       "processes 58.00 GiB (~7.25 GiB each); 2.00 GiB of it page-locked "
                       "(pinned)")
    (g,) = findings_of("GD406", gd406(held_gib=56.0, workers=0, pinned=None))
    assert g.severity == "warning" and "child processes" not in g.title.split(":")[1]


def with_owners(stage: StageResult, *, device: str = "cuda") -> StageResult:
    """`stage` a profiled step of 32 samples using 1.5 of 80 GiB: activations, batch and
    temporaries 1 GiB, weights, gradients and optimizer state 0.5 GiB."""
    gib = 2**30
    stage.samples_per_step = 32
    stage.facts.script = ScriptFacts(
        steps=100, warmup=5, timed=30, step_clock="optimizer.step()",
        memory=MemoryTimeline(device=device, device_total_mib=80 * 1024.0),
        owners=MemoryOwners(device=device, step=35, parameters=gib // 8, gradients=gib // 8,
                            optimizer_state=gib // 4, activations=gib // 2, peak=3 * gib // 2))
    return stage


def test_a_starved_gpus_fix_says_how_much_of_the_device_the_step_uses_and_what_batch_fits(
        ) -> None:
    """A host-paced step of 32 samples using 1.5 of 80 GiB (issue 57): its activations, batch
    and temporaries (1 GiB) scale with the batch, its weights, gradients and state (0.5 GiB)
    do not; a batch of ~(0.9 x 80 - 0.5) / 1 x 32 = 2,288 would fit. Without owners, nothing
    is said of memory."""
    run = gd102(excess=0.5)
    stage = with_owners(run.stages[1])
    (f,) = findings_of("GD102", run)
    assert f.evidence["largest_batch"] == 2288
    assert ("The step uses 1.50 of the device's 80 GiB (2%) at its peak: 1.00 GiB scale with "
            "the batch") in f.fix
    assert "a batch of up to ~2,288 (now 32) would fit in 90% of it" in f.fix
    stage.samples_per_step = None  # a script that does not say its batch
    (g,) = findings_of("GD102", run)
    assert "~72 times this step's batch would fit in 90% of it" in g.fix
    (bare,) = findings_of("GD102", gd102(excess=0.5))
    assert "largest_batch" not in bare.evidence and "GiB" not in bare.fix
    stage.samples_per_step = 32
    script = stage.facts.script
    assert script is not None and script.memory is not None
    script.memory.cap_mib = 8 * 1024.0  # set_per_process_memory_fraction(0.1): 8 of 80 GiB
    (capped,) = findings_of("GD102", run)
    assert capped.evidence["largest_batch"] == int(32 * (0.9 * 8 - 0.5))  # 214
    assert "The step uses 1.50 of the process's cap of 8 GiB (19%)" in capped.fix


@pytest.mark.parametrize("code", ["GD101", "GD104"])
def test_a_loop_or_launch_bound_steps_fix_says_what_batch_fits(code: str) -> None:
    """GD101's Python loop and GD104's short kernels leave the GPU waiting on launches, as
    GD102's host does (issue 57): their fix says the step's memory and the batch that fits
    where the run counted owners on CUDA; not on a CPU's owners, nor without any."""
    make = {"GD101": gd101, "GD104": lambda: gd104(kernels=limit("GD104",
                                                                   "min_kernels_per_step"))}[code]
    run = make()
    with_owners(run.stages[0])
    (f,) = findings_of(code, run)
    assert f.evidence["largest_batch"] == 2288 and f.evidence["batches_that_fit"] == 72
    assert "a batch of up to ~2,288 (now 32) would fit in 90% of it" in f.fix
    cpu = make()
    with_owners(cpu.stages[0], device="cpu")
    (g,) = findings_of(code, cpu)
    assert "largest_batch" not in g.evidence and "GiB" not in g.fix
    (bare,) = findings_of(code, make())
    assert "largest_batch" not in bare.evidence and "GiB" not in bare.fix


def test_tensors_that_grow_without_growing_in_number_are_no_leak() -> None:
    """examples/growing_lengths.py on an H200: the step's batch grows 4 MiB a step (a length
    curriculum), the allocator's live allocations flat: information, no list to blame, and
    GD405's cudaMalloc calls are named beside it; one more live allocation a step is kept
    tensors, a warning."""
    inputs = gd405(mallocs=2.0, per_step=4.0 * 60 / 50 + 2)
    script = inputs.stages[0].facts.script
    assert script is not None and script.memory is not None
    script.memory.live_blocks = [120] * 60
    (f,) = findings_of("GD403", inputs)
    assert f.severity == "info" and "without growing in number" in f.title
    assert f.evidence["more_live_blocks"] is False
    (g,) = findings_of("GD405", inputs)
    assert g.severity == "warning"
    script.memory.live_blocks = [120 + i for i in range(60)]
    (h,) = findings_of("GD403", inputs)
    assert h.severity == "warning" and h.evidence["more_live_blocks"] is True
    assert not findings_of("GD405", inputs)


def test_allocator_misses_name_retries_and_rare_mallocs_and_take_the_remedys_price() -> None:
    """A retry is a warning whatever the count; a cudaMalloc every 10 steps is information;
    once --try-fixes measured expandable segments, that saving is the price."""
    (f,) = findings_of("GD405", gd405(retries=3))
    assert f.severity == "warning" and "3 retries after freeing the whole cache" in f.title
    (g,) = findings_of("GD405", gd405(mallocs=0.1))
    assert g.severity == "info" and "0.10 cudaMalloc calls a step" in g.title
    run = gd405(mallocs=1.0)
    run.fixes = [MeasuredFix(remedy="expandable-segments", title="t", findings=["GD405"],
                             speedup=1.25)]
    (h,) = findings_of("GD405", run)
    assert h.impact == pytest.approx(0.2) and "measured 20% faster" in h.title
    # The H200's growing_lengths: 1.04x (0.83-1.28), no faster than the runs' noise.
    run.fixes[0].speedup, run.fixes[0].speedup_low, run.fixes[0].speedup_high = 1.04, 0.83, 1.28
    (n,) = findings_of("GD405", run)
    assert n.severity == "info" and n.impact == 0.0
    assert "measured no faster (1.04x, 0.83-1.28): the misses cost little here" in n.title


def test_out_of_memory_lists_the_knobs_that_would_fit_in_bytes() -> None:
    """A 500M-parameter AdamW job out of memory at step 40 (issue 57): the failing line, and
    what fits, each in bytes: the growth first where memory grew, the allocator's cache where
    it held the request, the optimizer's 3.73 GiB of fp32 moments (8-bit saves three
    quarters), then the step's own allocations beyond weights, gradients and state."""
    (f,) = findings_of("GD404", gd404())
    assert f.location == "train.py:77" and f.severity == "critical"
    assert f.title == ("Out of memory at step 40: 2.00 GiB requested with 76.17 GiB held by "
                       "tensors (76.27 GiB reserved) of the GPU's 80.00 GiB")
    knobs = f.evidence["knobs"]
    assert knobs[0].startswith("the optimizer's state, 3.73 GiB in fp32")
    assert "three quarters (2.79 GiB)" in knobs[0]
    # What the failing step needed at least: the 78,000 MiB held and the 2 GiB asked, beyond
    # the 16 bytes an element of weights, gradients and moments.
    assert knobs[1].startswith("the step's own allocations (activations and temporaries), "
                               "~70.72 GiB")
    capped = gd404()
    script = capped.stages[0].facts.script
    assert script is not None and script.memory is not None and script.memory.oom is not None
    script.memory.oom.cap_mib = 4096.0
    (c,) = findings_of("GD404", capped)
    assert c.title.endswith("of the 4.00 GiB the process may use (its "
                            "set_per_process_memory_fraction; the GPU holds 80.00 GiB)")
    first = gd404(cached=0.0)  # died in its first step: no optimizer seen, no step ended
    first_script = first.stages[0].facts.script
    assert first_script is not None and first_script.memory is not None
    first_script.optimizers, first_script.memory.peak_mib = [], []
    (f,) = findings_of("GD404", first)
    assert f.evidence["knobs"] == [
        "the step needed 78.17 GiB at least (what tensors held when it failed and its request; "
        "weights, gradients and activations not told apart: it failed before a step ended): "
        "activation checkpointing of the model's blocks, or half the micro-batch with 2 "
        "accumulation steps, cuts what activations hold (--try-fixes measures checkpointing)"]
    (grown,) = findings_of("GD404", gd404(per_step=125.0, cached=4096.0))
    assert grown.evidence["knobs"][0].startswith("memory grew 125.0 MiB a step")
    assert "expandable_segments:True" in grown.evidence["knobs"][1]
    assert "(1) memory grew" in grown.fix and "(2) the allocator held 4.00 GiB" in grown.fix


def test_memory_near_a_cap_is_measured_against_the_cap_with_the_knobs_in_bytes() -> None:
    """A profiled script capped at 24 GiB (set_per_process_memory_fraction) on an 80 GB
    device, reserving 22.5 GiB at its peak: near capacity of what it may use, not of the
    device; the knobs priced in bytes as for an out-of-memory (the optimizer's state, the
    step's own allocations). Without the cap, 28% of the device: nothing."""
    run = gd404(oom=False, numel=200_000_000)
    stage = run.stages[0]
    script = stage.facts.script
    assert script is not None and script.memory is not None
    stage.status, stage.error = "ok", None
    script.memory.peak_mib = [22_000.0] * 40
    script.memory.cap_mib = 24_576.0
    stage.memory = MemoryStats(peak_allocated_mib=22_000.0, peak_reserved_mib=23_000.0,
                               device_total_mib=81_920.0)
    (f,) = findings_of("GD401", run)
    assert f.severity == "warning" and f.title == (
        "Peak reserved memory is 94% of the 24.00 GiB the process may use (its "
        "set_per_process_memory_fraction)")
    knobs = f.evidence["knobs"]
    assert knobs[0].startswith("the allocator held 1,000 MiB cached beyond what tensors used")
    assert knobs[1].startswith("the optimizer's state, 1.49 GiB in fp32")
    assert knobs[2].startswith("the step's own allocations (activations and temporaries), "
                               "~18.50 GiB")  # 22,000 MiB less 16 bytes x 200M elements
    assert "(3) the step's own" in f.fix and "--try-fixes measures both" in f.fix
    script.memory.cap_mib = None
    assert findings_of("GD401", run) == []


def test_memory_growth_says_when_the_device_runs_out_and_is_critical_before_the_plan() -> None:
    """131 MB of logits kept a step (the issue's fine-tuning script) on an 80 GB device: the
    rate, what is held now, and the steps left; critical where those come before the steps
    the run plans, found on a leak every 10 steps too, and on a CPU's resident set."""
    (f,) = findings_of("GD403", gd403(per_step=125.0, planned=100_000))
    assert f.severity == "critical" and f.evidence["mib_per_step"] == pytest.approx(125.0)
    now = f.evidence["now_mib"]
    assert f.evidence["steps_left"] == pytest.approx((80_000 - now) / 125.0, abs=1)
    assert "the GPU runs out in ~" in f.title and "plans 100,000 steps" in f.title
    (f,) = findings_of("GD403", gd403(per_step=125.0, planned=200))
    assert f.severity == "warning"
    (f,) = findings_of("GD403", gd403(per_step=20.0, every=10))
    assert f.evidence["mib_per_step"] == pytest.approx(20.0, rel=0.25)
    (f,) = findings_of("GD403", gd403(per_step=4.0, device="cpu"))
    assert f.evidence["series"] == "resident" and "resident set" in f.title
    assert "the machine runs out" in f.title


def test_a_frameworks_own_per_step_python_is_information_with_the_batch_as_its_knob() -> None:
    """Host-only work charged to a library's own line with no line of the script below the
    loop (Lightning's is_overridden() every step: its loop is the training loop): the same
    share is information, its fix says there is no line to edit and names the batch; GD102
    does not defer to it."""
    run = gd105(share=0.3)
    script = run.stages[0].facts.script
    assert script is not None and script.host is not None
    script.host.lines[0] = dataclasses.replace(
        script.host.lines[0], location="lightning_utilities/core/overrides.py:29",
        function="is_overridden", via="", library=True)
    (f,) = findings_of("GD105", run)
    assert f.severity == "info" and f.evidence["framework"] is True
    assert f.fix.startswith("The framework's own per-step Python "
                            "(lightning_utilities/core/overrides.py:29 in is_overridden()")
    assert "A larger batch amortizes it" in f.fix
    (user,) = findings_of("GD105", gd105(share=0.3))
    assert user.severity != "info" and user.evidence["framework"] is False


def test_an_allocator_that_retried_is_gd405s_not_the_scripts_empty_cache() -> None:
    """cudaFree every step with the allocator's retries counted: the frees are the allocator
    freeing its cache to retry (a capped examples/growing_lengths.py on the H200, which calls
    no empty_cache), named by GD405, never GD402; without retries, the script's (GD402)."""
    retried = gd405(retries=12, frees=1.0)
    assert findings_of("GD402", retried) == []
    (f,) = findings_of("GD405", retried)
    assert f.severity == "warning" and "12 retries after freeing the whole cache" in f.title
    emptied = gd405(frees=1.0, mallocs=1.0)
    assert findings_of("GD405", emptied) == [] and findings_of("GD402", emptied)


def test_memory_that_grows_as_tensors_grow_is_no_kept_tensor_in_the_knobs() -> None:
    """Near capacity with a batch that grows (as many live allocations, larger): the knob says
    the largest step must fit, not "kept by the script"."""
    run = gd403(per_step=4.0)
    stage = run.stages[0]
    script = stage.facts.script
    assert script is not None and script.memory is not None
    script.memory.live_blocks = [100] * 60  # as many tensors every step
    script.memory.cap_mib = 4096.0
    stage.memory = MemoryStats(peak_allocated_mib=2000.0, peak_reserved_mib=3990.0,
                               device_total_mib=80_000.0)
    (f,) = findings_of("GD401", run)
    assert f.evidence["knobs"][0].startswith("memory grew 4.0 MiB a step from step 5 (")
    assert "with as many tensors, larger" in f.evidence["knobs"][0]
    assert "kept by the script" not in f.fix


def test_memory_growth_read_every_few_steps_is_the_rate_between_the_reads() -> None:
    """A short-stepped script's memory read every 4th step (the steps between repeat the last
    read, and the 5 after the last read too): 125 MiB a step, not less for the stale tail."""
    run = gd403(per_step=125.0, steps=34)  # ends before gpudiag's window (35-37)
    script = run.stages[0].facts.script
    assert script is not None and script.memory is not None
    memory = script.memory
    reads = list(range(0, 29, 4))  # the last read at step 28; 29-33 repeat it
    series = [memory.allocated_mib[max(r for r in reads if r <= i)] for i in range(34)]
    memory.allocated_mib, memory.read_steps = series, reads
    (f,) = findings_of("GD403", run)
    assert f.evidence["mib_per_step"] == pytest.approx(125.0)


def test_memory_growth_names_what_keeps_it_at_the_line_that_adds_to_it() -> None:
    """The issue's fine-tuning script: a list gaining 131 MB of logits (with their graphs) a
    step, at its append line, with the fix for that line; a total keeping its graph; and a
    list the counters blur (a CPU's resident set) found by its own bytes a step."""
    (f,) = findings_of("GD403", gd403(per_step=125.0, kept=[kept_list(125.0, graph=True)]))
    assert f.location == "train.py:58" and f.evidence["kept"]["mib_per_step"] == 125.0
    assert f.title.startswith("`history` (a list at train.py:58) gains 1 tensor (125.0 MiB, "
                              "with its autograd graph) a step: memory grows 125.0 MiB")
    assert "`.detach()`" in f.fix and "`.cpu()`" in f.fix and "train.py:58" in f.fix
    (f,) = findings_of("GD403", gd403(per_step=8.0, kept=[
        kept_list(0.0, kind="tensor with its graph"), kept_list(0.5, device="cpu")]))
    assert "`.detach()`" not in f.fix and "`.cpu()`" not in f.fix  # the CPU list's, no graph
    (f,) = findings_of("GD403", gd403(per_step=8.0, kept=[
        kept_list(0.0, kind="tensor with its graph")]))
    assert "keeps its autograd graph" in f.title and "loss.item()" in f.fix
    # A flat (blurred) resident set, a list gaining 4 MiB a step: ~4 MiB x 54 steps counted.
    (f,) = findings_of("GD403", gd403(per_step=0.0, device="cpu",
                                      kept=[kept_list(4.0, device="cpu")]))
    assert f.evidence["rate_from"] == "a kept container" and f.location == "train.py:58"
    assert f.evidence["mib_per_step"] == pytest.approx(4.0)
    assert not findings_of("GD403", gd403(per_step=0.0, device="cpu",
                                          kept=[kept_list(1.0, device="cpu")]))  # 54 MiB
    assert not findings_of("GD403", gd403(per_step=0.0))  # nothing kept, nothing grows


@pytest.mark.parametrize(("share", "severity"), [
    (limit("GD101", "critical_share"), "critical"),
    (limit("GD101", "critical_share") - 0.01, "warning"),
    (limit("GD101", "warning_share"), "warning"),
    (limit("GD101", "warning_share") - 0.01, "info"),
])
def test_loop_severity_follows_its_share_of_the_step(share: float, severity: str) -> None:
    (f,) = findings_of("GD101", gd101(share=share))
    assert f.severity == severity and f.impact == pytest.approx(share)
    assert f.location == "model.py:42"
    assert f.evidence["speedup_if_removed"] == pytest.approx(1 / (1 - share), abs=0.01)


def test_loop_is_priced_by_its_counterfactual_twin() -> None:
    run = gd101(share=0.05)
    loop = run.stages[0]
    loop.iter_ms = [300.0] * 5
    loop.facts.counterfactual = "full-vectorized"
    twin_ev = make_evidence(kernels_per_step=1000.0, memcpy_per_step={"HtoD": 7.0})
    run.stages.append(make_stage("full-vectorized", ms=100.0, evidence=twin_ev))
    (f,) = findings_of("GD101", run)
    assert f.evidence["counterfactual_speedup"] == 3.0
    assert f.evidence["counterfactual_device_ops_per_step"] == 1007.0
    assert f.impact == pytest.approx(2 / 3) and f.severity == "critical"
    assert "full-vectorized runs 3.0x faster" in f.title


def test_a_twin_that_did_not_measure_apart_prices_nothing() -> None:
    """On a loaded CPU the loop stage and its vectorized twin overlapped (issue 38: "full-
    vectorized runs 0.5x faster"): no speedup is quoted, the loop is priced by its share of
    the profiled step, and the finding says the timings were too unsteady to price it by."""
    run = gd101(share=0.4)
    loop = run.stages[0]
    loop.iter_ms = [100.0, 140.0, 180.0, 220.0, 260.0]
    loop.facts.counterfactual = "full-vectorized"
    twin = make_stage("full-vectorized", ms=100.0, evidence=make_evidence())
    twin.iter_ms = [150.0, 200.0, 250.0, 300.0, 350.0]  # "slower": noise
    run.stages.append(twin)
    (f,) = findings_of("GD101", run)
    assert "counterfactual_speedup" not in f.evidence and "faster" not in f.title
    assert f.impact == pytest.approx(0.4)
    assert "did not measure apart" in f.title and "too unsteady" in f.evidence[
        "counterfactual_unsteady"]
    twin.iter_ms = [60.0, 62.0, 64.0, 66.0, 68.0]  # apart: the measured twin prices it
    (f,) = findings_of("GD101", run)
    assert f.evidence["counterfactual_speedup"] == pytest.approx(140.0 / 62.0, abs=0.01)
    assert "counterfactual_unsteady" not in f.evidence


def test_loop_on_the_cpu_counts_operator_calls() -> None:
    line = SourceLine(location="model.py:42", function="apply", direct_calls_per_step=64,
                      ops_per_step=100, syncs_per_step=32, share_of_step_time=0.2,
                      in_loop=True)
    ev = make_evidence(backend="cpu", ops_per_step=400, source_lines=[line])
    (f,) = findings_of("GD101", make_run(make_stage("full-loop", evidence=ev)))
    assert f.evidence["device_ops_per_step"] == 100 and f.evidence["step_device_ops"] == 400
    assert "32 would block the host on a GPU" in f.title
    # Kernels do not count on a CPU run: only operator calls do.
    line.ops_per_step, line.kernels_per_step = 99, 1000
    assert findings_of("GD101", make_run(make_stage("full-loop", evidence=ev))) == []


def test_starved_gpu_with_a_loop_is_only_a_warning() -> None:
    run = gd102(excess=0.6)
    run.stages[1].evidence.source_lines = [  # type: ignore[union-attr]
        loop_source_line(calls=100, ops=500, share=0.3)]
    (f,) = findings_of("GD102", run)
    assert f.severity == "warning" and f.impact == pytest.approx(0.3)
    assert "the Python loop at model.py:42 is why (see GD101)" in f.title
    ranked = [f.id for f in evaluate(run) if f.stage == "full-loop"]
    assert ranked.index("GD101") < ranked.index("GD102")


def test_starved_gpu_never_outranks_its_loop_finding_with_a_counterfactual() -> None:
    run = gd102(excess=0.6)
    loop = run.stages[1]
    loop.evidence.source_lines = [  # type: ignore[union-attr]
        loop_source_line(calls=100, ops=500, share=0.3)]
    loop.facts.counterfactual = "full-vectorized"
    run.stages.append(make_stage("full-vectorized", ms=190.0,
                                 evidence=make_evidence(kernels_per_step=800.0)))
    ranked = [f.id for f in evaluate(run) if f.stage == "full-loop"]
    assert ranked.index("GD101") < ranked.index("GD102"), ranked


def test_host_syncs_leave_the_loops_syncs_to_the_loop_finding() -> None:
    loop = loop_source_line(calls=100, ops=500, share=0.3, syncs=768)
    other = SourceLine(location="train.py:30", function="log", direct_calls_per_step=1,
                       syncs_per_step=3)
    ev = make_evidence(syncs_per_step=771, sync_idle_ms_per_step=40.0,
                       source_lines=[loop, other])
    assert findings_of("GD103", make_run(make_stage("full-loop", evidence=ev))) == []
    other.syncs_per_step, ev.syncs_per_step = 4, 772
    (f,) = findings_of("GD103", make_run(make_stage("full-loop", evidence=ev)))
    assert f.evidence["syncs_per_step"] == 4 and f.location == "train.py:30"
    assert f.evidence["lines"] == {"train.py:30": 4}


def test_host_syncs_are_not_priced_with_the_loops_idle_time() -> None:
    loop = loop_source_line(calls=100, ops=500, share=0.3, syncs=768)
    other = SourceLine(location="train.py:30", function="log", direct_calls_per_step=1,
                       syncs_per_step=4)
    ev = make_evidence(syncs_per_step=772, sync_idle_ms_per_step=40.0,
                       source_lines=[loop, other])
    (f,) = findings_of("GD103", make_run(make_stage("full-loop", evidence=ev)))
    # At most their share of the syncs can be theirs: 4/772 of 40% of the step.
    assert f.impact <= 0.4 * 4 / 772 + 1e-9, f


def test_two_reads_on_the_scripts_own_line_that_idle_the_gpu_are_named() -> None:
    """Two `.item()`s a step, below the count, named where the GPU idles after them, at the
    severity their price earns (a small step: 15% of it on an H200, issue 55; 2% on
    examples/step_reads.py, information there); a library's (no direct call) are not."""
    warning, named = limit("GD103", "warning_idle_share"), limit("GD103", "min_named_idle_share")
    (f,) = findings_of("GD103", gd103(syncs=2, idle_share=warning))
    assert f.severity == "warning" and f.location == "train.py:30"
    assert f.impact == pytest.approx(warning)
    (f,) = findings_of("GD103", gd103(syncs=2, idle_share=named))
    assert f.severity == "info" and f.impact == pytest.approx(named)
    assert findings_of("GD103", gd103(syncs=2, idle_share=named - 1e-3)) == []
    assert findings_of("GD103", gd103(syncs=2, idle_share=warning, direct=0.0)) == []
    assert findings_of("GD103", gd103(syncs=2, idle_share=warning, backend="cpu")) == []
    # `x.to(device)` of a batch blocks on its copy in and reads nothing back: GD202's; so do
    # runs recorded before copies in were told apart from reads.
    assert findings_of("GD103", gd103(syncs=2, idle_share=warning, htod=2.0)) == []
    assert findings_of("GD103", gd103(syncs=2, idle_share=warning, htod=None)) == []
    (f,) = findings_of("GD103", gd103(syncs=3, idle_share=warning, htod=2.0))
    assert f.severity == "warning"


def test_host_syncs_on_the_cpu_are_information_from_lines_that_call_torch() -> None:
    (f,) = findings_of("GD103", gd103(syncs=10, backend="cpu"))
    assert f.severity == "info" and f.impact == 0.0 and f.evidence["syncs_per_step"] == 10
    # A library's internal syncs (no direct torch call on the line) would not block a GPU.
    assert findings_of("GD103", gd103(syncs=10, backend="cpu", direct=0.0)) == []


def test_small_kernels_branch_on_gpm_sm_activity() -> None:
    max_sm = limit("GD104", "max_sm_active_pct")
    ev = make_evidence(kernels_per_step=10.0, idle_fraction=0.05)
    run = make_run(make_stage("train", evidence=ev, kernel_active_pct=80.0,
                              gpm={"sm_active_pct": max_sm - 0.5}))
    (f,) = findings_of("GD104", run)
    assert f.severity == "warning" and f.evidence["sm_active_pct"] == max_sm - 0.5
    assert f.evidence["batch_size"] == 8
    assert f.impact == pytest.approx((1 - (max_sm - 0.5) / 100) * 0.5)
    run.stages[0].telemetry.gpm["sm_active_pct"] = max_sm
    assert findings_of("GD104", run) == []
    run.stages[0].telemetry.gpm["sm_active_pct"] = max_sm - 0.5
    run.stages[0].telemetry.kernel_active_pct = 79.0
    assert findings_of("GD104", run) == []


def test_small_kernels_are_left_to_the_loop_finding() -> None:
    run = gd104(kernels=5000, idle=0.6)
    run.stages[0].evidence.source_lines = [  # type: ignore[union-attr]
        loop_source_line(calls=100, ops=500, share=0.3)]
    assert findings_of("GD104", run) == []


def test_fp32_rung_by_design_is_information() -> None:
    (f,) = findings_of("GD301", gd301(share=0.9, deliberate=True))
    assert f.severity == "info" and "by design" in f.title
    assert f.impact == pytest.approx(0.9 * 0.8)


def test_memory_fragmentation_is_information() -> None:
    frag = limit("GD401", "fragmentation_share")
    (f,) = findings_of("GD401", gd401(reserved_mib=6000.0 + frag * 10_000.0,
                                      allocated_mib=6000.0))
    assert f.severity == "info" and f.evidence["peak_allocated_mib"] == 6000
    assert findings_of("GD401", gd401(reserved_mib=7999.0, allocated_mib=6000.0)) == []


def test_power_cap_is_information() -> None:
    cap = limit("GD501", "power_cap_share")
    (f,) = findings_of("GD501", gd501(power_cap=cap))
    assert f.severity == "info" and "power limit" in f.title
    assert findings_of("GD501", gd501(power_cap=cap - 0.01)) == []
    (hot,) = findings_of("GD501", gd501(thermal=0.5, power_cap=1.0))
    assert hot.severity == "critical" and hot.impact == pytest.approx(0.5 * 0.2)


def test_rules_skip_stages_that_did_not_run() -> None:
    run = gd201(share=0.5)
    run.stages[0].status = "error"
    assert findings_of("GD201", run) == []
    run = gd402(frees=5.0)
    run.stages[0].status = "skipped"
    assert findings_of("GD402", run) == []


# --- Ranking -------------------------------------------------------------------------------


def test_evaluate_ranks_by_severity_then_impact() -> None:
    run = make_run(
        make_stage("a", data_wait_ms=12.0),  # GD201 warning, impact 0.12
        make_stage("b", data_wait_ms=29.0),  # GD201 warning, impact 0.29
        make_stage("c", throttle={"hw_thermal": 0.5}),  # GD501 critical, impact 0.10
        make_stage("d", throttle={"power_cap": 0.9}),  # GD501 info, impact 0
        make_stage("e", memory=MemoryStats(9500.0, 9600.0, 10_000.0)),  # GD401 warning, 0
    )
    ranked = [(f.id, f.stage, f.severity) for f in evaluate(run)]
    assert ranked == [("GD501", "c", "critical"), ("GD201", "b", "warning"),
                      ("GD201", "a", "warning"), ("GD401", "e", "warning"),
                      ("GD501", "d", "info")]
    # Severity first: the critical finding has less impact than the warnings behind it.
    findings = evaluate(run)
    assert findings[0].impact < findings[1].impact


def test_every_stage_of_a_clean_run_is_silent() -> None:
    ev = make_evidence(kernels_per_step=200.0, idle_fraction=0.05, device_ms_per_step=90.0,
                       matmul_ms_by_dtype={"fp16": 60.0}, syncs_per_step=1.0)
    stage = make_stage("train-fp16", evidence=ev, facts=autocast(),
                       power_w=600.0, gpm={"tensor_active_pct": 40.0, "sm_active_pct": 80.0},
                       kernel_active_pct=99.0,
                       memory=MemoryStats(4000.0, 4500.0, 80_000.0), data_wait_ms=1.0)
    assert evaluate(make_run(stage)) == []


def test_starved_gpu_with_host_only_work_ranks_below_its_lines() -> None:
    """GD102 is the symptom when GD105 names the lines holding the host: it says so and ranks
    just below (as it does below a Python loop)."""
    found = [f for f in evaluate(gd105(share=0.5, idle=0.9)) if f.id in ("GD102", "GD105")]
    assert [f.id for f in found] == ["GD105", "GD102"]
    assert "see GD105" in found[1].title and "train.py:20" in found[1].title


def test_fp32_islands_fix_follows_what_ran_in_fp32() -> None:
    """A mask promoting an add gets the dtype advice; autocast's own fp32 softmax and its
    casts get the fused-kernel advice, not a mask's."""
    both = [f for f in evaluate(gd305(share=0.4)) if f.id == "GD305"]
    assert len(both) == 1 and "mask.to(scores.dtype)" in both[0].fix
    assert "scaled_dot_product_attention" in both[0].fix
    assert "casts into fp32" not in both[0].title  # the top line is the promoted add
    run = gd305(share=0.4)
    ev = run.stages[0].evidence
    assert ev is not None
    ev.line_counts = [c for c in ev.line_counts if c.location != "attn.py:31"]
    softmax = [f for f in evaluate(run) if f.id == "GD305"]
    assert len(softmax) == 1 and "mask.to" not in softmax[0].fix
    assert "scaled_dot_product_attention" in softmax[0].fix
    assert "softmax 12.00, casts into fp32 4.00" in softmax[0].title


def test_fp32_islands_split_evenly_gets_both_fixes() -> None:
    """Promoted work and autocast's own fp32 work in equal parts: both causes' advice (keyed
    by share, one overwrote the other)."""
    from gpudiag.diagnose.gd3_precision import _island_fix

    fix = _island_fix({"elementwise": 2.0, "softmax": 2.0})
    assert "mask.to(scores.dtype)" in fix and "scaled_dot_product_attention" in fix


def test_a_per_tensor_optimizer_is_named_with_its_knob_at_its_constructor() -> None:
    (found,) = [f for f in evaluate(gd106()) if f.id == "GD106"]
    assert found.location == "train.py:12" and "AdamW(..., fused=True) at train.py:12" in found.fix
    assert "drop foreach=False" in found.fix and "about 44%" in found.title
    # Built by transformers' Trainer: its argument, at the line that builds the arguments.
    (trainer,) = [f for f in evaluate(gd106(framework="transformers")) if f.id == "GD106"]
    assert trainer.location == "train.py:8"
    assert 'TrainingArguments(..., optim="adamw_torch_fused") at train.py:8' in trainer.fix


def test_the_idle_gpu_and_short_kernels_point_to_the_per_tensor_optimizer() -> None:
    """On a GPU the optimizer's launches are the cause of the idle time and the short kernels
    (GD102, GD104 defer to GD106); its host time is priced only while the GPU idles."""
    ref = make_stage("train-fp16", ms=50.0, facts=autocast(),
                     evidence=make_evidence(idle_fraction=0.1))
    run = gd106(backend="cuda", ops=900.0, launches=1000.0, share=0.6, idle=0.7)
    run.stages.insert(0, ref)
    found = {f.id: f for f in evaluate(run)}
    # min(host share, idle) + its kernels, less the host walk a fused step keeps: one of the
    # 36 operators per tensor.
    kept = 0.6 / 36
    assert found["GD106"].impact == pytest.approx(0.6 - kept)
    assert "AdamW at train.py:12 launches most" in found["GD102"].title
    assert found["GD102"].impact < found["GD106"].impact
    assert "GD104" not in found
    # Half the host's optimizer time hidden behind a busy GPU: only the idle share is priced.
    busy = gd106(backend="cuda", ops=900.0, launches=1000.0, share=0.6, idle=0.2)
    (priced,) = [f for f in evaluate(busy) if f.id == "GD106"]
    assert priced.impact == pytest.approx(0.2 - kept)


def test_the_optimizer_is_priced_less_what_a_fused_step_still_moves() -> None:
    """A fused AdamW still reads and writes every parameter, gradient and moment: 2.5e8 fp32
    elements move 7 GB a step, 1.46 ms at an H200's 4.8 TB/s (its datasheet, no peak stage),
    and still walks its 25 tensors on the host (one of the 8 operators per tensor the
    single-tensor step issues): the price is the optimizer's share less both, an estimate,
    with the share less the traffic as its upper bound. On a CPU no bandwidth is known: the
    traffic is not subtracted, and the price says so."""
    run = gd106(backend="cuda", ops=200.0, launches=250.0, share=0.6, idle=0.7, numel=250_000_000)
    run.env.gpu_name = "NVIDIA H200"
    (found,) = [f for f in evaluate(run) if f.id == "GD106"]
    traffic_ms = 250_000_000 * 7 * 4 / 4800e9 * 1e3
    assert found.evidence["fused_traffic_ms"] == pytest.approx(traffic_ms, abs=1e-3)
    assert found.evidence["fused_host_ms"] == pytest.approx(0.6 * STEP_MS / 8, abs=0.01)
    assert found.impact == pytest.approx(0.6 - traffic_ms / STEP_MS - 0.6 / 8)
    said = str(found.evidence["price"])
    assert said.startswith("estimate") and "4,800 GB/s" in said and "at most 59%" in said
    (on_cpu,) = [f for f in evaluate(gd106(numel=250_000_000)) if f.id == "GD106"]
    assert on_cpu.impact == pytest.approx(0.5 * 7 / 8)
    assert "no memory bandwidth known" in str(on_cpu.evidence["price"])
