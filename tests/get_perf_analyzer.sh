#!/usr/bin/env bash
# Fetches Triton's perf_analyzer (C++) for the ensemble test in tests/test_triton_server.py, from the
# package registries only: the tritonclient 2.41.0 wheel is the last one that ships the binary
# (bin/perf_analyzer); it links libb64 (Debian's libb64-0d) and libcudart.so.12 (PyPI's
# nvidia-cuda-runtime-cu12, loaded but unused without --shared-memory cuda). Nothing goes into the
# virtualenv: the wheel would replace the tritonclient the project uses. The result is a wrapper at
# $DEST/perf_analyzer (default $XDG_CACHE_HOME/tokenmill/perf_analyzer, else ~/.cache/...), where the
# test looks for it. Needs `pip` and `apt-get download` (run `apt-get update` once first).
set -euo pipefail
DEST="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmill/perf_analyzer}"
PIP="${PIP:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST/lib"
cd "$work"
"$PIP" download --quiet --no-deps "tritonclient==2.41.0" "nvidia-cuda-runtime-cu12" -d .
apt-get download libb64-0d >/dev/null 2>&1
python3 -m zipfile -e tritonclient-2.41.0-*.whl tc
python3 -m zipfile -e nvidia_cuda_runtime_cu12-*.whl cudart
dpkg-deb -x libb64-0d_*.deb b64
install -m 755 tc/tritonclient-2.41.0.data/data/bin/perf_analyzer "$DEST/perf_analyzer.bin"
cp "$(find cudart -name libcudart.so.12)" "$(find b64 -name 'libb64.so.0d')" "$DEST/lib/"
cat >"$DEST/perf_analyzer" <<'EOF'
#!/usr/bin/env bash
here="$(dirname "$(readlink -f "$0")")"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/perf_analyzer.bin" "$@"
EOF
chmod +x "$DEST/perf_analyzer"
"$DEST/perf_analyzer" --version
