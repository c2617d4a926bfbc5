"""The ddp stage: merging recorded per-rank parts, the scaling and no_sync rules on recorded and
hand-built evidence, and real two-rank gloo runs on the CPU."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import invoke, ladder_run, script_run, tiny_config
from tiny_mlp import MODEL as TINY_MLP

from gpudiag.diagnose import evaluate
from gpudiag.measure.plan import build_config
from gpudiag.measure.stages.ddp.launch import _failure_line, launch_command, merge_parts
from gpudiag.model.facts import (
    DdpFacts,
    DdpJobFacts,
    DdpVariant,
    LinkProbe,
    SingleDevice,
    StageFacts,
    Straggler,
)
from gpudiag.model.results import Evidence, RunResult, StageResult
from gpudiag.model.runfile import load_run

PARTS = Path(__file__).resolve().parent / "data" / "ddp-cpu-parts.json"


def _config(**overrides: Any):  # type: ignore[no-untyped-def]
    options: dict[str, Any] = {"model": "bert", "preset": "tiny", "device": "cpu",
                               "stages": ["ddp"], "nproc": 2}
    options.update(overrides)
    return build_config(**options)[0]


def _parts() -> list[dict[str, Any]]:
    return json.loads(PARTS.read_text())


def _info(stage: StageResult) -> DdpFacts:
    assert stage.facts.ddp is not None
    return stage.facts.ddp


def test_merge_recorded_parts() -> None:
    """Two gloo ranks of a tiny BERT with the sweep, recorded on the CPU."""
    stage = merge_parts(_parts(), _config(ddp_sweep=True), "ddp", "title")
    info = _info(stage)
    assert info.world_size == 2 and info.backend == "gloo"
    assert [r.rank for r in info.ranks] == [0, 1]
    parts = _parts()
    # The job's step is, step by step, the slower rank's.
    expected = [max(a, b) for a, b in zip(parts[0]["variants"][0]["iter_ms"],
                                          parts[1]["variants"][0]["iter_ms"], strict=True)]
    assert stage.iter_ms == expected
    assert stage.samples_per_step == 2 * 8
    assert info.single_device is not None and stage.samples_per_s is not None
    single = info.single_device.samples_per_s
    assert info.scaling_efficiency == pytest.approx(stage.samples_per_s / (2 * single))
    assert info.allreduce_probe is not None and info.allreduce_probe.busbw_gbps > 0
    assert (info.transfer_ms_per_step or 0) > 0 and info.allreduce_rounds_per_step == 1
    assert stage.evidence is not None and stage.evidence.collective_calls_per_step >= 1
    names = [row.name for row in info.sweep]
    assert names == ["default", "bucket 100 MB", "accumulate x4 (no_sync)",
                     "gradient_as_bucket_view", "static_graph"]
    assert info.sweep[2].accum == 4


def test_straggler_is_the_rank_with_slow_compute() -> None:
    parts = _parts()
    slow = copy.deepcopy(parts)
    slow[1]["variants"][0]["phases_ms"]["forward"] *= 2
    straggler = _info(merge_parts(slow, _config(), "ddp", "t")).straggler
    assert straggler is not None and straggler.rank == 1 and straggler.ratio >= 1.8
    # ... and GD801 names it: the rule's own threshold decides, not a flag in the facts.
    run = ladder_run(merge_parts(slow, _config(), "ddp", "t"), device="cpu")
    run.stages[0].facts.ddp.scaling_efficiency = 0.5  # type: ignore[union-attr]
    assert _one(run, "GD801")[0].evidence["cause"] == "a straggler"


def test_launch_command_is_torchrun() -> None:
    single = launch_command(_config(), Path("c.json"), Path("out"))
    assert single[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    assert "--standalone" in single and single[-5:-4] == ["gpudiag.measure.stages.ddp.worker"]
    multi = launch_command(_config(nnodes=2, node_rank=1, rdzv_endpoint="host:29400"),
                           Path("c.json"), Path("out"))
    assert multi[multi.index("--rdzv-endpoint") + 1] == "host:29400"
    assert multi[multi.index("--node-rank") + 1] == "1" and "--standalone" not in multi


def test_failure_line_names_the_rank_error() -> None:
    log = ("W1123 warning about OMP_NUM_THREADS\nTraceback (most recent call last):\n"
           "  File x\nRuntimeError: CUDA out of memory\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: boom\n")
    assert _failure_line(log) == "RuntimeError: CUDA out of memory"


# --- Rules on hand-built per-rank evidence -------------------------------------------------


def _ddp_run(*, step: float, single: float, efficiency: float, transfer: float | None = None,
             exposed: float | None = None, overlap: float | None = None,
             straggler_ratio: float = 1.0, sweep: list[dict[str, Any]] | None = None,
             evidence: Evidence | None = None) -> RunResult:
    """A recorded run of a DDP stage on GPUs with these figures."""
    info = DdpFacts(
        world_size=2, per_device_batch=64, accum=1, no_sync="correct",
        grad_bytes_per_round=440_000_000, scaling_efficiency=efficiency,
        single_device=SingleDevice(ms_per_iter=single, samples_per_s=64 / single * 1e3),
        allreduce_probe=LinkProbe(bytes=268435456, ms=70.0, algbw_gbps=3.8, busbw_gbps=3.8),
        transfer_ms_per_step=transfer, exposed_comm_ms_per_step=exposed,
        collective_overlap_fraction=overlap,
        straggler=Straggler(rank=1, ratio=straggler_ratio, compute_ms=30.0,
                            fastest_compute_ms=30.0 / straggler_ratio),
        sweep=[DdpVariant(**row) for row in sweep or []])
    stage = StageResult(name="ddp", status="ok", samples_per_step=128,
                        iter_ms=[step] * 10, facts=StageFacts(ddp=info), evidence=evidence)
    return ladder_run(stage)


def _one(run: RunResult, code: str) -> list:
    return [f for f in evaluate(run) if f.id == code]


def test_sockets_like_run_is_communication_bound() -> None:
    """BERT-base over sockets, hand-built: 33 ms steps become ~133 ms; 0.44 GB of gradients at
    3.8 GB/s take ~116 ms (reports/examples/h200x2-ddp/sockets measured the dgca case)."""
    run = _ddp_run(step=133.0, single=33.3, efficiency=0.25, transfer=116.0, exposed=98.0,
                   overlap=0.2, sweep=[{"name": "default", "scaling_efficiency": 0.25},
                                       {"name": "accumulate x4 (no_sync)",
                                        "scaling_efficiency": 0.6}])
    (f,) = _one(run, "GD801")
    assert f.severity == "critical" and f.evidence["cause"] == "communication"
    assert f.evidence["exposed_comm_share"] == pytest.approx(98 / 133, abs=0.01)
    assert "440 MB" in f.fix and "3.8 GB/s" in f.fix and "fp16_compress_hook" in f.fix
    assert "no_sync()" in f.fix and "only 20%" in f.fix
    assert "accumulate x4 (no_sync) 60%" in f.fix
    assert f.impact == pytest.approx(0.75)


def test_straggler_outranks_communication() -> None:
    run = _ddp_run(step=60.0, single=33.0, efficiency=0.55, transfer=40.0, straggler_ratio=1.3)
    (f,) = _one(run, "GD801")
    assert f.evidence["cause"] == "a straggler" and "rank 1" in f.fix


def test_small_batch_and_unexplained_causes() -> None:
    small = _ddp_run(step=20.0, single=12.0, efficiency=0.6, transfer=1.0)
    assert _one(small, "GD801")[0].evidence["cause"] == "per-device batch too small"
    unexplained = _ddp_run(step=60.0, single=40.0, efficiency=0.67, transfer=2.0)
    assert _one(unexplained, "GD801")[0].evidence["cause"] == "unexplained overhead"


def test_good_scaling_and_one_rank_are_quiet() -> None:
    assert not _one(_ddp_run(step=36.0, single=33.0, efficiency=0.91, transfer=1.0), "GD801")
    run = _ddp_run(step=36.0, single=33.0, efficiency=0.5, transfer=1.0)
    _info(run.stages[0]).world_size = 1
    assert not _one(run, "GD801")


def test_no_sync_misuse_from_microstep_evidence() -> None:
    misuse = Evidence(steps=2, step_ms=100.0, backend="cuda", microsteps_per_step=4.0,
                      microsteps_with_collectives_per_step=4.0, collective_calls_per_step=8.0)
    run = _ddp_run(step=100.0, single=20.0, efficiency=0.9, transfer=40.0, evidence=misuse)
    (f,) = _one(run, "GD802")
    assert f.severity == "warning" and f.evidence["reducing_microsteps_per_step"] == 4.0
    assert f.evidence["wasted_transfer_ms_per_step"] == pytest.approx(30.0)
    assert f.impact == pytest.approx(0.3)
    correct = Evidence(steps=2, step_ms=100.0, backend="cuda", microsteps_per_step=4.0,
                       microsteps_with_collectives_per_step=1.0)
    assert not _one(_ddp_run(step=100.0, single=20.0, efficiency=0.9, evidence=correct), "GD802")


# --- Real two-rank runs --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("no_sync", "misuse"), [("backward-only", True), ("correct", False)])
def test_real_accumulation_no_sync(tmp_path: Path, no_sync: str, misuse: bool) -> None:
    result = invoke(["run", "--no-plots", "--model", TINY_MLP, "--preset", "tiny", "--device",
                     "cpu", "--stages", "ddp", "--nproc", "2", "--iters", "4", "--quiet",
                     "--ddp-accum", "3", "--ddp-no-sync", no_sync, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    run = load_run(tmp_path)
    assert run.stages[0].ok, (run.stages[0].error, run.stages[0].traceback)
    info = _info(run.stages[0])
    assert info.allreduce_rounds_per_step == (3 if misuse else 1)
    assert bool([f for f in run.findings if f.id == "GD802"]) == misuse
    # A real two-rank gloo job, merged: both ranks, a scaling figure, the report's section.
    assert info.world_size == 2 and len(info.ranks) == 2
    assert 0 < (info.scaling_efficiency or 0) < 2
    report = (tmp_path / "report.md").read_text()
    assert "### Communication per rank" in report
    # Each rank's memory, labelled: on a CPU its process's resident set at its highest (torch
    # and the model loaded: hundreds of MiB), the two side by side in report.md.
    assert all((r.peak_resident_mib or 0) > 100 and r.peak_allocated_mib is None
               for r in info.ranks)
    assert run.stages[0].memory is None  # no allocator's figures on a CPU
    assert "### Memory by rank: ddp" in report and "holds 1." in report


def test_bad_ddp_options_are_one_line_errors() -> None:
    bad = invoke(["run", "--device", "cpu", "--stages", "ddp", "--nnodes", "2"])
    assert bad.exit_code == 2 and "--rdzv-endpoint" in bad.output
    bad = invoke(["run", "--device", "cpu", "--stages", "ddp",
                              "--ddp-no-sync", "sometimes"])
    assert bad.exit_code == 2 and "--ddp-no-sync" in bad.output


# --- Profile mode: ranks of one job, each with its own window ---------------------------------


def _rank(rank: int, *, step: float, exposed: float, compute: float, window: float = 200.0,
          probe: float | None = 297.0, grad: int = 440_000_000) -> StageResult:
    """One profiled rank; the window's host is slower than the timed step (`window`)."""
    evidence = Evidence(steps=3, step_ms=window, backend="cuda", window_step_ms=window,
                        collective_calls_per_step=4.0, collective_ms_per_step=exposed * 1.4,
                        collective_wall_ms_per_step=exposed + 5.0,
                        collective_exposed_ms_per_step=exposed,
                        collective_overlap_fraction=0.1, compute_busy_ms_per_step=compute)
    job = DdpJobFacts(grad_bytes=grad, bucket_mb=25.0, world_size=2, backend="nccl",
                      allreduce_probe=None if probe is None else LinkProbe(
                          bytes=grad, ms=grad / probe / 1e6, algbw_gbps=probe,
                          busbw_gbps=probe))
    return StageResult(name=f"train.py[rank{rank}]", status="ok",
                       iter_ms=[step] * 10, samples_per_step=2, evidence=evidence,
                       facts=StageFacts(ddp_job=job))


