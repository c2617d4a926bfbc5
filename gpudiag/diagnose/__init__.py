"""Diagnosis: declared rules over a recorded run that name the cause, the place, the price, the
fix. Rule files are named by their code family (gd1_launch.py holds GD1xx) and register their
rules when imported; `evaluate(run)` runs them all. Imports only gpudiag.model: a run.json is
diagnosed without torch or a GPU."""

from __future__ import annotations

import importlib
import pkgutil

from gpudiag.diagnose.registry import Rule, Threshold, all_rules, evaluate, find_rule


def load_builtin_rules() -> None:
    """Import every rule file (gdN_*.py) of this package: no list to keep in step."""
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("gd") and module.name[2:3].isdigit():
            importlib.import_module(f"{__name__}.{module.name}")


load_builtin_rules()


__all__ = ["Rule", "Threshold", "all_rules", "evaluate", "find_rule", "load_builtin_rules"]
