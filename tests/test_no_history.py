"""The project's files describe the product, not how it was developed.

Development history (numbered work sessions, issue numbers, log dumps and dated run names) lives in git
history and the issue tracker. This test fails when such a marker enters a text file of the project.
"""

from __future__ import annotations

import os
import re
import subprocess
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


def _is_text(path: Path) -> bool:
    return (path.suffix in TEXT_SUFFIXES or path.name == "run") and path.resolve() != THIS_FILE


def project_text_files() -> list[Path]:
    """The project's text files: in a git checkout the tracked ones and the untracked ones git does not ignore (a
    developer's ignored scratch copies of other trees are not the project); elsewhere every file outside SKIP_DIRS."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO, capture_output=True, check=True, timeout=60,
        ).stdout.decode()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        listed = None
    if listed is not None:
        return [p for name in listed.split("\0") if name and (p := REPO / name).is_file() and _is_text(p)]
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        files.extend(p for name in names if _is_text(p := Path(root) / name))
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
