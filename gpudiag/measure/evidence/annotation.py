"""The names of the annotator's profiler ranges (source.py makes them, trace.py reads them), and
whether a line sits in a loop: without torch, so that a trace can be analysed in a process that
never loads it (gpudiag profile's own, beside the script)."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path
from typing import NamedTuple

ANNOTATION_PREFIX = "gpudiag.src|"


class Site(NamedTuple):
    """Where a torch call came from: the user's line, and the library frame it went through."""

    location: str  # "path:line"
    function: str
    direct: bool  # the line called torch itself, not through a library
    dtype: str = ""  # the compute dtype of a matmul-family call, else ""
    via: str = ""  # "path:line" of the library frame between the user's line and torch


def annotation(location: str, function: str, direct: bool, dtype: str = "", via: str = "") -> str:
    return f"{ANNOTATION_PREFIX}{location}|{function}|{int(direct)}|{dtype}|{via}"


@functools.lru_cache(maxsize=2**16)
def parse_annotation(name: str) -> Site | None:
    """The site a source annotation names (None for other ranges). Cached: a window holds a
    few hundred distinct names hundreds of thousands of times."""
    if not name.startswith(ANNOTATION_PREFIX):
        return None
    location, function, direct, dtype, via = name[len(ANNOTATION_PREFIX):].rsplit("|", 4)
    return Site(location, function, direct == "1", dtype, via)


@functools.cache
def _loop_lines(filename: str) -> frozenset[int]:
    """Lines of a source file that sit inside a for/while loop or a comprehension."""
    try:
        tree = ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    lines: set[int] = set()
    loops = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp,
             ast.GeneratorExp)
    for node in ast.walk(tree):
        if isinstance(node, loops):
            body = node.body if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) else [node]
            for child in body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return frozenset(lines)


def in_loop(location: str, roots: tuple[Path, ...] = ()) -> bool:
    """Whether `path:line` lies inside a loop in its source file (found from `roots`, the
    working directory or sys.path: the profiled process's own first, where it is another)."""
    path_text, _, line = location.rpartition(":")
    for base in (*roots, Path.cwd(), *(Path(p) for p in sys.path if p)):
        candidate = Path(path_text) if Path(path_text).is_absolute() else base / path_text
        if candidate.is_file():
            return int(line) in _loop_lines(str(candidate))
    return False