def _job(*ranks: StageResult) -> RunResult:
    """A profiled DDP job of `ranks`, on GPUs."""
    return script_run(*ranks, device="cuda")


def test_profiled_job_bound_by_a_slow_link_names_communication_with_its_figures() -> None:
    # 440 MB per step over sockets; rank 0 arrives last (72 ms held), rank 1 also waits 3 ms.
    run = _job(_rank(0, step=120.0, exposed=72.0, compute=30.0, probe=3.8),
               _rank(1, step=120.0, exposed=75.0, compute=30.5, probe=3.8))
    (f,) = _one(run, "GD803")
    assert f.severity == "critical" and f.stage == "train.py[rank0]"
    assert f.evidence["exposed_share"] == pytest.approx(0.6)
    assert f.evidence["exposed_ms_per_step"] == pytest.approx(72.0)
    assert f.evidence["step_without_exposed_ms"] == pytest.approx(48.0)
    assert f.evidence["rank_waits_ms_per_step"] == {0: 0.0, 1: 3.0}
    assert f.evidence["probe_busbw_gbps"] == pytest.approx(3.8)
    assert "440 MB" in f.fix and "no_sync()" in f.fix and "fp16_compress_hook" in f.fix
    assert not _one(run, "GD804")
    assert all(0 <= x.impact <= 1 for x in evaluate(run))


