"""The result file a benchmark writes with ``--json PATH``: its figures with what produced them (the command,
the GPU, torch / CUDA, the source revision when the checkout is a git repository, the time), so a published
figure and its evidence are one file (``docs/results/``)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


def _revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


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
    environment and the revision; ``context`` adds fields (the shapes, the settings)."""
    record = {
        "benchmark": benchmark,
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], _ROOT), *sys.argv[1:]]),
        "revision": _revision(),
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **environment(),
        **context,
        "figures": figures,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"result file: {path}", flush=True)
