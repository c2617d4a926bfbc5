"""Checkpoint stalls: spike and period detection on synthetic series, the two checkpoint rules on
hand-built runs, and real tiny runs of checkpoint-sync and checkpoint-async."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
from conftest import invoke, ladder_run

from gpudiag.diagnose import evaluate
from gpudiag.diagnose.spikes import detect_period, find_spikes, lost_share
from gpudiag.model.facts import CheckpointFacts, SaveRecord
from gpudiag.model.results import RunResult, StageResult
from gpudiag.model.runfile import load_run


def _series(n: int = 120, base: float = 50.0, noise: float = 0.02, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return base * (1 + noise * rng.standard_normal(n))


def _periodic(period: int = 10, stall: float = 60.0, **kw: object) -> list[float]:
    times = _series(**kw)  # type: ignore[arg-type]
    times[period - 1::period] += stall
    return times.tolist()


def test_periodic_spikes_are_found_with_their_period() -> None:
    for period in (3, 7, 10, 25):
        times = _periodic(period)
        spikes = find_spikes(times)
        assert spikes.indices == list(range(period - 1, 120, period))
        found = detect_period(spikes.indices, len(times))
        assert found is not None and (found.steps, found.phase) == (period, period - 1)


def test_one_missed_save_still_reads_as_periodic() -> None:
    indices = [i for i in range(9, 120, 10) if i != 49]
    found = detect_period(indices, 120)
    assert found is not None and found.steps == 10 and found.hits == len(indices)


def test_random_spikes_are_not_called_periodic() -> None:
    """The same number of spikes at random steps: no period, over many draws."""
    called = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        times = _series(seed=seed)
        times[rng.choice(120, size=12, replace=False)] += 60.0
        spikes = find_spikes(times.tolist())
        called += detect_period(spikes.indices, len(times)) is not None
    assert called == 0


def test_few_or_no_spikes_have_no_period() -> None:
    assert find_spikes(_series().tolist()).indices == []
    assert detect_period([9, 19], 120) is None
    assert detect_period([], 120) is None


def test_lost_share_is_checkfreq_overhead() -> None:
    times = [10.0] * 9 + [40.0]
    assert lost_share(times) == pytest.approx((130 - 100) / 100)
    assert lost_share(times, baseline_ms=13.0) == pytest.approx(0.0)


# --- Rules on hand-built runs --------------------------------------------------------------


def _stage(name: str, times: list[float], checkpoint: CheckpointFacts | None = None,
           ) -> StageResult:
    stage = StageResult(name=name, status="ok", iter_ms=times, samples_per_step=128)
    if checkpoint is not None:
        stage.facts.checkpoint = checkpoint
    return stage


def _findings(run: RunResult, code: str) -> list:
    return [f for f in evaluate(run) if f.id == code]


def test_stall_rule_from_step_times_alone() -> None:
    """No save records (any run, e.g. a profiled script): found from the period alone."""
    found = _findings(ladder_run(_stage("train", _periodic(10, stall=60.0))), "GD701")
    assert len(found) == 1
    f = found[0]
    assert f.severity == "warning" and f.evidence["source"] == "step times alone"
    assert f.evidence["period_steps"] == 10 and f.evidence["saves"] == 12
    assert f.evidence["stall_ms_per_save"] == pytest.approx(60.0, rel=0.1)
    # 60 ms every 10 steps of 50 ms: 12% lost; 3% needs a save every 40 steps or more.
    assert f.evidence["lost_share"] == pytest.approx(0.12, abs=0.015)
    assert 38 <= f.evidence["interval_for_3pct"] <= 42
    assert "every >= " in f.fix and "async" in f.fix.lower()


def test_random_spikes_and_steady_steps_are_not_stalls() -> None:
    rng = np.random.default_rng(3)
    times = _series()
    times[rng.choice(120, size=8, replace=False)] += 60.0
    assert not _findings(ladder_run(_stage("train", times.tolist())), "GD701")
    assert not _findings(ladder_run(_stage("train", _series().tolist())), "GD701")


def _records(times: list[float], every: int, blocking: float, total: float, mode: str,
             waited: float = 0.0) -> CheckpointFacts:
    return CheckpointFacts(mode=mode, every=every, saves=[
        SaveRecord(step=i, blocking_ms=blocking, waited_ms=waited, total_ms=total,
                   bytes=1_300_000_000, write_gbps=1.3e9 / total / 1e6)
        for i in range(every - 1, len(times), every)])


def test_sync_stage_priced_from_its_save_records() -> None:
    times = _periodic(10, stall=400.0)
    stage = _stage("checkpoint-sync", times, _records(times, 10, 400.0, 400.0, "sync"))
    f = _findings(ladder_run(stage), "GD701")[0]
    assert f.severity == "critical" and f.evidence["source"] == "save records"
    assert f.evidence["stall_ms_per_save"] == pytest.approx(400.0, rel=0.05)
    assert f.evidence["lost_share"] == pytest.approx(400 / 500, rel=0.05)
    assert f.evidence["bytes_per_save"] == 1_300_000_000 and f.evidence["mode"] == "sync"


def test_async_saves_that_queue_are_flagged() -> None:
    """Saves take 900 ms but start every 10 steps of 50 ms: each waits ~400 ms."""
    times = _series()
    times[9::10] += 400.0
    stage = _stage("checkpoint-async", times.tolist(),
                   _records(times.tolist(), 10, 402.0, 900.0, "async", waited=400.0))
    found = _findings(ladder_run(stage), "GD702")
    assert len(found) == 1 and found[0].severity == "warning"
    assert found[0].evidence["saves_waited"] == 12
    assert "save every >= 19 steps" in found[0].fix


def test_async_writes_that_slow_training_are_flagged() -> None:
    """No waits, but the two steps after each save run 40% slower while the write runs."""
    times = _series()
    for start in range(10, 120, 10):
        times[start:start + 2] *= 1.4
    stage = _stage("checkpoint-async", times.tolist(),
                   _records(times.tolist(), 10, 1.0, 90.0, "async"))
    found = _findings(ladder_run(stage), "GD702")
    assert len(found) == 1
    f = found[0]
    assert f.evidence["saves_waited"] == 0 and f.evidence["steps_during_write"] == 12 + 22
    # On average over the overlapped steps: 22 of 34 are 40% slower (the saving steps are not).
    assert f.evidence["slowdown_during_write"] == pytest.approx(0.4 * 22 / 34, abs=0.04)
    assert f.evidence["lost_share"] == pytest.approx(22 * 20 / 6000, rel=0.15)
    assert "competes" in f.fix


def test_quiet_async_saving_is_not_flagged() -> None:
    times = _series().tolist()
    stage = _stage("checkpoint-async", times, _records(times, 10, 1.0, 90.0, "async"))
    run = ladder_run(stage)
    assert not _findings(run, "GD702")
    assert not _findings(run, "GD701")


# --- Real tiny runs ------------------------------------------------------------------------


@pytest.mark.slow
def test_real_tiny_checkpoint_stages(tmp_path: Path) -> None:
    """A 2 MB tiny checkpoint every 3 steps of ~20 ms: the blocking save holds the step for
    all of its write, the asynchronous one for its copies only, never a warning-level stall.
    The blocking save's share of the run is not asserted: on a loaded machine the steps slow
    more than the page-cache write does (8 ms a save was 4% of 3 steps, under the 5% warning)."""
    out = tmp_path / "run"
    result = invoke([
        "run", "--no-plots", "--device", "cpu", "--preset", "tiny", "--stages",
        "checkpoint-sync,checkpoint-async", "--checkpoint-every", "3", "--iters",
        "60", "--evidence-steps", "0", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    run = load_run(out)
    for name, mode in (("checkpoint-sync", "sync"), ("checkpoint-async", "async")):
        stage = run.stage(name)
        assert stage is not None and stage.ok and len(stage.iter_ms) >= 60
        info = stage.facts.checkpoint
        assert info is not None and info.mode == mode and info.every == 3
        assert [s.step for s in info.saves] == list(range(2, len(stage.iter_ms), 3))
        assert all((s.bytes or 0) > 1_000_000 and (s.total_ms or 0) > 0 for s in info.saves)
    assert [f for f in run.findings if f.id == "GD701" and f.stage == "checkpoint-sync"]
    sync, both = (stage.facts.checkpoint for stage in run.stages)
    assert sync is not None and sync.mode == "sync" and both is not None
    # Blocking: the step waits for the whole save; asynchronous: for a fraction of its own.
    assert all(s.blocking_ms >= 0.9 * (s.total_ms or 0) for s in sync.saves)
    assert statistics.median(s.blocking_ms for s in both.saves) < 0.5 * statistics.median(
        s.blocking_ms for s in sync.saves)
    assert not [f for f in run.findings if f.id == "GD701" and f.stage == "checkpoint-async"
                and f.severity != "info"]
    assert not (out / "checkpoints").exists()  # removed unless --keep-checkpoints


@pytest.mark.slow
def test_keep_checkpoints_and_bad_interval(tmp_path: Path) -> None:
    where = tmp_path / "ckpt"
    result = invoke([
        "run", "--no-plots", "--device", "cpu", "--preset", "tiny", "--stages", "checkpoint-sync",
        "--checkpoint-every", "2", "--iters", "4", "--evidence-steps", "0", "--quiet",
        "--checkpoint-dir", str(where), "--keep-checkpoints", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    (folder,) = where.iterdir()  # the run's own folder, named in the stage's facts
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-sync-0.pt",
                                                        "checkpoint-sync-1.pt"]
    assert load_run(tmp_path / "run").stages[0].facts.checkpoint.directory == str(folder)
    bad = invoke(["run", "--device", "cpu", "--checkpoint-every", "0",
                              "--stages", "checkpoint-sync"])
    assert bad.exit_code == 2 and "--checkpoint-every must be positive" in bad.output


def test_checkpoint_dir_keeps_what_the_user_had_there(tmp_path: Path) -> None:
    """A --checkpoint-dir holding the user's own files, named as gpudiag would name its saves:
    after the run they are byte for byte what they were, and nothing of gpudiag's is left."""
    where = tmp_path / "mine"
    where.mkdir()
    own = {"checkpoint-sync-0.pt": b"the user's weights", "notes.txt": b"keep me"}
    for name, data in own.items():
        (where / name).write_bytes(data)
    result = invoke([
        "run", "--no-plots", "--device", "cpu", "--preset", "tiny", "--stages", "checkpoint-sync",
        "--checkpoint-every", "2", "--iters", "4", "--evidence-steps", "0", "--quiet",
        "--checkpoint-dir", str(where), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in where.iterdir()} == own


def test_async_checkpoint_reads_back_as_the_training_state(tmp_path: Path) -> None:
    """The flat async file restores to the same tensors, tied weights tied, loadable into a
    fresh model and optimizer."""
    import torch

    from gpudiag.measure.stages.checkpoint import AsyncCheckpointer, load_flat_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, as BERT's decoder and word embeddings are
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    saver = AsyncCheckpointer(tmp_path, 1, "t", keep=True, device=torch.device("cpu"))
    saver.attach(model, optimizer, scaler)
    saver.after_step()
    saver.finish()
    state = load_flat_checkpoint(saver.directory / "t-1.pt")
    expected = saver.training_state()
    assert state["step"] == 1 and state["scaler"] == expected["scaler"]
    for key, value in expected["model"].items():
        assert torch.equal(state["model"][key], value)
    assert state["model"]["0.weight"].data_ptr() == state["model"]["1.weight"].data_ptr()
    fresh = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    fresh[1].weight = fresh[0].weight
    fresh.load_state_dict(state["model"])
    torch.optim.AdamW(fresh.parameters()).load_state_dict(state["optimizer"])
    saver.close()


def test_recorded_h100_checkpoint_runs() -> None:
    """dgca full preset on an H100, 1.23 GB per save: blocking saves are critical at every 10
    and 20 steps; the async saver is only information at every 20 steps, and at every 10 its
    saves outlast the interval and queue (the contention rule names it)."""
    examples = Path(__file__).resolve().parent.parent / "reports" / "examples"
    every10 = load_run(examples / "h100-checkpoint")
    every20 = load_run(examples / "h100-checkpoint-every20")
    for run in (every10, every20):
        found = evaluate(run)
        sync = [f for f in found if f.id == "GD701" and f.stage == "checkpoint-sync"]
        assert sync and sync[0].severity == "critical"
        assert sync[0].evidence["bytes_per_save"] > 1e9
    async20 = [f for f in evaluate(every20) if f.stage == "checkpoint-async"]
    assert all(f.severity == "info" for f in async20)
    queued = [f for f in evaluate(every10) if f.id == "GD702"]
    assert queued and queued[0].evidence["saves_waited"] >= 1
