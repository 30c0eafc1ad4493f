"""The result file a benchmark writes with ``--json PATH``: its figures with what produced them (the command,
the GPU, torch / CUDA, the git revision when the checkout is a git repository, a hash of the sources, the time),
so a published figure and its evidence are one file (``docs/results/``).

The hash covers the sources that decide a figure (``SOURCE_DIRS``), as they are on disk: a copy of the tree without
its git history, or with uncommitted changes, still names exactly what ran. ``python benchmarks/result_file.py``
prints this checkout's hash, to compare with a result file's ``sources_sha256``."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def revision(root: Path = _ROOT) -> str | None:
    """The checkout's HEAD, with "+modified" when tracked files differ from it (a copy of a working tree can carry a
    stale git directory: then the sources' hash is what names the code), or None outside git."""
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    if not head:
        return None
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head + ("+modified" if dirty else "")


SOURCE_DIRS = ("megatron_mok", "csrc", "benchmarks", "tools", "examples")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h", ".yaml")


def sources_sha256(root: Path = _ROOT) -> str:
    """sha256 over the relative path and the bytes of every source file under ``SOURCE_DIRS``, in path order."""
    h = hashlib.sha256()
    files = sorted(
        p
        for d in SOURCE_DIRS
        for p in (root / d).rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts
    )
    for p in files:
        rel = p.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "little") + rel)
        data = p.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def environment() -> dict[str, Any]:
    """The GPU, its SM count and clocks' context, torch and CUDA versions."""
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        env["device"] = "cpu"
    return env


def write_result(path: str | os.PathLike, benchmark: str, figures: Any, **context: Any) -> None:
    """Write ``figures`` (JSON-serialisable) to ``path`` with the benchmark's name, its command line, the
    environment, the revision and the sources' hash; ``context`` adds fields (the shapes, the settings)."""
    record = {
        "benchmark": benchmark,
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], _ROOT), *sys.argv[1:]]),
        "revision": revision(),
        "sources_sha256": sources_sha256(),
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **environment(),
        **context,
        "figures": figures,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"result file: {path}", flush=True)


if __name__ == "__main__":
    print(sources_sha256())
