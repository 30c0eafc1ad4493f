# Sourced (from the repository root) by the device-machine scripts (run_gpu_suite.sh): the
# log directory OUT, the build cache, and the carried wheels (.whl/, the device image has no megatron-core
# or CUTLASS headers) installed into /tmp/site. Sets MOK_SITE to "/tmp/site:" (or "" without wheels), the
# prefix of a tree's PYTHONPATH.
OUT="${OUT:-$PWD/gpu_logs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MOK_CACHE_DIR="${MOK_CACHE_DIR:-/tmp/mok_cache}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    2>&1 | tail -3
  MOK_SITE=/tmp/site:
else
  MOK_SITE=
fi
