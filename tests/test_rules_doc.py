"""Rule documentation: docs/rules.md is generated from the registry, every rule explains itself,
and `gpudiag rules` shows it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import invoke

from gpudiag.diagnose import Rule, all_rules
from gpudiag.model.errors import ExitCode
from gpudiag.present import rules_markdown

RULES_MD = Path(__file__).resolve().parent.parent / "docs" / "rules.md"
SECTIONS = ("What it detects", "Thresholds", "What it prices", "Why it matters",
            "How to fix")


def test_docs_rules_md_is_generated_from_the_registry() -> None:
    assert RULES_MD.read_text() == rules_markdown(all_rules()), (
        "docs/rules.md is stale: regenerate with `gpudiag rules --markdown > docs/rules.md`")


def test_rules_markdown_has_a_section_per_rule() -> None:
    text = rules_markdown(all_rules())
    for r in all_rules():
        assert f"| [{r.code}](#{r.code.lower()}-{r.name}) | {r.name} |" in text
        assert f"\n## {r.code} {r.name}\n" in text
        for t in r.thresholds:
            assert f"- {t.name} = {t.value:g}: " in text
    assert text.count("\n### What it detects\n") == len(all_rules())


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.code)
def test_rule_is_documented(rule: Rule) -> None:
    assert re.fullmatch(r"GD\d{3}", rule.code)
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name)
    assert rule.concern.strip()
    for text in (rule.summary, rule.why, rule.fix):
        assert text.strip()
    assert "\n" not in rule.summary
    assert (rule.check.__doc__ or "").strip(), f"{rule.code}: its check has no docstring"
    names = [t.name for t in rule.thresholds]
    assert len(set(names)) == len(names)
    for t in rule.thresholds:
        assert t.why.strip(), f"{rule.code} {t.name}: no reason"
    # What `gpudiag rules CODE` prints is what decides the rule (tests/test_architecture.py
    # checks the rule's source reads no other number).
    shown = " ".join(invoke(["rules", rule.code], terminal_width=200)
                     .stdout.split())
    for t in rule.thresholds:
        assert f"{t.name} = {t.value:g}" in shown, (rule.code, t.name)


def test_rule_codes_and_names_are_unique_and_live_in_their_family_file() -> None:
    """GD301 is found from the file list: a rule GDnxx lives in diagnose/gdn_<family>.py."""
    rules = all_rules()
    codes, names = [r.code for r in rules], [r.name for r in rules]
    assert len(set(codes)) == len(codes) and len(set(names)) == len(names)
    for r in rules:
        module = r.check.__module__.rsplit(".", 1)[-1]
        assert module.startswith(f"gd{r.code[2]}_"), (r.code, module)


def test_rules_lists_every_code() -> None:
    result = invoke(["rules"])
    assert result.exit_code == 0, result.output
    for r in all_rules():
        assert r.code in result.stdout and r.name in result.stdout


@pytest.mark.parametrize("key", ["GD101", "gd101", "python-loop-launches"])
def test_rules_explains_one_rule(key: str) -> None:
    result = invoke(["rules", key])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "GD101 python-loop-launches" in out
    for heading in SECTIONS:
        assert heading in out
    assert "min_direct_calls_per_step = 64" in out
    others = [r.summary for r in all_rules() if r.code != "GD101"]
    assert not [s for s in others if s in out]  # one rule, not the list


def test_rules_markdown_option_prints_the_document() -> None:
    result = invoke(["rules", "--markdown"])
    assert result.exit_code == 0, result.output
    assert result.stdout == rules_markdown(all_rules())


def test_unknown_rule_is_a_one_line_error() -> None:
    result = invoke(["rules", "GD999"])
    assert result.exit_code == ExitCode.BAD_INPUT == 2
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "unknown rule 'GD999'" in err and "GD101" in err
    assert result.stdout == "" and "Traceback" not in result.output
