#!/usr/bin/env bash
# The offload backend's C extension under AddressSanitizer + UndefinedBehaviorSanitizer:
# built into build/sanitize (the in-place build beside the package is left alone), then
# the tests that drive it run against that build with the ASan runtime preloaded into
# the interpreter. Any report fails the run (halt_on_error); leak checking is off (the
# interpreter itself keeps memory until exit on purpose).
#
#   scripts/sanitize.sh                     # the default test files below
#   scripts/sanitize.sh tests/offload/test_native.py -k digest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=build/sanitize
FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"

rm -rf "$OUT"
mkdir -p "$OUT"
CFLAGS="$FLAGS" LDFLAGS="-fsanitize=address,undefined" \
  "$PY" -c "from setuptools import setup; setup()" build_ext \
  --build-lib "$OUT/lib" --build-temp "$OUT/tmp" --force >"$OUT/build.log" 2>&1 ||
  { cat "$OUT/build.log" >&2; exit 1; }
# The package as it is in the tree, with the sanitized extension in it.
so=$(ls "$OUT"/lib/kvtier_offload/_native*.so)
cp offload/kvtier_offload/*.py "$OUT/lib/kvtier_offload/"

asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
[ -e "$asan" ] && [ -e "$ubsan" ] || { echo "sanitize: gcc has no libasan/libubsan" >&2; exit 1; }

export LD_PRELOAD="$asan:$ubsan"
# Reports go to files (pytest captures stderr, and the abort loses it), shown below.
export ASAN_OPTIONS="log_path=$PWD/$OUT/report:detect_leaks=0:halt_on_error=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
export UBSAN_OPTIONS="log_path=$PWD/$OUT/report:halt_on_error=1:print_stacktrace=1"
export PYTHONPATH="$PWD/$OUT/lib:$PWD/operator:$PWD/evictor"
export PYTHONMALLOC=malloc  # every Python allocation through ASan's malloc too
export KVTIER_OFFLOAD_NATIVE=1

# Fail loudly if the tests would not run the sanitized build.
"$PY" - "$so" <<'EOF'
import os, sys
from kvtier_offload import native
assert native.module is not None, native.REASON
assert os.path.samefile(native.module.__file__, sys.argv[1]), native.module.__file__
print("sanitize: testing", native.module.__file__, "XXH3 build", native.module.XXH3_BUILD)
EOF

if [ $# -eq 0 ]; then
  set -- tests/offload/test_native.py tests/offload/test_batchio.py \
    tests/offload/test_store.py tests/offload/test_digest.py \
    tests/offload/test_hostile_files.py tests/offload/test_enospc.py \
    tests/offload/test_estale.py tests/offload/test_syscalls.py -q -p no:cacheprovider \
    --deselect tests/offload/test_native.py::test_importing_the_backend_costs_under_half_a_second_and_20_mb
  # (that one measures import RSS, which ASan's shadow memory inflates past its limit)
fi
rc=0
"$PY" -m pytest "$@" || rc=$?
if ls "$OUT"/report.* >/dev/null 2>&1; then
  cat "$OUT"/report.* >&2
  echo "sanitize: the sanitizers reported the above" >&2
  exit 1
fi
exit $rc
