"""The built-in models: faithful DGCA-ReLM layout, and a vectorized prompt equal to the loop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from gpudiag.measure.models import ModelBundle, ModelOptions, model_specs, resolve_model
from gpudiag.measure.models.bert import (
    CLS_ID,
    IGNORE_INDEX,
    MASK_ID,
    SEP_ID,
    mlm_batch,
    mlm_example,
)
from gpudiag.measure.models.dgca import (
    apply_prompt_loop,
    apply_prompt_vectorized,
    relm_batch,
    relm_example,
    source_length_range,
)
from gpudiag.measure.plan import cpu_bf16_native
from gpudiag.model.config import TINY_SHAPE
from gpudiag.model.errors import BadInput

OPTIONS = ModelOptions(shape=TINY_SHAPE, seq_len=64, prompt_length=3)


def _batch(n: int = 12) -> dict[str, torch.Tensor]:
    return default_collate([relm_example(OPTIONS, i) for i in range(n)])


def _source_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["attention_mask"].sum(1) - 2 * OPTIONS.prompt_length) // 2


def test_registry_lists_builtins_with_variants() -> None:
    specs = {s.name: s for s in model_specs()}
    assert {"bert", "dgca"} <= specs.keys()
    assert set(specs["dgca"].variants) == {"loop", "vectorized"}
    assert not specs["bert"].variants


def _relm_rows(builder: str) -> list[dict[str, torch.Tensor]]:
    if builder == "per example":
        return [relm_example(OPTIONS, index) for index in range(20)]
    batch = relm_batch(OPTIONS, 0, 20)
    return [{k: v[i] for k, v in batch.items()} for i in range(20)]


@pytest.mark.parametrize("builder", ["per example", "vectorized batch"])
def test_relm_example_layout(builder: str) -> None:
    p = OPTIONS.prompt_length
    for ex in _relm_rows(builder):
        n = int((ex["attention_mask"].sum() - 2 * p) // 2)
        shortest, longest = source_length_range(OPTIONS.seq_len, p)
        assert shortest <= n <= longest
        ids = ex["input_ids"]
        assert (ids[:p] == CLS_ID).all() and (ids[p + n : 2 * p + n] == SEP_ID).all()
        assert (ids[2 * p + n : 2 * p + 2 * n] == MASK_ID).all()
        prompt_positions = ex["prompt_mask"].nonzero().flatten().tolist()
        assert prompt_positions == [*range(p), *range(p + n, 2 * p + n)]
        target = slice(2 * p + n, 2 * p + 2 * n)
        assert (ex["labels"][target] != IGNORE_INDEX).all()
        assert (ex["labels"][: 2 * p + n] == IGNORE_INDEX).all()
        gold = ex["candidate_ids"][target].gather(1, ex["gold_index"][target, None]).squeeze(1)
        assert torch.equal(gold, ex["labels"][target])
        assert ex["source_mask"].sum() == n
        corrected = ex["labels"][target] != ids[p : p + n]
        assert torch.equal(corrected.float(), ex["error_mask"][target])
        assert torch.equal(ex["detection_labels"][p : p + n], ex["error_mask"][target])
        assert (ex["candidate_ids"][: 2 * p + n] == 0).all()


@pytest.mark.parametrize(("examples", "batch"), [(mlm_example, mlm_batch),
                                                 (relm_example, relm_batch)])
def test_vectorized_batches_have_the_examples_layout(examples: Any, batch: Any) -> None:
    """Same keys, shapes and dtypes as the examples stacked, deterministic, and rows that
    differ: a batch of any size is built with tensor ops, not a Python loop over rows."""
    stacked = default_collate([examples(OPTIONS, i) for i in range(6)])
    built = batch(OPTIONS, 0, 6)
    assert {k: (v.shape, v.dtype) for k, v in built.items()} == {
        k: (v.shape, v.dtype) for k, v in stacked.items()}
    again = batch(OPTIONS, 0, 6)
    assert all(torch.equal(built[k], again[k]) for k in built)
    assert len({tuple(row.tolist()) for row in built["input_ids"]}) == 6


def test_examples_are_deterministic_per_index() -> None:
    a, b = relm_example(OPTIONS, 7), relm_example(OPTIONS, 7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(relm_example(OPTIONS, 8)["input_ids"], a["input_ids"])


def test_vectorized_prompt_equals_loop_on_variable_length_rows() -> None:
    batch = _batch()
    assert len(set(_source_lengths(batch).tolist())) > 3, "rows must differ in length"
    embeds = torch.randn(*batch["input_ids"].shape, 16)
    replace = torch.randn(2 * OPTIONS.prompt_length, 16)
    looped = apply_prompt_loop(embeds.clone(), batch["prompt_mask"], replace,
                               OPTIONS.prompt_length)
    vectorized = apply_prompt_vectorized(embeds.clone(), batch["prompt_mask"], replace)
    assert torch.equal(looped, vectorized)
    assert not torch.equal(looped, embeds)


def _seed_index_copy(embeds: torch.Tensor, prompt_mask: torch.Tensor,
                     replace: torch.Tensor) -> torch.Tensor:
    """The seed's shipped "fix": row 0's prompt positions used for every row."""
    positions = prompt_mask[0].nonzero().flatten()
    return embeds.index_copy(1, positions, replace.expand(embeds.shape[0], -1, -1))


def test_seed_index_copy_fix_is_wrong_for_variable_lengths() -> None:
    batch = _batch()
    embeds = torch.randn(*batch["input_ids"].shape, 16)
    replace = torch.randn(2 * OPTIONS.prompt_length, 16)
    looped = apply_prompt_loop(embeds.clone(), batch["prompt_mask"], replace,
                               OPTIONS.prompt_length)
    assert not torch.equal(_seed_index_copy(embeds, batch["prompt_mask"], replace), looped)


def test_full_models_give_identical_embeddings_and_losses() -> None:
    spec = resolve_model("dgca")
    torch.manual_seed(0)
    loop = spec.variants["loop"](OPTIONS)
    torch.manual_seed(0)
    vectorized = spec.variants["vectorized"](OPTIONS)
    loop.model.eval()
    vectorized.model.eval()
    assert all(torch.equal(a, b) for a, b in zip(loop.model.state_dict().values(),
                                                 vectorized.model.state_dict().values(),
                                                 strict=True))
    batch = _batch(8)
    with torch.no_grad():
        e1 = loop.model.embed(batch["input_ids"], batch["prompt_mask"])
        e2 = vectorized.model.embed(batch["input_ids"], batch["prompt_mask"])
        out1, out2 = loop.model(**batch), vectorized.model(**batch)
    assert torch.equal(e1, e2)
    assert torch.equal(out1.loss, out2.loss)
    assert torch.equal(out1.log_probs, out2.log_probs)
    assert torch.isfinite(out1.loss)


@pytest.mark.parametrize("autocast", [
    pytest.param(True, marks=pytest.mark.skipif(
        not cpu_bf16_native(), reason="no native bf16 on this CPU: oneDNN has no bf16 LSTM")),
    False,  # what a CPU without native bf16 runs (config.default_amp_dtype)
])
def test_full_model_trains_in_the_cpu_precision(autocast: bool) -> None:
    bundle = resolve_model("dgca").variants["vectorized"](OPTIONS)
    batch = _batch(4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = bundle.loss(bundle.model(**batch))
    loss.backward()
    prompt_grad = bundle.model.prompt_encoder.embedding.weight.grad
    assert prompt_grad is not None and prompt_grad.abs().sum() > 0


def test_bundle_loss_accepts_common_outputs() -> None:
    bundle = ModelBundle(model=torch.nn.Identity(), make_example=lambda i: {})
    loss = torch.tensor(1.5)
    assert bundle.loss(loss) is loss
    assert bundle.loss({"loss": loss}) is loss
    with pytest.raises(TypeError, match="no scalar loss"):
        bundle.loss(torch.ones(3))


USER_MODEL = '''
import torch
from gpudiag.measure.models import ModelBundle

def factory(options):
    """A two-layer MLP regressor."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)}

    def example(i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "y": torch.randn((), generator=g)}

    return ModelBundle(model=Model(), make_example=example, description="user MLP")
