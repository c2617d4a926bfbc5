"""The permanent change of the DataLoader remedy, from what its run recorded: the settings it
measured (not the catalog's), in the terms of the framework that built the loader, at the line
where the script decides them (gpudiag/measure/profile/inscript/frameworks.py finds that line).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpudiag.model.remedies import LOADER_SETTINGS, LoaderSeen

# transformers' TrainingArguments field for each DataLoader argument (the names of
# transformers 5.24, the version the tests run with).
TRAINING_ARGUMENTS = {name: f"dataloader_{name}" for name in LOADER_SETTINGS}


@dataclass(frozen=True)
class LoaderChange:
    change: str  # the permanent edit
    location: str | None  # the line it goes to


def loader_change(loaders: list[LoaderSeen]) -> LoaderChange | None:
    """The edit that makes permanent what the loader remedy changed in `loaders` (those its
    record saw built); None when it changed none."""
    notes = [n for n in loaders if _changed(n)]
    # A loader a library rebuilt from the script's (Accelerate's prepare) has the script's
    # settings: the change goes where the script built that one.
    built = [n for n in notes if n.rebuilt_by is None] or notes
    if not built:
        return None
    locations = list(dict.fromkeys(str(n.edit_at or n.site) for n in built))
    change = _change(built[0])
    if len(locations) > 1:
        change += f" (likewise at {', '.join(locations[1:])})"
    return LoaderChange(change, locations[0])


def slower_workers(loaders: list[LoaderSeen], speedup: float) -> str:
    """Why the loader remedy measured slower (`speedup` < 1), in terms of what the script's
    loaders did without it: batches made on the training thread that cost less than their
    hand-off from worker processes; and what to change instead."""
    built = [n for n in loaders if _changed(n) and n.rebuilt_by is None] or \
        [n for n in loaders if _changed(n)]
    first = built[0] if built else None
    workers = first.before.num_workers if first and first.before else None
    at = f" at {first.edit_at or first.site}" if first and (first.edit_at or first.site) else ""
    made = ("on the training thread (num_workers=0)" if workers == 0 else
            f"with {workers} workers" if workers else "as the script built it")
    return (f"its workers measured {speedup:.2f}x: the DataLoader{at} makes its batches "
            f"{made} faster than worker processes can hand them over, so keep it as it is; "
            "where the dataset holds tensors, index whole batches instead (a "
            "BatchSampler as sampler, batch_size=None) or slice them in the loop")


def _changed(note: LoaderSeen) -> dict[str, object]:
    """The settings the remedy changed in one loader, as it left them (None: not recorded)."""
    before, after = note.before, note.after
    if before is None or after is None:
        return {}
    return {k: getattr(after, k) for k in LOADER_SETTINGS
            if getattr(after, k) is not None and getattr(after, k) != getattr(before, k)}


def _change(note: LoaderSeen) -> str:
    settings = _changed(note)
    if note.hook is not None:  # the script's own hook builds it, called by the framework
        arguments = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        return f"in your {note.hook}(): DataLoader(..., {arguments})"
    if note.framework == "transformers":  # the Trainer builds it from its arguments
        fields = ", ".join(f"{TRAINING_ARGUMENTS[k]}={v!r}" for k, v in settings.items())
        arguments = note.arguments or "TrainingArguments"
        where = f"in {arguments}(...)" if note.edit_at is not None else \
            f"in the {arguments} the Trainer is given"
        return f"{where}: {fields}"
    return "in the DataLoader(...) call: " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
