#!/usr/bin/env bash
# Build gpu_bundle/: what the GPU machine lacks to run the benchmark (it has no registry access),
# from registry packages only, small enough to travel with the working tree (64 MiB per call).
#
#   scripts/package_gpu_bundle.sh [--force]
#
# TRITIUM_BUNDLE_PYVER (default 3.12, the GPU machine's Python) and TRITIUM_BUNDLE_DIR (default
# gpu_bundle/) build the same bundle for another Python, e.g. 3.11 to rehearse
# benchmarks/gpu.sh e2e on this CPU machine.
#
#   gpu_bundle/tritonserver-2.51.0-py312.tar.xz   tritonserver + python backend + 3.12 stub +
#                                                  nvidia_pytriton.libs (no libpython), laid out
#                                                  as in site-packages (from nvidia-pytriton 0.7.0)
#   gpu_bundle/numpy-1.26.4-cp312-*.whl            numpy < 2: the stub crashes on BYTES with 2.x
#   gpu_bundle/tritonclient-2.51.0-*.whl           the client without its 20 MB perf_analyzer
#   gpu_bundle/python_rapidjson-*-cp312-*.whl      tritonclient's JSON dependency
#   gpu_bundle/perf_analyzer-2.51.0.tar.xz         perf_analyzer + Debian's libb64
#   gpu_bundle/frontend-wheels/*.whl               the OpenAI frontend's packages (fastapi,
#                                                  uvicorn, httptools, pydantic, ...) and aiohttp
#                                                  for benchmarks/loadgen/bench.py --openai, with
#                                                  their dependencies; not uvloop (4.5 MB would
#                                                  pass the limit): uvicorn then runs asyncio's
#                                                  own loop
#   gpu_bundle/MANIFEST.txt                        sizes and sha256
#
# Downloads are cached in $TRITIUM_WHEEL_CACHE (default ~/.cache/tritium-gpu-wheels); each
# artifact is built once and kept (--force rebuilds them). gpu_bundle/ is ignored by git: name it
# in the device call's `carry`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${TRITIUM_BUNDLE_DIR:-$ROOT/gpu_bundle}"
PYVER="${TRITIUM_BUNDLE_PYVER:-3.12}"
CP="cp${PYVER/./}"
CACHE="${TRITIUM_WHEEL_CACHE:-$HOME/.cache/tritium-gpu-wheels}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
# The working tree (~3 MiB) travels too, within the device call's 64 MiB.
LIMIT_MIB=58
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

PYTRITON_WHL=nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl
NUMPY_WHL=numpy-1.26.4-$CP-$CP-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
CLIENT_WHL=tritonclient-2.51.0-py3-none-manylinux1_x86_64.whl
RAPIDJSON_WHL=python_rapidjson-1.25-$CP-$CP-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl

mkdir -p "$CACHE" "$OUT"

fetch_wheel() {  # fetch_wheel FILE REQUIREMENT
    [ -f "$CACHE/$1" ] && return 0
    echo "downloading $2"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$CACHE" "$2"
    [ -f "$CACHE/$1" ] || { echo "expected $CACHE/$1 after downloading $2" >&2; exit 1; }
}
fetch_wheel "$PYTRITON_WHL" nvidia-pytriton==0.7.0
fetch_wheel "$NUMPY_WHL" numpy==1.26.4
fetch_wheel "$CLIENT_WHL" tritonclient==2.51.0
fetch_wheel "$RAPIDJSON_WHL" python-rapidjson==1.25
# The frontend's pins in requirements.txt, resolved with their dependencies for the target Python.
FRONTEND_WANT=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 aiohttp==3.14.5
               pydantic==2.14.4)
FRONTEND_CACHE="$CACHE/frontend-$CP-$(echo "${FRONTEND_WANT[*]}" | sha256sum | cut -c1-12)"
if [ ! -f "$FRONTEND_CACHE/.complete" ]; then
    echo "downloading the frontend's wheels"
    rm -rf "$FRONTEND_CACHE" && mkdir -p "$FRONTEND_CACHE"
    "$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$FRONTEND_CACHE" "${FRONTEND_WANT[@]}"
    touch "$FRONTEND_CACHE/.complete"
fi
if ! ls "$CACHE"/libb64-0d_*_amd64.deb >/dev/null 2>&1; then
    echo "downloading Debian's libb64-0d"
    (cd "$CACHE" && apt-get download libb64-0d:amd64) || {
        echo "apt-get download libb64-0d failed: run 'apt-get update' first" >&2; exit 1; }
fi

need() {  # need ARTIFACT: true when it must be (re)built
    [ "$FORCE" = 1 ] || [ ! -s "$OUT/$1" ]
}

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
TAR_OPTS=(--sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner)