'''


def test_user_model_from_file(tmp_path: Path) -> None:
    path = tmp_path / "my_model.py"
    path.write_text(USER_MODEL)
    spec = resolve_model(f"{path}:factory")
    assert spec.summary == "A two-layer MLP regressor."
    bundle = spec.build(OPTIONS)
    assert bundle.loss(bundle.model(**default_collate([bundle.make_example(0)]))).ndim == 0


def test_a_model_file_is_imported_once_per_run(tmp_path: Path) -> None:
    """The plan and the runner both resolve the model: a file with side effects at import (a
    download, a log line) must see them once."""
    from typer.testing import CliRunner

    from gpudiag.cli.program import app

    path = tmp_path / "counted.py"
    path.write_text(f"with open({str(tmp_path / 'imports')!r}, 'a') as f:\n    f.write('x')\n"
                    + USER_MODEL)
    result = CliRunner().invoke(app, ["run", "--device", "cpu", "--preset", "tiny", "--model",
                                      f"{path}:factory", "--stages", "infer", "--iters", "2",
                                      "--evidence-steps", "0", "--quiet", "--out",
                                      str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "imports").read_text() == "x"


def test_a_model_file_leaves_no_bytecode_beside_it(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Python writes bytecode (no PYTHONDONTWRITEBYTECODE, as in CI), importing the
    user's model file and what it imports leaves no __pycache__ in their folder, and the
    interpreter's own setting is back afterwards."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    (tmp_path / "helpers_for_model.py").write_text("WIDTH = 8\n")
    path = tmp_path / "bytecode_model.py"
    path.write_text("import helpers_for_model\n" + USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    resolve_model(f"{path}:factory").build(OPTIONS)
    assert not (tmp_path / "__pycache__").exists()
    assert sys.dont_write_bytecode is False


@pytest.mark.parametrize(("content", "ref", "message"), [
    (None, "missing.py:factory", "no such file"),
    ("x = 1\n", "{path}:factory", "defines no 'factory'"),
    ("raise RuntimeError('boom')\n", "{path}:factory", r"importing .* failed: RuntimeError"),
    ("factory = 3\n", "{path}:factory", "expected a ModelSpec or a factory"),
    ("import sys\nsys.exit(0)\n", "{path}:factory", r"importing m.py failed: SystemExit"),
    ("raise KeyboardInterrupt\n", "{path}:factory", r"m.py failed: KeyboardInterrupt"),
])
def test_user_model_errors_are_bad_input(tmp_path: Path, content: str | None, ref: str,
                                         message: str) -> None:
    path = tmp_path / "m.py"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BadInput, match=message):
        resolve_model(ref.format(path=path) if content is not None else str(tmp_path / ref))


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(BadInput, match=r"unknown model 'nope'.*bert.*dgca"):
        resolve_model("nope")