def test_waiting_for_a_rank_that_lags_in_the_window_is_not_communication() -> None:
    """Seen on two H200s: rank 0 spent 62 ms per window step in NCCL kernels waiting for rank
    1's slower host, rank 1 held them 2.8 ms; the job is not communication-bound."""
    run = _job(_rank(0, step=52.9, exposed=62.0, compute=7.4),
               _rank(1, step=52.8, exposed=2.8, compute=7.0))
    assert not _one(run, "GD803")


def test_all_reduce_far_below_the_link_is_called_latency_bound() -> None:
    run = _job(_rank(0, step=40.0, exposed=16.0, compute=20.0, grad=4_000_000),
               _rank(1, step=40.0, exposed=16.0, compute=20.0, grad=4_000_000))
    (f,) = _one(run, "GD803")
    assert f.evidence["effective_busbw_gbps"] < 0.5 * 297
    # 4 MB of gradients fit DDP's one 25 MB bucket: a bigger bucket cannot help, and the
    # advice says so rather than "raise bucket_cap_mb".
    assert "fit one bucket already (bucket_cap_mb 25)" in f.fix and "raise" not in f.fix
    many = _job(_rank(0, step=400.0, exposed=160.0, compute=200.0, grad=400_000_000, probe=2970),
                _rank(1, step=400.0, exposed=160.0, compute=200.0, grad=400_000_000, probe=2970))
    (g,) = _one(many, "GD803")
    assert "raise bucket_cap_mb, now 25 MB" in g.fix


