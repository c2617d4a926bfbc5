"""The DataLoader remedy's permanent change: the settings its run measured, in the terms of the
framework that built the loader (transformers' TrainingArguments, a Lightning hook, a loader
Accelerate rebuilt from the script's), at the line where the script sets them. The frameworks
are the real ones, driven in this process with the remedy's DataLoader wrapper applied."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import script_run, script_stage
from torch.utils.data import DataLoader, TensorDataset

from gpudiag.diagnose.loaderadvice import loader_change
from gpudiag.diagnose.tryfix import measured_fix
from gpudiag.model.remedies import (
    REMEDIES,
    LoaderRecord,
    LoaderSeen,
    LoaderSettings,
    RemedyEvidence,
)
from gpudiag.model.results import Finding, RunResult

HERE = Path(__file__).name


@pytest.fixture
def loader_remedy(monkeypatch: pytest.MonkeyPatch) -> list[LoaderSeen]:
    """The loader remedy's DataLoader wrapper, applied for one test; the loaders it saw."""
    from gpudiag.measure.profile.inscript.remedies import APPLIERS

    monkeypatch.setattr(DataLoader, "__init__", DataLoader.__init__)  # restored afterwards
    seen = RemedyEvidence()
    APPLIERS["loader"](seen)
    assert seen.loader is not None
    return seen.loader.loaders


def _line(marker: str) -> str:
    """`test_loaderadvice.py:N`, N the line of this file holding `marker` (once)."""
    lines = Path(__file__).read_text().splitlines()
    (number,) = [n for n, text in enumerate(lines, 1) if marker in text and "_line(" not in text]
    return f"{HERE}:{number}"


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).pow(2).mean()}


