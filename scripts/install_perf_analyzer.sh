#!/usr/bin/env bash
# Install perf_analyzer into .perf_analyzer/ (git-ignored), runnable as .perf_analyzer/perf_analyzer.
#
# The binary is the one in the tritonclient==2.51.0 wheel (pip puts it in the venv's bin/; the
# PyPI perf-analyzer package needs glibc 2.38, newer than Debian 12's). It needs libb64.so.0d
# and a libcudart.so.12: libb64 is taken from the system, else from the copy inside
# nvidia-pytriton, else from Debian's libb64-0d package unpacked here (no root needed);
# libcudart.so.12 is a link to the CUDA runtime that nvidia-pytriton bundles.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRITIUM_VENV:-$ROOT/.venv}"
DEST="$ROOT/.perf_analyzer"
BIN="$VENV/bin/perf_analyzer"
[ -x "$BIN" ] || { echo "no $BIN: install tritonclient[all]==2.51.0 (make venv)" >&2; exit 1; }
LIBS="$("$VENV/bin/python" -c 'import os, pytriton
print(os.path.normpath(os.path.join(os.path.dirname(pytriton.__file__), "..", "nvidia_pytriton.libs")))')"

mkdir -p "$DEST/lib"
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
    bundled="$(ls "$LIBS"/libb64-*.so.0d 2>/dev/null | head -n1 || true)"
    if [ -n "$bundled" ]; then
        ln -sf "$bundled" "$DEST/lib/libb64.so.0d"
    elif [ ! -e "$DEST/lib/libb64.so.0d" ]; then
        tmp="$(mktemp -d)"
        (cd "$tmp" && apt-get download libb64-0d >/dev/null && dpkg -x libb64-0d_*.deb root)
        cp -L "$tmp"/root/usr/lib/x86_64-linux-gnu/libb64.so.0d "$DEST/lib/"
        rm -rf "$tmp"
    fi
fi
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libcudart\.so\.12'; then
    ln -sf "$(ls "$LIBS"/libcudart-*.so.12* | head -n1)" "$DEST/lib/libcudart.so.12"
fi
cp "$BIN" "$DEST/perf_analyzer.bin"
cat > "$DEST/perf_analyzer" <<WRAPPER
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$DEST/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$DEST/perf_analyzer.bin" "\$@"
WRAPPER
chmod +x "$DEST/perf_analyzer" "$DEST/perf_analyzer.bin"
"$DEST/perf_analyzer" --version >/dev/null 2>&1 || true
if LD_LIBRARY_PATH="$DEST/lib" ldd "$DEST/perf_analyzer.bin" | grep -q "not found"; then
    LD_LIBRARY_PATH="$DEST/lib" ldd "$DEST/perf_analyzer.bin" | grep "not found" >&2
    exit 1
fi
echo "perf_analyzer installed: $DEST/perf_analyzer"