def test_a_rank_waiting_for_a_slower_rank_is_a_straggler_not_the_network() -> None:
    # Rank 1 computes 60 ms, rank 0 computes 30 ms and waits ~30 ms in the all-reduce.
    run = _job(_rank(0, step=70.0, exposed=36.0, compute=30.0),
               _rank(1, step=70.0, exposed=4.0, compute=60.0))
    (f,) = _one(run, "GD804")
    assert f.stage == "train.py[rank1]" and f.evidence["slow_rank"] == 1
    assert f.evidence["compute_ratio"] == pytest.approx(2.0)
    assert "waiting, not transfer" in f.fix
    assert not _one(run, "GD803")


def _gloo_probed_rank(rank: int, held: float, probe_ms: float) -> StageResult:
    """A rank of a 2-rank gloo job of 264 bytes of gradients, 5 ms steps, on a loaded CPU:
    gloo's wall time `held` a step, its probe's all-reduce of those bytes `probe_ms`."""
    stage = _rank(rank, step=5.0, exposed=0.0, compute=2.0)
    assert stage.evidence is not None and stage.facts.ddp_job is not None
    stage.evidence.backend, stage.evidence.collective_wall_ms_per_step = "cpu", held
    stage.evidence.collective_calls_per_step, stage.evidence.window_step_ms = 1.0, 5.0
    stage.facts.ddp_job = DdpJobFacts(
        grad_bytes=264, bucket_mb=25.0, world_size=2, backend="gloo",
        allreduce_probe=LinkProbe(bytes=264, ms=probe_ms, algbw_gbps=264 / probe_ms / 1e6,
                                  busbw_gbps=264 / probe_ms / 1e6))
    return stage


