"""The permanent change of the DataLoader remedy, from what its run recorded: the settings it
measured (not the catalog's), in the terms of the framework that built the loader, at the line
where the script decides them (gpudiag/measure/profile/inscript/frameworks.py finds that line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpudiag.model.remedies import LOADER_SETTINGS

# transformers' TrainingArguments field for each DataLoader argument (the names of
# transformers 5.24, the version the tests run with).
TRAINING_ARGUMENTS = {name: f"dataloader_{name}" for name in LOADER_SETTINGS}


@dataclass(frozen=True)
class LoaderChange:
    change: str  # the permanent edit
    location: str | None  # the line it goes to


def loader_change(evidence: dict[str, Any]) -> LoaderChange | None:
    """The edit that makes permanent what the loader remedy changed (`evidence`: its record,
    {"loaders": [...]}); None when it changed no loader."""
    notes = [n for n in evidence.get("loaders", []) if isinstance(n, dict) and _changed(n)]
    # A loader a library rebuilt from the script's (Accelerate's prepare) has the script's
    # settings: the change goes where the script built that one.
    built = [n for n in notes if "rebuilt_by" not in n] or notes
    if not built:
        return None
    locations = list(dict.fromkeys(str(n.get("edit_at") or n.get("site")) for n in built))
    change = _change(built[0])
    if len(locations) > 1:
        change += f" (likewise at {', '.join(locations[1:])})"
    return LoaderChange(change, locations[0])


def _changed(note: dict[str, Any]) -> dict[str, Any]:
    """The settings the remedy changed in one loader, as it left them."""
    before, after = note.get("before"), note.get("after")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return {}
    return {k: after[k] for k in LOADER_SETTINGS if k in after and after[k] != before.get(k)}


def _change(note: dict[str, Any]) -> str:
    settings = _changed(note)
    if "hook" in note:  # the script's own hook builds it, called by the framework
        arguments = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        return f"in your {note['hook']}(): DataLoader(..., {arguments})"
    if note.get("framework") == "transformers":  # the Trainer builds it from its arguments
        fields = ", ".join(f"{TRAINING_ARGUMENTS[k]}={v!r}" for k, v in settings.items())
        arguments = note.get("arguments", "TrainingArguments")
        where = f"in {arguments}(...)" if "edit_at" in note else \
            f"in the {arguments} the Trainer is given"
        return f"{where}: {fields}"
    return "in the DataLoader(...) call: " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
