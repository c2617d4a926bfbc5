"""An example script of examples/ imported as a module (its main() not run), for the
benchmarks that time its model with a plain timer: the module's globals stay live, so a
benchmark may switch one its functions read (deep_activations' CHECKPOINT)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """examples/`name`.py as a module."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
