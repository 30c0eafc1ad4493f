"""CPU: the kernel build has one build-time variant, the timing-ablation build (MOK_DEBUG=ablation, used by the
benchmark and hang-diagnosis tools); it reaches nvcc (and so the cache key), and nothing else does."""

from __future__ import annotations

from pathlib import Path

from megatron_mok.kernel import build


def test_default_build_has_no_switches(monkeypatch):
    monkeypatch.delenv("MOK_DEBUG", raising=False)
    flags = build.nvcc_flags(Path("/inc"), Path("/src"))
    assert build.build_choices() == {"MOK_ABLATION": 0}
    assert not [f for f in flags if f.startswith("-D")], flags


def test_ablation_build_reaches_nvcc(monkeypatch):
    monkeypatch.setenv("MOK_DEBUG", "ablation=32")
    assert "-DMOK_ABLATION" in build.nvcc_flags(Path("/inc"), Path("/src"))


def test_sources_read_no_build_switch_but_the_ablation_one():
    """The CUDA sources know no build-time switch beyond MOK_ABLATION (variants that lost were deleted)."""
    import re

    names = set()
    for p in build.source_dir().rglob("*.cu*"):
        names |= set(re.findall(r"#\s*(?:ifn?def|if)\s+(MOK_\w+)", p.read_text()))
    assert names <= {"MOK_ABLATION"}, names


def test_fat_binaries_uncompressed_where_nvcc_knows_how():
    """The SASS post-pass reads the kernel objects' cubins: nvcc >= 12.4 is told not to compress them, older ones
    (which do not know the option) are not."""
    assert "--compress-mode=none" in build.nvcc_flags(Path("/inc"), Path("/src"), release=(13, 0))
    assert "--compress-mode=none" not in build.nvcc_flags(Path("/inc"), Path("/src"), release=(12, 3))
    assert build.nvcc_release("Cuda compilation tools, release 12.8, V12.8.93") == (12, 8)