def test_hf_trainer_loader_is_set_in_training_arguments(
        loader_remedy: list[LoaderSeen], tmp_path: Path) -> None:
    """The field run pointed at "the DataLoader(...) call" at trainer.train(); the Trainer
    builds it from TrainingArguments, so that is where the setting goes."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],  # ARGS
                             per_device_train_batch_size=4, dataloader_num_workers=0)
    trainer = Trainer(model=_Tiny(), args=args,
                      train_dataset=[{"x": torch.randn(4)} for _ in range(16)])
    trainer.get_train_dataloader()  # TRAIN
    built, *rest = loader_remedy
    assert built.framework == "transformers" and built.arguments == "TrainingArguments"
    assert built.site is not None and built.site.endswith(_line("# TRAIN"))
    assert built.edit_at is not None and built.edit_at.endswith(_line("# ARGS"))
    assert rest, "accelerate's prepare rebuilds it: noted too"
    change = loader_change(loader_remedy)
    assert change is not None and change.location == built.edit_at
    assert built.after is not None
    workers = built.after.num_workers
    # The Trainer pins by default: pin_memory was not changed, so not named.
    assert change.change == (
        f"in TrainingArguments(...): dataloader_num_workers={workers}, "
        "dataloader_persistent_workers=True, dataloader_prefetch_factor=4")


def test_a_trainer_subclass_that_builds_its_own_loader_is_told_its_hook(
        loader_remedy: list[LoaderSeen], tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    class Built(Exception):
        """Stops train() once it has its loader: the test needs no step."""

    class OwnLoader(Trainer):
        def get_train_dataloader(self) -> DataLoader[Any]:
            DataLoader(self.train_dataset, batch_size=4)  # OWN
            raise Built

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(Built):
        OwnLoader(model=_Tiny(), args=args, train_dataset=[{"x": torch.randn(4)}] * 8).train()
    change = loader_change(loader_remedy)
    assert change is not None and change.location is not None
    assert change.location.endswith(_line("# OWN"))
    assert change.change.startswith(
        "in your OwnLoader.get_train_dataloader(): DataLoader(..., num_workers=")


@pytest.mark.slow
def test_lightning_loader_is_set_in_the_datamodules_hook(loader_remedy: list[LoaderSeen]) -> None:
    lightning = pytest.importorskip("lightning")

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Data(lightning.LightningDataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)  # HOOK

    # The loader is what the hook returns; the fit stops before it is iterated.
    trainer = lightning.Trainer(max_steps=0, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(Model(), Data())
    built = loader_remedy[0]
    assert built.framework == "lightning" and built.hook == "Data.train_dataloader"
    change = loader_change(loader_remedy)
    assert change is not None and change.location == built.site
    assert change.location.endswith(_line("# HOOK"))
    assert change.change.startswith("in your Data.train_dataloader(): DataLoader(..., ")


def test_a_loader_accelerate_rebuilt_is_changed_where_the_script_built_it(
        loader_remedy: list[LoaderSeen]) -> None:
    from accelerate.data_loader import prepare_data_loader

    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)  # BUILT
    prepare_data_loader(loader, torch.device("cpu"), num_processes=1, process_index=0)
    built, rebuilt = loader_remedy
    assert built.framework is None and rebuilt.rebuilt_by == "accelerate"
    change = loader_change(loader_remedy)
    assert change is not None and change.location == built.site
    assert change.location.endswith(_line("# BUILT"))
    assert change.change.startswith("in the DataLoader(...) call: num_workers=")


def _input_bound_run(remedies: RemedyEvidence, step_ms: float) -> RunResult:
    """A profiled script the input-bound rule (GD201) named, its loader remedies `remedies`."""
    stage = script_stage([step_ms] * 36, steps=40, warmup=4, timed=36, losses=[1.0, 0.9, 0.8],
                         remedies=remedies)
    return script_run(stage, findings=[Finding(
        id="GD201", rule="r", severity="warning", stage="train.py", title="input-bound",
        fix="more workers", location="train.py:9")])


def test_make_it_permanent_names_the_settings_measured() -> None:
    """The field run advised 8 workers and pinned memory; it had measured 2, unpinned (a
    2-CPU machine without CUDA)."""
    recorded = LoaderRecord([LoaderSeen(
        site="train.py:12",
        before=LoaderSettings(num_workers=0, pin_memory=False, persistent_workers=False,
                              prefetch_factor=None),
        after=LoaderSettings(num_workers=2, pin_memory=False, persistent_workers=True,
                             prefetch_factor=4))])
    without = _input_bound_run(RemedyEvidence(), 20.0)
    fix = measured_fix(REMEDIES["loader"], ["loader"], without,
                       _input_bound_run(RemedyEvidence(loader=recorded), 10.0), [1.0, 0.9, 0.8],
                       without)
    assert fix.location == "train.py:12"
    assert fix.change == ("in the DataLoader(...) call: num_workers=2, persistent_workers=True, "
                          "prefetch_factor=4")
    assert "8" not in fix.change and "pin_memory" not in fix.change


def test_workers_measured_slower_say_what_the_loader_does_instead() -> None:
    """An in-memory dataset's batches made on the training thread in 10 ms a step; with the
    remedy's workers 60 ms: not recommended, and the row says the loader makes its batches
    faster in process and what to change instead, not more workers."""
    from gpudiag.present.fixes import fix_cells

    recorded = LoaderRecord([LoaderSeen(
        site="train.py:12", before=LoaderSettings(num_workers=0, pin_memory=False),
        after=LoaderSettings(num_workers=2, pin_memory=False, persistent_workers=True))])
    without = _input_bound_run(RemedyEvidence(), 10.0)
    fix = measured_fix(REMEDIES["loader"], ["loader"], without,
                       _input_bound_run(RemedyEvidence(loader=recorded), 60.0), [1.0, 0.9, 0.8],
                       without)
    assert fix.speedup == pytest.approx(1 / 6)
    assert ("its workers measured 0.17x: the DataLoader at train.py:12 makes its batches on the "
            "training thread (num_workers=0) faster than worker processes") in fix.note
    change = fix_cells(fix)[-1]
    assert change.startswith("not recommended: measured slower") and "BatchSampler" in change
    faster = measured_fix(REMEDIES["loader"], ["loader"], without,
                          _input_bound_run(RemedyEvidence(loader=recorded), 5.0),
                          [1.0, 0.9, 0.8], without)
    assert "workers measured" not in faster.note

def test_one_change_for_loaders_set_in_one_place() -> None:
    """Trainer's train and evaluation loaders come from one TrainingArguments: one line to
    edit. Loaders built at two lines of the script: both named."""
    changed = {"before": LoaderSettings(num_workers=0), "after": LoaderSettings(num_workers=4)}
    hf = LoaderSeen(framework="transformers", arguments="Seq2SeqTrainingArguments",
                    edit_at="t.py:5", site="t.py:20", **changed)
    assert loader_change([hf, dataclasses.replace(hf, site="t.py:21")]) == loader_change([hf])
    found = loader_change([hf])
    assert found is not None
    assert found.change == "in Seq2SeqTrainingArguments(...): dataloader_num_workers=4"
    unfound = dataclasses.replace(hf, edit_at=None)
    assert loader_change([unfound]) == type(found)(
        "in the Seq2SeqTrainingArguments the Trainer is given: dataloader_num_workers=4",
        "t.py:20")
    two = loader_change([LoaderSeen(site="a.py:3", **changed), LoaderSeen(site="b.py:7",
                                                                           **changed)])
    assert two is not None and two.change.endswith("num_workers=4 (likewise at b.py:7)")
    unchanged = LoaderSeen(site="a.py:3", before=LoaderSettings(num_workers=2),
                           after=LoaderSettings(num_workers=2))
    assert loader_change([unchanged]) is None