def test_ranks_taking_turns_to_wait_on_a_loaded_cpu_are_not_communication_bound() -> None:
    """Lightning's 2-rank DDP on a loaded 2-core VM (issue 55): gloo held the all-reduce 1.7
    and 3.1 ms of a 5 ms step on its ranks, each descheduled in turn, so neither rank's mean is
    the transfer; GD803 warned "the all-reduce holds 34% of each step". The job's own probe
    all-reduced its 264 bytes in 0.77 ms: the transfer is at most that. Where the probe takes
    as long as the least held time, the job is communication-bound again."""
    waits = script_run(_gloo_probed_rank(0, 1.7, 0.77), _gloo_probed_rank(1, 3.1, 0.77))
    assert not _one(waits, "GD803")
    slow = script_run(_gloo_probed_rank(0, 1.7, 1.8), _gloo_probed_rank(1, 3.1, 1.8))
    (f,) = _one(slow, "GD803")
    assert f.evidence["exposed_ms_per_step"] == pytest.approx(1.7)
    assert f.evidence["probed_ms_per_step"] == pytest.approx(1.8)
    probed = script_run(_gloo_probed_rank(0, 3.0, 1.6), _gloo_probed_rank(1, 3.1, 1.6))
    (g,) = _one(probed, "GD803")
    assert g.evidence["exposed_ms_per_step"] == pytest.approx(1.6)
    assert "the rest waiting for each other" in g.title


def test_a_healthy_profiled_job_gets_no_communication_finding() -> None:
    run = _job(_rank(0, step=50.0, exposed=2.5, compute=45.0),
               _rank(1, step=50.0, exposed=3.0, compute=45.5))
    assert not _one(run, "GD803") and not _one(run, "GD804")


def test_merged_ddp_stage_takes_the_least_exposed_rank_and_no_share_exceeds_one() -> None:
    parts = _parts()
    for part, exposed in zip(parts, (90.0, 20.0), strict=True):
        ev = part["variants"][0]["evidence"]
        ev.update(backend="cuda", collective_exposed_ms_per_step=exposed, window_step_ms=100.0)
    info = _info(merge_parts(parts, _config(), "ddp", "t"))
    assert info.exposed_comm_ms_per_step == 20.0
    assert info.exposed_comm_share is not None and 0 <= info.exposed_comm_share <= 1
    assert [r.collective_exposed_ms_per_step for r in info.ranks] == [90.0, 20.0]


# --- The recorded two-H200 runs (reports/examples/h200x2-ddp, benchmarks/ddp_two_gpus.sh) ----

H200X2 = Path(__file__).resolve().parent.parent / "reports" / "examples" / "h200x2-ddp"


def _shares(value: Any) -> list[float]:
    """Every number under a key naming a share, anywhere in a nested structure."""
    found: list[float] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if "share" in str(key) and isinstance(item, (int, float)):
                found.append(float(item))
            found += _shares(item)
    elif isinstance(value, list):
        for item in value:
            found += _shares(item)
    return found


@pytest.mark.parametrize(("name", "efficiency"), [("nvlink", 0.919), ("sockets", 0.275)])
def test_recorded_two_gpu_ddp_runs(name: str, efficiency: float) -> None:
    """Two H200s: within 10 points of an independent user's measurement of the same job."""
    run = load_run(H200X2 / name)
    stage = run.stage("ddp")
    assert stage is not None and stage.ok and "H200" in (run.env.gpu_name or "")
    info = _info(stage)
    assert info.world_size == 2 and abs((info.scaling_efficiency or 0) - efficiency) <= 0.10
    findings = evaluate(run)
    material = [f for f in findings if f.severity != "info"]
    if name == "sockets":
        assert material[0].id == "GD801" and material[0].evidence["cause"] == "communication"
    else:
        assert not material, material


def test_recorded_profiles_of_ddp_jobs() -> None:
    comm = evaluate(load_run(H200X2 / "profile-small-batch-sockets"))
    top = comm[0]
    assert top.id == "GD803" and top.evidence["probe_busbw_gbps"] > 0
    assert 0.3 <= top.evidence["exposed_share"] <= 1
    healthy = evaluate(load_run(H200X2 / "profile-large-batch"))
    assert not [f for f in healthy if f.severity != "info"]


def test_no_share_above_one_in_any_recorded_two_gpu_run() -> None:
    for path in sorted(H200X2.glob("*/run.json")):
        data = json.loads(path.read_text())
        shares = _shares(data)
        assert shares and all(0 <= s <= 1 for s in shares), path
        for line in (path.parent / "report.md").read_text().splitlines():
            for number in re.findall(r"(\d+(?:\.\d+)?)% of (?:each|the) step", line):
                assert float(number) <= 100, line


NO_SYNC_RUNS = Path(__file__).resolve().parent.parent / "reports" / "examples" / \
    "h200x2-ddp-no-sync"


