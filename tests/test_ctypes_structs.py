"""CPU: the ctypes launch structs match the extern "C" structs of the CUDA sources field for field (name, order and
size), so a field added on one side only is caught here rather than as a garbled launch on a GPU."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from megatron_mok.kernel import backward, gemm
from megatron_mok.kernel.host import library

CSRC = Path(__file__).resolve().parents[1] / "csrc" / "mok"

# C scalar types of the launch structs and their sizes (LP64: pointers 8 bytes)
_C_SIZES = {"int": 4, "unsigned": 4, "float": 4, "double": 8, "long long": 8, "unsigned long long": 8}


def c_struct_fields(source: str, name: str) -> list[tuple[str, int]]:
    """(field, size in bytes) of `struct name { ... };` in source, in declaration order."""
    m = re.search(r"struct " + name + r" \{(.*?)\n\};", source, re.S)
    assert m is not None, f"struct {name} not found"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        decl = " ".join(decl.split())
        tm = re.match(r"((?:const )?(?:unsigned long long|long long|unsigned|int|float|double))\b(.*)", decl)
        assert tm is not None, f"struct {name}: unexpected declaration {decl!r}"
        ctype = tm.group(1).removeprefix("const ")
        for d in tm.group(2).split(","):
            d = d.strip()
            pointer = d.startswith("*")
            ident = d.lstrip("* ").removeprefix("const ").strip()
            assert re.fullmatch(r"[A-Za-z_]\w*", ident), f"struct {name}: unexpected declarator {d!r}"
            fields.append((ident, 8 if pointer else _C_SIZES[ctype]))
    return fields


@pytest.mark.parametrize(
    "source,struct,binding",
    [
        ("host/forward.cu", "MokLaunchArgs", library._Args),
        ("host/unit_entry_points.cuh", "MokFp8GemmArgs", gemm._Fp8Args),
        ("host/backward.cu", "MokBwdArgs", backward._Args),
        ("host/backward.cu", "MokWgradArgs", backward._WgradArgs),
    ],
)
def test_ctypes_struct_matches_c(source, struct, binding):
    c_fields = c_struct_fields((CSRC / source).read_text(), struct)
    py_fields = [(n, ctypes.sizeof(t)) for n, t, *_ in binding._fields_]
    assert [n for n, _ in py_fields] == [n for n, _ in c_fields], f"{struct}: field names / order differ"
    assert py_fields == c_fields, f"{struct}: field sizes differ"


def test_parser_sees_every_declarator():
    src = "struct S {\n  int a, b;  // two\n  const unsigned long long* p;\n  double t;\n  long long n;\n};"
    assert c_struct_fields(src, "S") == [("a", 4), ("b", 4), ("p", 8), ("t", 8), ("n", 8)]
