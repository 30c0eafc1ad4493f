"""The project's files describe the product, not how it was developed.

Development history (numbered work sessions, issue numbers, log dumps and dated run names) lives in git
history and the issue tracker. This test fails when such a marker enters a text file of the project.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Ordinal words a diary numbers its work periods with (an ordinal before the word for a period).
_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
MARKERS: dict[str, re.Pattern[str]] = {
    "numbered work session": re.compile(rf"\b(?:{_ORDINALS})\s+session\b|\bsession\s+\d+\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s*#\s*\d+|\(#\d+\)", re.IGNORECASE),
    "measurement notes file": re.compile(r"\bNOTES-[a-z-]+\.md\b"),
    "log dump path": re.compile(r"\bscripts/logs\b"),
    "dated run name": re.compile(r"\bh[12]00-20\d\d-\d\d-\d\d[a-z]?\b"),
}

TEXT_SUFFIXES = {".py", ".md", ".cu", ".cuh", ".h", ".cpp", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg"}
SKIP_DIRS = {".git", ".venv", ".before", ".whl", "__pycache__", "build", "dist", "gpu_logs", "node_modules"}
THIS_FILE = Path(__file__).resolve()


def project_text_files() -> list[Path]:
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in names:
            path = Path(root) / name
            if (path.suffix in TEXT_SUFFIXES or name == "run") and path.resolve() != THIS_FILE:
                files.append(path)
    return files


def find_markers(text: str) -> list[tuple[int, str, str]]:
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in MARKERS.items():
            match = pattern.search(line)
            if match:
                hits.append((lineno, what, match.group(0)))
    return hits


@pytest.mark.parametrize(
    "line",
    [
        "measured in the sixteenth " + "session",
        "Session" + " 12 moved the pull",
        "fixed in issue " + "#34",
        "see (" + "#31)",
        "details in NOTES-kernel.md",
        "logs in scripts/logs/",
        "h100-2026-12-05e-run1-bench-fp8.log",
    ],
)
def test_markers_are_detected(line: str) -> None:
    assert find_markers(line), line


@pytest.mark.parametrize(
    "line",
    [
        "a torch.distributed session of 4 ranks",
        "the first token of the session",
        "ring slot 3 of 4",
        "the kimi-k2 config",
    ],
)
def test_product_wording_passes(line: str) -> None:
    assert not find_markers(line), line


def test_project_files_carry_no_development_history() -> None:
    files = project_text_files()
    assert len(files) > 50, f"only {len(files)} text files found under {REPO}"
    offenders = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, what, found in find_markers(text):
            offenders.append(f"{path.relative_to(REPO)}:{lineno}: {what}: {found!r}")
    assert not offenders, "development history in project files:\n" + "\n".join(offenders)
