"""The result file a benchmark writes: what produced its figures, and a hash that names the sources exactly."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import result_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_result_file_records_the_sources_hash(tmp_path):
    out = tmp_path / "r.json"
    result_file.write_result(out, "demo", [{"ms": 1.0}], shape={"hidden": 64})
    record = json.loads(out.read_text())
    assert record["benchmark"] == "demo" and record["figures"] == [{"ms": 1.0}] and record["shape"] == {"hidden": 64}
    assert record["sources_sha256"] == result_file.sources_sha256()
    assert len(record["sources_sha256"]) == 64


def test_sources_hash_changes_with_any_source_and_only_with_sources(tmp_path):
    for d in result_file.SOURCE_DIRS:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    base = result_file.sources_sha256(tmp_path)
    assert base == result_file.sources_sha256(ROOT)  # the copy without git history names the same sources
    (tmp_path / "README.md").write_text("not a source\n")
    assert result_file.sources_sha256(tmp_path) == base
    kernel = tmp_path / "csrc" / "mok" / "common.cuh"
    kernel.write_text(kernel.read_text() + "\n")
    assert result_file.sources_sha256(tmp_path) != base


def test_revision_says_when_the_tree_differs_from_its_head(tmp_path):
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a")
    clean = result_file.revision(tmp_path)
    assert clean is not None and len(clean) == 12
    (tmp_path / "a.py").write_text("x = 2\n")
    assert result_file.revision(tmp_path) == clean + "+modified"
