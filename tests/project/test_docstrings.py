"""Module docstrings say in a few lines what a module is for (the long story is in docs/), checked for
api/, migrations/, tuner/ and workers/; and no code names an issue number, the tests and benchmarks too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "migrations", "tuner", "workers")
EVERY_PACKAGE = (*PACKAGES, "benchmarks", "tests")
MAX_DOCSTRING_LINES = 12
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)

# Files allowed to break a rule while their story moves to docs/ (none now). Exactly these: a new file
# breaking a rule fails the test, and so does an entry here that no longer breaks it (delete it then),
# so the lists only shrink.
KNOWN_LONG_DOCSTRINGS: set[str] = set()
KNOWN_ISSUE_NUMBERS: set[str] = set()


def docstring_lines(source: str) -> int:
    """Lines of text of the module docstring of ``source`` (0 without one)."""
    doc = ast.get_docstring(ast.parse(source), clean=True)
    return len(doc.strip().splitlines()) if doc else 0


def issue_numbers(source: str) -> list[str]:
    """``line: text`` of every mention of an issue number in ``source`` (code, comments, strings)."""
    return [f"{i}: {m.group(0)}" for i, line in enumerate(source.splitlines(), 1) for m in ISSUE_NUMBER.finditer(line)]


def _files(packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    files = [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50, len(files)
    assert {p.relative_to(ROOT).parts[0] for p in files} == set(packages)
    return files


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_module_docstrings_are_at_most_twelve_lines() -> None:
    long = {_name(p): n for p in _files() if (n := docstring_lines(p.read_text())) > MAX_DOCSTRING_LINES}
    new = {name: n for name, n in long.items() if name not in KNOWN_LONG_DOCSTRINGS}
    assert not new, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the story to docs/): {new}"
    fixed = KNOWN_LONG_DOCSTRINGS - set(long)
    assert not fixed, f"no longer over {MAX_DOCSTRING_LINES} lines: delete from KNOWN_LONG_DOCSTRINGS: {fixed}"


def test_no_issue_number_in_the_code() -> None:
    found = {_name(p): hits for p in _files(EVERY_PACKAGE) if (hits := issue_numbers(p.read_text()))}
    new = {name: hits for name, hits in found.items() if name not in KNOWN_ISSUE_NUMBERS}
    assert not new, new
    fixed = KNOWN_ISSUE_NUMBERS - set(found)
    assert not fixed, f"no issue number left: delete from KNOWN_ISSUE_NUMBERS: {fixed}"


def test_the_checks_catch_a_long_docstring_and_an_issue_number() -> None:
    long = '"""Title.\n\n' + "a line\n" * 11 + '"""\nX = 1\n'
    assert docstring_lines(long) == 13
    assert docstring_lines('"""One line."""\n') == 1 and docstring_lines("X = 1\n") == 0
    issue = "iss" + "ue"  # spelt apart so that this file names no issue number itself
    code = f'X = 1  # see {issue} 12\n"""({issue.title()} #7)"""\ny = "{issue}s 3"\nz = "an {issue}, 12 of them"\n'
    assert issue_numbers(code) == [f"1: {issue} 12", f"2: {issue.title()} #7", f"3: {issue}s 3"]
