#!/usr/bin/env bash
# Install megatron-mok (editable) with what its tests need, on CPU or GPU machines.
#   bash tools/install.sh            # uses the active python / venv
# * CPU-only machine without torch: installs the CPU build of torch (not a multi-GB CUDA build).
# * Python 3.11: megatron-core >= 0.17 declares Requires-Python >= 3.12, yet its cp311 wheel works;
#   it is installed alone with --ignore-requires-python (never for other packages: that would pick
#   their 3.12-only releases).
# * nvidia-cutlass (CuTe headers for the CUDA kernel) is installed without its unneeded deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then pip_ torch; else pip_ "torch==2.13.0" || pip_ torch --index-url https://download.pytorch.org/whl/cpu; fi
fi
MCORE="megatron-core>=0.19,<0.21"
if "$PY" -c "import sys; sys.exit(0 if sys.version_info < (3, 12) else 1)"; then
  pip_ --ignore-requires-python --no-deps "$MCORE"
  pip_ numpy "packaging>=24.2"
fi
pip_ --no-deps "nvidia-cutlass==4.2.0.0" || echo "install.sh: nvidia-cutlass not installed; the kernel compile test will skip" >&2
pip_ -e ".[test]"
"$PY" -m megatron_mok.cli info
