"""The shape of the code, checked against the source itself: function sizes, rules that declare
every number that decides them, no dependency on documents outside the repository.

(The layers, the no-cycles rule and `gpudiag profile`'s process boundary, launching/ and
inscript/ apart and no torch on the launching side, are import-linter contracts in
pyproject.toml, run by `lint-imports` in .ci/run.)"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from gpudiag.diagnose import all_rules

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpudiag"
MAX_FUNCTION_LINES = 80
MAX_CLI_MODULE_LINES = 300


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_longer_than_80_lines() -> None:
    long = [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1})"
            for path in sorted(PACKAGE.rglob("*.py")) for fn in _functions(path)
            if (fn.end_lineno or fn.lineno) - fn.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_module_of_the_command_line_is_longer_than_300_lines() -> None:
    """The command line parses and renders, a family of commands per module: a module that
    grows past this is deciding something that belongs below it (docs/architecture.md)."""
    modules = sorted((PACKAGE / "cli").rglob("*.py"))
    assert modules, "gpudiag/cli/ has moved: point this test at the command line"
    long = [f"{path.relative_to(ROOT)} ({lines})" for path in modules
            if (lines := len(path.read_text().splitlines())) > MAX_CLI_MODULE_LINES]
    assert not long, long


def _rule_functions() -> list[tuple[str, object, ast.FunctionDef, dict[str, ast.FunctionDef]]]:
    found = []
    for path in sorted((PACKAGE / "diagnose").glob("gd*.py")):
        module = importlib.import_module(f"gpudiag.diagnose.{path.stem}")
        tree = ast.parse(path.read_text())
        helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for fn in helpers.values():
            for dec in fn.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "rule":
                    code = dec.args[0].value  # type: ignore[attr-defined]
                    found.append((code, module, fn, helpers))
    return found


def _numbers_used(module: object, fn: ast.FunctionDef,
                  helpers: dict[str, ast.FunctionDef]) -> dict[str, float]:
    """Module-level numeric constants the rule reads, itself or through the module's helpers."""
    used: dict[str, float] = {}
    seen, todo = {fn.name}, [fn]
    while todo:
        for node in ast.walk(todo.pop()):
            if not isinstance(node, ast.Name):
                continue
            value = getattr(module, node.id, None)
            if (node.id.isupper() and isinstance(value, (int, float))
                    and not isinstance(value, bool)):
                used[node.id] = value
            if node.id in helpers and node.id not in seen:
                seen.add(node.id)
                todo.append(helpers[node.id])
    return used


RULES = _rule_functions()


@pytest.mark.parametrize(("code", "module", "fn", "helpers"), RULES,
                         ids=[r[0] for r in RULES])
def test_every_number_that_decides_a_rule_is_declared_on_it(
        code: str, module: object, fn: ast.FunctionDef,
        helpers: dict[str, ast.FunctionDef]) -> None:
    """`gpudiag rules CODE` shows the rule's thresholds: each named constant its body (or a
    helper in its file) reads must be one of them, and no bare fraction may decide instead."""
    declared = {t.value for r in all_rules() if r.code == code for t in r.thresholds}
    missing = {name: value for name, value in _numbers_used(module, fn, helpers).items()
               if value not in declared}
    assert not missing, f"{code} reads undeclared thresholds {missing}"
    # Fractions in (0, 1) decide severities and shares; a tiny epsilon guarding a division
    # does not.
    bare = [node.value for node in ast.walk(fn)
            if isinstance(node, ast.Constant) and isinstance(node.value, float)
            and 1e-3 <= node.value < 1.0]
    assert not bare, f"{code} decides with bare numbers {bare}: name and declare them"


def test_rules_cover_every_registered_code() -> None:
    assert sorted(r[0] for r in RULES) == sorted(r.code for r in all_rules())


OUTSIDE_DOCS = re.compile(r"\b(SEEDS|REFERENCE|TELEMETRY|DESIGN|DGCA-MODEL)\.md\b|\.\./shared")


def test_sources_cite_nothing_outside_the_repository() -> None:
    """Comments, docstrings and rule references point at public sources or files in the repo."""
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    hits = [f"{path.relative_to(ROOT)}:{i}" for path in files
            if path.name != "test_architecture.py"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if OUTSIDE_DOCS.search(line)]
    assert not hits, hits


