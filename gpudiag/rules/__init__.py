"""Rules: declared checks over a recorded run that name the cause, the place, the price, the fix.

Each module registers its rules on import; `evaluate(run)` runs them all."""

from __future__ import annotations

import importlib

from gpudiag.rules.registry import Rule, Threshold, all_rules, evaluate, find_rule

_BUILTIN_MODULES = ("launch", "input", "precision", "device", "checkpoint", "ddp")


def load_builtin_rules() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"gpudiag.rules.{module}")


__all__ = ["Rule", "Threshold", "all_rules", "evaluate", "find_rule", "load_builtin_rules"]
