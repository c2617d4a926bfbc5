"""report.md's memory owners: who held a profiled script's memory over one step, by role, the
lines that saved the most for backward, and what the script keeps growing (ScriptFacts.owners,
ScriptFacts.kept)."""

from __future__ import annotations

from gpudiag.model.facts import KeptTensors, MemoryOwners
from gpudiag.model.results import RunResult
from gpudiag.present.tables import markdown_table

_MIB = 2**20


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / _MIB:,.1f}"


def _rows(owners: MemoryOwners) -> list[list[str]]:
    roles = [("parameters", owners.parameters), ("gradients", owners.gradients),
             ("optimizer state", owners.optimizer_state),
             ("activations saved for backward", owners.activations),
             ("inputs (the training batch)", owners.inputs),
             ("kept from earlier steps", owners.kept),
             ("temporaries (the peak less the others)", owners.temporaries)]
    rows = []
    for role, nbytes in roles:
        share = f"{nbytes / owners.peak:.0%}" if owners.peak and nbytes is not None else "-"
        rows.append([role, _mib(nbytes), share])
    if owners.peak is not None:
        rows.append(["**peak allocated**", _mib(owners.peak), "100%"])
    return rows


def _kept_line(kept: KeptTensors) -> str:
    at = f" at `{kept.location}`" if kept.location else ""
    if kept.kind == "tensor with its graph":
        return (f"- `{kept.name}` (a tensor{at}) keeps its autograd graph: "
                f"+{kept.added_per_step:,.0f} nodes a step")
    graph = ", with their autograd graphs" if kept.graph_kept else ""
    noun = "tensor" if kept.added_per_step == 1 else "tensors"
    return (f"- `{kept.name}` (a {kept.kind}{at}, on the {kept.device}): "
            f"+{kept.added_per_step:,.2g} {noun}, {_mib(kept.bytes_per_step)} MiB a step"
            f"{graph} (steps {kept.steps[0]} to {kept.steps[1]})")


def owners_markdown(run: RunResult) -> list[str]:
    """A section per profiled stage that read its memory's owners or found tensors kept."""
    out: list[str] = []
    for stage in run.stages:
        script = stage.facts.script
        if script is None or (script.owners is None and not script.kept):
            continue
        out += [f"### Memory owners: {stage.name}", ""]
        owners = script.owners
        if owners is not None:
            out += [f"Over step {owners.step} (the profiler window's first), on the "
                    f"{owners.device}, in MiB:", ""]
            out += markdown_table(["owner", "MiB", "of the peak"], _rows(owners))
            out.append("")
            if owners.activation_sites:
                sites = ", ".join(
                    f"`{s.location}` {_mib(s.bytes)} MiB ({s.tensors} "
                    f"tensor{'' if s.tensors == 1 else 's'})" for s in owners.activation_sites)
                out += [f"Saved for backward the most: {sites}; counting them took "
                        f"{owners.hook_ms:,.1f} ms of that step.", ""]
            if owners.note:
                out += [f"> {owners.note}", ""]
        if script.kept:
            out += ["Growing between two looks at the training loop's names:", ""]
            out += [_kept_line(kept) for kept in script.kept]
            out.append("")
    return out