def _config_reads(path: Path) -> list[str]:
    """`x.config["key"]` and `x.config.get("key")`, and the same through a name bound to
    `x.config`: a config read by string key instead of a typed field."""
    tree = ast.parse(path.read_text())
    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Attribute) and n.value.attr == "config"
               for t in n.targets if isinstance(t, ast.Name)}

    def is_config(node: ast.expr) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "config")
                or (isinstance(node, ast.Name) and node.id in aliases))

    def is_key(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_config(node.value) and is_key(node.slice):
            found.append(f"{path}:{node.lineno}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and is_config(node.func.value)
                and node.args and is_key(node.args[0])):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_layer_reads_the_run_config_by_string_key() -> None:
    """A run's config is typed (RunConfig or ProfileConfig, gpudiag/model/config.py): only
    model/ turns it into or out of JSON."""
    reads = [read for path in sorted(PACKAGE.rglob("*.py"))
             if "model" not in path.relative_to(PACKAGE).parts for read in _config_reads(path)]
    assert not reads, reads


def test_the_string_key_check_sees_both_spellings(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('a = run.config["warmup"]\nc = run.config\nb = c.get("model")\n'
                      'd = run.config.warmup\n')
    assert [r.rsplit(":", 1)[1] for r in _config_reads(sample)] == ["1", "3"]


def test_every_import_inside_a_function_says_why() -> None:
    """Imports belong at the top; one inside a function is there for start-up time or an
    optional dependency, and its line says which (`# noqa: PLC0415  (reason)`)."""
    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in _functions(path):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    line = lines[node.lineno - 1]
                    if not re.search(r"#\s*noqa: [A-Z0-9, ]*PLC0415\s+\(\w", line):
                        silent.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not silent, silent


# Every file gpudiag writes goes through gpudiag/model/atomic.py (a new name made O_EXCL and
# O_NOFOLLOW, renamed over the final one), since a run folder may hold links a confined re-run
# or another person planted. These write otherwise, each for the reason given.
DIRECT_WRITES_ALLOWED = {
    ("gpudiag/cli/edges.py", "open"): "os.devnull, for a reader that left (BrokenPipeError)",
    ("gpudiag/cli/gating.py", "open"): "$GITHUB_STEP_SUMMARY: the CI's own file, appended to",
    ("gpudiag/measure/telemetry/worker.py", "open"): "its rows file, which mkstemp made",
    ("gpudiag/measure/stages/checkpoint.py", "open"): "the measured save itself, in a folder "
                                                      "mkdtemp made for the stage",
    ("gpudiag/measure/stages/checkpoint.py", "save"): "torch.save, measured, in that folder",
    ("gpudiag/measure/profile/inscript/recorder.py", "touch"): "the script's own process marks "
                                                               "a window done (never truncates)",
    ("gpudiag/measure/gatejob.py", "copy2"): "untracked files into a worktree gpudiag made",
    ("gpudiag/measure/stages/ddp/worker.py", "write_text"): "/proc/self/clear_refs, a kernel "
                                                            "control: resets the peak resident "
                                                            "set, no file",
    ("gpudiag/measure/profile/launching/scratch.py", "open"): "a scratch copy's file, made "
                                                              "with O_EXCL ('xb')",
    ("gpudiag/measure/profile/launching/scratch.py", "copyfile"): "over that O_EXCL file",
    ("gpudiag/measure/childexec.py", "open"): "the kernel's /proc/self/uid_map and gid_map "
                                              "of a new user namespace (never a file's)",
    ("gpudiag/measure/profile/inscript/bootstrap/sitecustomize.py", "write_text"):
        "standard library only (gpudiag may not import): the process's own pid-named file",
}
_WRITE_METHODS = {"write_text", "write_bytes", "touch"}
_COPIES = {"copy", "copy2", "copyfile", "copytree"}


def _direct_writes(path: Path) -> list[tuple[int, str]]:
    """Calls that write a file by path: `.write_text(`, `.write_bytes(`, `.to_csv(path)`,
    `.savefig(x)` where x is not a file `atomic_file` opened, `open(..., "w"/"a"/"x"/"+")`
    and `.open` alike, `shutil.copy*`, `torch.save`, `.touch()`."""
    tree = ast.parse(path.read_text())
    atomic_names = {item.optional_vars.id for n in ast.walk(tree) if isinstance(n, ast.With)
                    for item in n.items if isinstance(item.optional_vars, ast.Name)
                    and isinstance(item.context_expr, ast.Call)
                    and getattr(item.context_expr.func, "id", "") == "atomic_file"}

    def writes_mode(call: ast.Call, position: int) -> bool:
        modes = [*call.args[position:position + 1], *(k.value for k in call.keywords
                                                       if k.arg == "mode")]
        return any(isinstance(m, ast.Constant) and isinstance(m.value, str)
                   and set(m.value) & set("wax+") for m in modes)

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0] if node.args else None
        owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
        if ((name in _WRITE_METHODS and isinstance(func, ast.Attribute))
                or (name == "to_csv" and (node.args or any(k.arg == "path_or_buf"
                                                            for k in node.keywords)))
                or (name == "savefig" and not (isinstance(first, ast.Name)
                                               and first.id in atomic_names))
                or (name == "open" and isinstance(func, ast.Name) and writes_mode(node, 1))
                or (name == "open" and isinstance(func, ast.Attribute)
                    and owner != "os" and writes_mode(node, 0))
                or (name in _COPIES and owner == "shutil")
                or (name == "save" and owner == "torch")):
            found.append((node.lineno, name))
    return found


def test_every_file_gpudiag_writes_goes_through_the_atomic_writer() -> None:
    """A new `write_text(`, `.to_csv(path)`, `savefig(path)`, `open(path, "w")` or
    `shutil.copy` in gpudiag/ writes through a link a script could have planted: use
    gpudiag/model/atomic.py (write_text_atomic, write_bytes_atomic, atomic_file for pandas
    and matplotlib, fresh_stream for a child's log), or say here why not."""
    direct = [f"{rel}:{line} {name}" for path in sorted(PACKAGE.rglob("*.py"))
              if (rel := str(path.relative_to(ROOT))) != "gpudiag/model/atomic.py"
              for line, name in _direct_writes(path)
              if (rel, name) not in DIRECT_WRITES_ALLOWED]
    assert not direct, direct
    used = {(str(path.relative_to(ROOT)), name) for path in PACKAGE.rglob("*.py")
            for _line, name in _direct_writes(path)}
    assert set(DIRECT_WRITES_ALLOWED) <= used, set(DIRECT_WRITES_ALLOWED) - used  # none stale


def test_the_direct_write_check_sees_each_spelling(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        'p.write_text("x")\nopen(p, "a")\np.open("wb")\ndf.to_csv(p)\nfig.savefig(p)\n'
        'shutil.copy2(a, b)\ntorch.save(state, p)\np.touch()\n'
        'open(p)\np.open()\ntext = df.to_csv()\nos.open(p, flags)\n'
        'with atomic_file(p) as fh:\n    fig.savefig(fh)\n')
    assert [line for line, _name in _direct_writes(sample)] == [1, 2, 3, 4, 5, 6, 7, 8]