SERVER_TAR=tritonserver-2.51.0-py${PYVER/./}.tar.xz
if need "$SERVER_TAR"; then
    echo "building $SERVER_TAR"
    S="$WORK/server"
    mkdir -p "$S"
    (cd "$S" && unzip -q "$CACHE/$PYTRITON_WHL" 'pytriton/tritonserver/*' 'nvidia_pytriton.libs/*')
    # Only the stub of the target Python, and no libpython: the 3.13 one is 32 MB and the stub
    # links the machine's own libpython3.X.
    find "$S/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name "$PYVER" -exec rm -rf {} +
    rm -f "$S"/nvidia_pytriton.libs/libpython3*
    rm -rf "$S/pytriton/tritonserver/backends/python/__pycache__"
    # A package marker so that `import pytriton` finds the server (scripts/tritonserver does):
    # the wheel's own __init__ imports the whole pytriton library, which is not carried.
    printf '"""Only the tritonserver bundle of nvidia-pytriton 0.7.0 (scripts/package_gpu_bundle.sh)."""\n' \
        > "$S/pytriton/__init__.py"
    tar -C "$S" "${TAR_OPTS[@]}" -cf - pytriton nvidia_pytriton.libs | xz -T0 -6 > "$OUT/$SERVER_TAR.part"
    mv "$OUT/$SERVER_TAR.part" "$OUT/$SERVER_TAR"
fi

need "$NUMPY_WHL" && cp "$CACHE/$NUMPY_WHL" "$OUT/"
need "$RAPIDJSON_WHL" && cp "$CACHE/$RAPIDJSON_WHL" "$OUT/"

if need "$CLIENT_WHL"; then
    echo "repacking $CLIENT_WHL without its binaries"
    "$PY" - "$CACHE/$CLIENT_WHL" "$OUT/$CLIENT_WHL.part" <<'PYEOF'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
drop = lambda name: "/data/bin/" in name  # perf_analyzer, perf_client: 40 MB unpacked
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if drop(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not drop(l.split(",", 1)[0])).encode()
        zout.writestr(info, data)
PYEOF
    mv "$OUT/$CLIENT_WHL.part" "$OUT/$CLIENT_WHL"
fi

PA_TAR=perf_analyzer-2.51.0.tar.xz
if need "$PA_TAR"; then
    echo "building $PA_TAR"
    P="$WORK/pa"
    mkdir -p "$P/bin" "$P/lib" "$WORK/deb"
    unzip -q -j "$CACHE/$CLIENT_WHL" 'tritonclient-2.51.0.data/data/bin/perf_analyzer' -d "$P/bin"
    dpkg-deb -x "$(ls "$CACHE"/libb64-0d_*_amd64.deb | head -n1)" "$WORK/deb"
    cp -L "$WORK"/deb/usr/lib/x86_64-linux-gnu/libb64.so.0d "$P/lib/"
    tar -C "$P" "${TAR_OPTS[@]}" -cf - bin lib | xz -T0 -6 > "$OUT/$PA_TAR.part"
    mv "$OUT/$PA_TAR.part" "$OUT/$PA_TAR"
fi

rm -rf "$OUT/frontend-wheels" && mkdir -p "$OUT/frontend-wheels"
cp "$FRONTEND_CACHE"/*.whl "$OUT/frontend-wheels/"

# Anything else in gpu_bundle/ (older versions) would travel too: remove it.
for f in "$OUT"/*; do
    case "$(basename "$f")" in
        "$SERVER_TAR"|"$NUMPY_WHL"|"$RAPIDJSON_WHL"|"$CLIENT_WHL"|"$PA_TAR"|MANIFEST.txt|frontend-wheels) ;;
        *) echo "removing stale $(basename "$f")"; rm -rf "$f" ;;
    esac
done

(cd "$OUT" && for f in "$SERVER_TAR" "$NUMPY_WHL" "$CLIENT_WHL" "$RAPIDJSON_WHL" "$PA_TAR" frontend-wheels/*.whl; do
    printf '%s  %10d  %s\n' "$(sha256sum "$f" | cut -d' ' -f1)" "$(stat -c %s "$f")" "$f"
done) > "$OUT/MANIFEST.txt"
cat "$OUT/MANIFEST.txt"
TOTAL=$(du -cb "$OUT" | tail -n1 | cut -f1)
echo "$OUT: $((TOTAL / 1024 / 1024)) MiB ($TOTAL bytes), limit $LIMIT_MIB MiB"
if [ "$TOTAL" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "$OUT is over $LIMIT_MIB MiB: it would not travel with the working tree" >&2
    exit 1
fi