@pytest.mark.parametrize("transport", ["nvlink", "sockets"])
def test_recorded_accumulation_without_no_sync_is_priced_as_the_plain_ab_measured(
        transport: str) -> None:
    """Two H200s, 8 micro-steps each all-reducing: GD802 at the script's backward() line,
    its price within 25% of what no_sync() saved by the script's own timer (interleaved
    runs, reports/examples/h200x2-ddp-no-sync), ahead of the communication it causes."""
    run = load_run(NO_SYNC_RUNS / transport)
    found = evaluate(run)
    (misuse,) = [f for f in found if f.id == "GD802"]
    assert misuse.location == "examples/tiny_ddp.py:46" and "model.no_sync()" in misuse.fix
    timed: dict[str, list[float]] = {"0": [], "1": []}
    for line in (NO_SYNC_RUNS / f"ab-{transport}.txt").read_text().splitlines():
        side, _, figures = line.partition(" SCRIPT_TIMER ")
        timed[side.removeprefix("no_sync=")].append(json.loads(figures)["median_ms"])
    saved = 1 - sum(timed["1"]) / sum(timed["0"])
    assert misuse.impact == pytest.approx(saved, rel=0.25)
    for comm in (f for f in found if f.id == "GD803"):
        assert found.index(misuse) < found.index(comm) and "no_sync()" in comm.fix


@pytest.mark.parametrize("idle", [0.2, 0.8])
def test_accumulation_on_a_host_bound_gpu_is_priced_as_a_lower_bound(idle: float) -> None:
    """Four micro-steps each all-reducing, 0.4 ms of collectives exposed in a 10 ms step:
    a GPU that mostly waits for the host pays each round's reducer work on the host too, so
    the exposed time (3% of the step) is a lower bound, said so, and at least a warning."""
    def rank(index: int) -> StageResult:
        stage = _rank(index, step=10.0, exposed=0.4, compute=2.0, window=30.0)
        assert stage.evidence is not None
        stage.evidence.microsteps_per_step = 4.0
        stage.evidence.microsteps_with_collectives_per_step = 4.0
        stage.evidence.idle_fraction = idle
        return stage
    (f,) = _one(_job(rank(0), rank(1)), "GD802")
    bound = idle >= 0.5
    assert f.impact == pytest.approx(0.03)
    assert ("exposed 3% of the step" in f.title and "not priced" in f.title) == bound
    assert f.severity == ("warning" if bound else "info")
    assert f.evidence["price"].startswith("lower bound") == bound


# --- Profiled gloo jobs: a rank's collective time is its wait for a later rank plus transfer --


def _gloo_rank(rank: int, calls: list[float], *, step: float = 50.0, window: float = 50.0,
               steps: int = 2) -> StageResult:
    """One profiled rank of a two-rank gloo job: each collective's own time in the window,
    call by call (two all-reduces a step), their union the sum (no two overlap)."""
    evidence = Evidence(steps=steps, step_ms=window, backend="cpu", window_step_ms=window,
                        collective_calls_per_step=len(calls) / steps,
                        collective_ms_per_step=sum(calls) / steps,
                        collective_wall_ms_per_step=sum(calls) / steps,
                        collective_ms_by_call=calls)
    job = DdpJobFacts(grad_bytes=4_000_000, bucket_mb=25.0, world_size=2, backend="gloo")
    return StageResult(name=f"train.py[rank{rank}]", status="ok", iter_ms=[step] * 10,
                       samples_per_step=2, evidence=evidence, facts=StageFacts(ddp_job=job))


def _numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))]


def test_a_gloo_rank_waiting_for_a_slowed_rank_is_not_priced_as_transfer() -> None:
    """Rank 1 sleeps before each forward: rank 0 sits ~37 ms in each all-reduce for it, the
    transfer is the 3-4 ms rank 1 (the last to arrive) holds them. Not communication-bound;
    the wait is the straggler's, priced by its longest call a step (the calls wait for the
    same late rank at once), not the sum of both."""
    run = script_run(_gloo_rank(0, [40.0, 41.0, 38.0, 42.0], step=60.0, window=60.0),
                     _gloo_rank(1, [3.0, 4.0, 3.0, 4.0], step=60.0, window=60.0), device="cpu")
    assert not _one(run, "GD803")
    (f,) = _one(run, "GD804")
    assert f.stage == "train.py[rank1]" and f.evidence["slow_rank"] == 1
    assert f.evidence["transfer_ms_per_step"] == pytest.approx(7.0)
    assert f.evidence["fast_rank_waits_ms_per_step"] == pytest.approx((37 + 38) / 2)
    assert f.impact == pytest.approx(37.5 / 60, abs=0.01) and f.severity == "critical"
    assert "waits 37.5 ms per step" in f.title and "waiting, not transfer" in f.fix


