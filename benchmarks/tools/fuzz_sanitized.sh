#!/usr/bin/env bash
# The ring cores' fuzz tests against a compiled core built with AddressSanitizer and UBSan.
#
#     tools/fuzz_sanitized.sh [EXAMPLES]      (default 20000 examples per fuzz test)
#
# Builds aioshmq/_ringcore_c.c and _plainpickle.c with -fsanitize=address,undefined into a
# scratch copy of the package (the checkout is not touched), then runs tests/test_ringcore.py
# and tests/test_plainpickle.py there with the sanitizer runtime preloaded.  Any read outside
# a ring (the fuzz puts rings on the heap, where ASan sees overruns) or a pickle's buffer, any
# undefined behaviour (an unaligned or overflowing access) aborts the run.  Not part of CI: it
# takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
examples="${1:-20000}"
python="${PYTHON:-.venv/bin/python}"
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
scratch="$(mktemp -d /tmp/aioshmq-asan.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT

mkdir -p "$scratch/aioshmq"
cp -r aioshmq/. "$scratch/aioshmq/"
rm -f "$scratch"/aioshmq/_ringcore_c*.so
cp -r tests pyproject.toml setup.py README.md "$scratch/"

flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
(cd "$scratch" && CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    "$python" setup.py -q build_ext --inplace >/dev/null)

asan="$(gcc -print-file-name=libasan.so)"
ubsan="$(gcc -print-file-name=libubsan.so)"
cd "$scratch"
export LD_PRELOAD="$asan $ubsan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"  # CPython's own allocations are not leaks
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export AIOSHMQ_FUZZ_EXAMPLES="$examples"
"$python" -c 'import aioshmq, aioshmq._ringcore_c as c; assert aioshmq.CORE == "compiled"; print("sanitized core:", c.__file__)'
"$python" -m pytest -q -p no:cacheprovider tests/test_ringcore.py tests/test_plainpickle.py -k "not share_a_ring"
