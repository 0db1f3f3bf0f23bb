#!/usr/bin/env bash
# Build gpu_extras/: the optional packages the GPU machine lacks, as cp312 wheels from the
# registry, apart from gpu_bundle/ so that a device call carries them only when it needs them
# (each call carries at most 64 MiB). Today: xgrammar and what it needs that the GPU image does
# not have, for structured outputs (~7.5 MB).
#
#   scripts/package_gpu_extras.sh
#
# On the GPU machine (carry gpu_extras and models/tiny-llama):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/extras gpu_extras/*.whl
#   PYTHONPATH=/tmp/extras python3 -m pytest tests/engine/test_structured_output.py --confcutdir=tests/engine
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/gpu_extras"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
# xgrammar's own pins (requirements.txt) and its dependencies missing from the image
# (typing-extensions, torch, transformers, triton and numpy are there).
WANT=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5)

rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$OUT" "${WANT[@]}"
(cd "$OUT" && sha256sum ./*.whl | sed 's| \./| |' > MANIFEST.txt && cat MANIFEST.txt)
echo "$OUT: $(du -sh "$OUT" | cut -f1)"