def test_a_gloo_job_bound_by_its_transfer_is_priced_on_the_transfer_alone() -> None:
    """Each rank is late in one step of two (the other waits 10 ms in both its calls): each
    holds its collectives 30 ms a step, but call by call the least is 20 ms a step, the
    transfer: 40% of a 50 ms window step, 18 ms of the 45 ms timed step. The waits (5 ms a
    step, 4.5 in the timed step) are named, not priced."""
    run = script_run(_gloo_rank(0, [10.0, 10.0, 20.0, 20.0], step=45.0),
                     _gloo_rank(1, [20.0, 20.0, 10.0, 10.0], step=45.0), device="cpu")
    (f,) = _one(run, "GD803")
    assert f.evidence["exposed_share"] == pytest.approx(0.4)
    assert f.evidence["exposed_ms_per_step"] == pytest.approx(18.0)
    assert f.evidence["step_without_exposed_ms"] == pytest.approx(27.0)
    assert f.evidence["rank_waits_ms_per_step"] == {0: 4.5, 1: 4.5}
    assert f.impact == pytest.approx(0.4) and f.severity == "warning"
    assert "transfer holds 40% of each step (18.0 of 45.0 ms)" in f.title
    assert "rank 0 waits 4.5 ms per step" in f.title and "see GD804" in f.title
    assert ">= 6 micro-steps" in f.fix  # 0.9 / 0.1 x 0.4 / 0.6
    assert not _one(run, "GD804")


def test_cpu_ranks_that_take_turns_being_late_have_no_straggler() -> None:
    """Lightning's 2 ranks on a loaded 2-core CI machine (issue 55): the scheduler makes each
    late in turn, so each waits long in some steps; no rank's own work is slower, and GD804
    stays silent. The same waits, always rank 0's, name rank 1."""
    turns = script_run(_gloo_rank(0, [30.0, 1.0, 30.0, 1.0, 30.0, 1.0], steps=6),
                       _gloo_rank(1, [1.0, 30.0, 1.0, 30.0, 1.0, 31.0], steps=6), device="cpu")
    assert not _one(turns, "GD804")
    steady = script_run(_gloo_rank(0, [30.0, 30.0, 30.0, 30.0, 30.0, 1.0], steps=6),
                        _gloo_rank(1, [1.0, 1.0, 1.0, 1.0, 1.0, 30.0], steps=6), device="cpu")
    (f,) = _one(steady, "GD804")
    assert f.evidence["slow_rank"] == 1 and f.severity == "warning"
    # Two ranks on a 2-core machine compete for its cores: a steady late rank may be the
    # scheduler's doing there, said as information.
    steady.env.cpu_count = 2
    (g,) = _one(steady, "GD804")
    assert g.severity == "info" and "its 2 ranks share 2 CPU cores" in g.title


def test_collectives_held_longer_than_the_step_give_no_impossible_figures() -> None:
    """The issue's run: gloo held 12.7 ms of a 12.4 ms timed step (window 12.0 ms): the share
    is at most the whole step, nothing is negative, and no accumulation count is divided out
    of a step with nothing left beside its collectives."""
    run = script_run(_gloo_rank(0, [6.4, 6.4], step=12.4, window=12.0, steps=1),
                     _gloo_rank(1, [6.35, 6.5], step=12.3, window=12.0, steps=1), device="cpu")
    (f,) = _one(run, "GD803")
    assert f.evidence["exposed_share"] == 1.0 and f.impact <= 1
    assert f.evidence["exposed_ms_per_step"] == pytest.approx(12.4)
    assert all(n >= 0 for n in _numbers(f.title + f.fix))
    assert "100% of each step (12.4 of 12.4 ms)" in f.title and "no less than" not in f.title
    assert "how many cannot be estimated" in f.fix and ">=" not in f.fix
    assert all(0 <= x.impact <= 1 for x in evaluate(run))


