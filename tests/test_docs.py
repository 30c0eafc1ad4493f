"""The user documentation's evidence: every published figure's result file exists and says what produced it,
every link into docs/ resolves, and every picture in docs/ is shown somewhere."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))
_LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _links(doc: Path) -> list[Path]:
    return [(doc.parent / m).resolve() for m in _LINK.findall(doc.read_text()) if "://" not in m]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc: Path) -> None:
    missing = [str(p.relative_to(ROOT)) for p in _links(doc) if not p.exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_every_picture_is_shown() -> None:
    shown = {p for doc in DOCS for p in _links(doc)}
    unshown = [p.name for p in (ROOT / "docs").glob("*.png") if p.resolve() not in shown]
    assert not unshown, f"pictures in docs/ that no document shows: {unshown}"


def test_result_files_exist_and_are_cited() -> None:
    assert RESULTS, "docs/results holds no result file"
    cited = {p for p in _links(ROOT / "README.md")}
    uncited = [p.name for p in RESULTS if p.resolve() not in cited]
    assert not uncited, f"result files the README's performance table does not cite: {uncited}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_file_says_what_produced_it(path: Path) -> None:
    record = json.loads(path.read_text())
    for key in ("benchmark", "command", "device", "torch", "utc", "figures"):
        assert record.get(key), f"{path.name}: no {key!r}"
    script = record["command"].split()[1]
    assert (ROOT / script).is_file(), f"{path.name}: its command runs {script}, which does not exist"
    assert f"--json {path.relative_to(ROOT)}" in record["command"], f"{path.name} was not written by its command"
