"""CPU: the library build applies the SASS post-pass (``megatron_mok/kernel/sass.py``) to the forward's compiled object
before linking, to nothing else, and warns when it finds nothing to patch. The compilers are stood in for: nvcc
"compiles" a synthetic CUDA object (tests/test_sass.py), the link records what it was given."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sass import BF16, FMUL, FP8, OTHER, _file

from megatron_mok.kernel import build, sass


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """Runs build_extension("sm90") with stand-in compilers; returns {object name: bytes the link got}, the log."""
    monkeypatch.setenv("MOK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_check_tools", lambda: ("nvcc", Path("/inc"), build.source_dir()))
    monkeypatch.setattr(build, "_nvcc_version", lambda nvcc: "nvcc 13.0")
    monkeypatch.setattr(build, "torch_flags", lambda: ([], []))
    linked: dict[str, bytes] = {}
    objects = {
        "forward_cu.o": {FP8: [OTHER] + [FMUL] * 110 + [OTHER], BF16: [FMUL] * 110},
        "backward_cu.o": {FP8: [FMUL] * 110},
    }

    def run_all(cmds, verbose):
        for cmd in cmds:
            out = Path(cmd[cmd.index("-o") + 1])
            if "-c" in cmd:
                sections = objects.get(out.name, {BF16: [OTHER]})
                out.write_bytes(_file(tmp_path, sections)[1])
            else:  # the link
                linked.update({Path(a).name: Path(a).read_bytes() for a in cmd if a.endswith(".o")})
                out.write_bytes(b"library")
        return ""

    monkeypatch.setattr(build, "_run_all", run_all)

    def go():
        lib = build.build_extension("sm90")
        return linked, lib.with_suffix(".log").read_text()

    return go, objects


def test_the_forward_object_is_patched_before_the_link(fake_build, tmp_path):
    go, objects = fake_build
    linked, log = go()
    original = _file(tmp_path, objects["forward_cu.o"])[1]
    runs = sass.promotion_runs(original)
    assert len(runs) == 1 and linked["forward_cu.o"] != original
    flipped = [k for k in range(runs[0].length) if linked["forward_cu.o"][runs[0].offset + 16 * k + 8 :][:8]
               != original[runs[0].offset + 16 * k + 8 :][:8]]  # fmt: skip
    assert flipped == list(range(1, 110, 2))
    assert linked["backward_cu.o"] == _file(tmp_path, objects["backward_cu.o"])[1]  # only the forward is patched
    assert "sass post-pass: yield hints interleaved in 1 FP8 promotion runs of host/forward.cu (110 FMULs)" in log


def test_a_forward_object_without_runs_is_linked_as_compiled_with_a_warning(fake_build, tmp_path):
    go, objects = fake_build
    objects["forward_cu.o"] = {BF16: [FMUL] * 110}
    with pytest.warns(UserWarning, match="no FP8 promotion FMUL runs in forward_cu.o"):
        linked, log = go()
    assert linked["forward_cu.o"] == _file(tmp_path, objects["forward_cu.o"])[1]
    assert "linked as compiled" in log