def test_ranks_that_timed_different_calls_fall_back_to_the_rank_that_held_them_least() -> None:
    run = script_run(_gloo_rank(0, [30.0, 30.0, 30.0, 30.0]),
                     _gloo_rank(1, [25.0, 25.0, 25.0], steps=2), device="cpu")
    (f,) = _one(run, "GD803")
    assert f.evidence["exposed_ms_per_step"] == pytest.approx(37.5)
    assert f.evidence["rank_waits_ms_per_step"] == {0: 22.5, 1: 0.0}


def test_scaling_cause_gives_no_count_when_communication_fills_the_step() -> None:
    run = _ddp_run(step=20.0, single=5.0, efficiency=0.3, transfer=30.0)
    (f,) = _one(run, "GD801")
    assert f.evidence["cause"] == "communication" and f.evidence["exposed_comm_share"] == 1.0
    assert "how many cannot be estimated" in f.fix and "accumulate >=" not in f.fix


DATA = Path(__file__).resolve().parent / "data"


def test_recorded_gloo_job_with_a_slowed_rank_names_the_wait_not_the_transfer() -> None:
    """examples/tiny_ddp.py profiled on two CPU ranks, rank 1 sleeping 60 ms before each
    forward: rank 0 sits ~85 ms a step in its all-reduces, ~50 ms is their transfer."""
    run = load_run(DATA / "gloo-rank1-sleeps-60ms.json")
    found = evaluate(run)
    assert not [f for f in found if f.id == "GD803"]
    (f,) = [f for f in found if f.id == "GD804"]
    assert f.evidence["slow_rank"] == 1 and f.evidence["fast_rank"] == 0
    assert f.evidence["transfer_ms_per_step"] < f.evidence["fast_rank_waits_ms_per_step"]
    assert f.evidence["fast_rank_waits_ms_per_step"] < max(s.ms_per_iter or 0 for s in run.stages)
    assert "waiting, not transfer" in f.fix


def test_recorded_gloo_job_is_priced_on_its_transfer_within_the_step() -> None:
    run = load_run(DATA / "gloo-tiny-ddp.json")
    found = evaluate(run)
    (f,) = [f for f in found if f.id == "GD803"]
    step = f.evidence["step_ms"]
    assert 0 < f.evidence["exposed_ms_per_step"] <= step and 0 < f.evidence["exposed_share"] <= 1
    assert f.evidence["step_without_exposed_ms"] >= 0
    held = min(s.evidence.collective_wall_ms_per_step / s.evidence.window_step_ms * step
               for s in run.stages if s.evidence is not None)
    assert f.evidence["exposed_ms_per_step"] < held  # a rank's time in them is wait + transfer
    assert all(n >= 0 for n in _numbers(f.title + f.fix))
    assert re.search(r">= \d+ micro-steps", f.fix)
    assert all(0 <= x.impact <= 1 for x in found)


@pytest.mark.parametrize(("late_ms", "named"), [(9.9, False), (10.1, True)])
def test_a_gloo_wait_is_a_straggler_once_it_is_half_the_waiting_ranks_collective_time(
        late_ms: float, named: bool) -> None:
    """Transfer 10 ms a step (two 5 ms calls); rank 0 waits `late_ms` in one call a step."""
    run = script_run(_gloo_rank(0, [5.0 + late_ms, 5.0] * 2, step=60.0, window=60.0),
                     _gloo_rank(1, [5.0, 5.0] * 2, step=60.0, window=60.0), device="cpu")
    assert bool(_one(run, "GD804")) == named and not _one(run, "GD803")


def test_a_rank_that_aborts_after_every_rank_wrote_its_results_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo torn down under a peer aborts a rank on its way out (SIGABRT, rank 0 in a CPU CI
    run, before it gathered the parts): torchrun exits 1, but every rank's results are
    written, and the stage keeps them; with one rank's missing it fails, saying why."""
    from gpudiag.measure.stages.ddp import launch

    written: list[int] = []

    class Launched:
        def __init__(self, command: list[str], **_: object) -> None:
            out = Path(command[command.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            for rank in written:
                (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank}))

    monkeypatch.setattr(launch.subprocess, "Popen", Launched)
    monkeypatch.setattr(launch, "wait_child", lambda process: (1, None))
    config = tiny_config(stages=["ddp"], nproc=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    written[:] = [0, 1]
    assert launch.launch_ranks(config, tmp_path / "a") == [{"rank": 0}, {"rank": 1}]
    written[:] = [1]
    with pytest.raises(launch.LaunchError, match=r"torch\.distributed\.run exited 1"):
        launch.launch_ranks(config, tmp_path / "b")
