#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source, for compare.py.
#
#   bash benchmarks/peers/setup_llamacpp.sh
#
# No llama.cpp binary can be downloaded here, but the source distribution of `llama-cpp-python`
# on PyPI carries llama.cpp in vendor/llama.cpp (a shallow git checkout, so its commit is known).
# This script fetches that sdist with pip, unpacks it and builds only the `llama-server` target.
#
# Environment:
#   PEERS_DIR                  where the peers live (default ~/.cache/tokenmill-peers)
#   LLAMACPP_DIR               where llama.cpp goes (default $PEERS_DIR/llama.cpp)
#   LLAMA_CPP_PYTHON_VERSION   the sdist (default: the one these scripts were checked with)
#   JOBS                       parallel compile jobs (default 2)
#   PYTHON                     interpreter for pip (default python3)
#   MAX_ISA=avx2               build for an AVX2-only CPU (AMD Zen 3, most laptops) on any x86 CPU:
#                              AVX-512 and VNNI off, into $PEERS_DIR/llama.cpp-avx2 unless LLAMACPP_DIR
#                              says otherwise; set against tokenmill held to AVX2 (TOKENMILL_MAX_ISA)
#
# Build choices:
#   - Release, static, llama-server only; no CURL (this llama.cpp no longer links libcurl at all;
#     LLAMA_CURL=OFF is kept for older sdists), no OpenSSL, no web UI (LLAMA_USE_PREBUILT_UI would otherwise try
#     to download the UI at build time).
#   - AMX off. With GGML_NATIVE=ON the compiler gets -march=native, which on a CPU with AMX
#     defines __AMX_INT8__ and compiles ggml's AMX kernels in whatever GGML_AMX_* says; those
#     kernels crash on these machines. So GGML_NATIVE=OFF and the x86 extensions are enabled one
#     by one from /proc/cpuinfo (AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX512 F/VBMI/VNNI/BF16), with
#     GGML_AMX_TILE/INT8/BF16 OFF. The result is as fast as native minus AMX.
#   - The compile runs under `nice -n 19` with -j ${JOBS:-2}.
#
# Idempotent: an existing llama-server built from the same sdist with the same flags is kept.
set -euo pipefail

PEERS_DIR="${PEERS_DIR:-$HOME/.cache/tokenmill-peers}"
MAX_ISA="${MAX_ISA:-}"
[[ -z "$MAX_ISA" || "$MAX_ISA" == avx2 ]] || { echo "[setup_llamacpp] error: MAX_ISA must be avx2 or unset" >&2; exit 1; }
LLAMACPP_DIR="${LLAMACPP_DIR:-$PEERS_DIR/llama.cpp${MAX_ISA:+-$MAX_ISA}}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

say() { printf '[setup_llamacpp] %s\n' "$*"; }
die() { printf '[setup_llamacpp] error: %s\n' "$*" >&2; exit 1; }

SRC_ROOT="$LLAMACPP_DIR/llama_cpp_python-$VERSION"
SRC="$SRC_ROOT/vendor/llama.cpp"
BUILD="$LLAMACPP_DIR/build-$VERSION"
BIN="$BUILD/bin/llama-server"
LINK="$LLAMACPP_DIR/llama-server"   # stable path compare.py looks at

# --- x86 flags from this CPU, AMX always off -------------------------------------------------
cpu_has() {
    # Held to AVX2: the extensions an AVX2-only CPU lacks count as absent.
    if [[ "$MAX_ISA" == avx2 && "$1" =~ ^(avx512|avx_vnni) ]]; then return 1; fi
    grep -m1 -E '^flags' /proc/cpuinfo | grep -qw "$1"
}
onoff() { if cpu_has "$1"; then echo ON; else echo OFF; fi; }
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_CURL=OFF
    -DGGML_CCACHE=OFF
    -DGGML_NATIVE=OFF
    -DGGML_AMX_TILE=OFF
    -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF
    -DGGML_SSE42="$(onoff sse4_2)"
    -DGGML_AVX="$(onoff avx)"
    -DGGML_AVX2="$(onoff avx2)"
    -DGGML_FMA="$(onoff fma)"
    -DGGML_F16C="$(onoff f16c)"
    -DGGML_BMI2="$(onoff bmi2)"
    -DGGML_AVX_VNNI="$(onoff avx_vnni)"
    -DGGML_AVX512="$(onoff avx512f)"
    -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
    -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
    -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
)
STAMP_TEXT="llama-cpp-python $VERSION | ${CMAKE_FLAGS[*]}"
STAMP="$BUILD/.tokenmill-peers-stamp"

if [[ -x "$BIN" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    ln -sfn "$BIN" "$LINK"
    say "llama-server already built: $LINK ($("$BIN" --version 2>&1 | grep -m1 -i version || true))"
    exit 0
fi

# --- tools -----------------------------------------------------------------------------------
command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 \
    || die "no C/C++ compiler: install one first (Debian: apt-get install -y build-essential)"

TOOLS_VENV="$PEERS_DIR/build-tools-venv"
cmake_ok() {
    command -v cmake >/dev/null 2>&1 || return 1
    local v
    v="$(cmake --version | head -1 | awk '{print $3}')"
    # llama.cpp asks for 3.14 or newer
    [[ "$(printf '%s\n3.14\n' "$v" | sort -V | head -1)" == "3.14" ]]
}
if ! cmake_ok || ! command -v ninja >/dev/null 2>&1; then
    if [[ ! -x "$TOOLS_VENV/bin/cmake" || ! -x "$TOOLS_VENV/bin/ninja" ]]; then
        say "installing cmake and ninja from PyPI into $TOOLS_VENV"
        "$PYTHON" -m venv "$TOOLS_VENV"
        nice -n 19 "$TOOLS_VENV/bin/python" -m pip install --disable-pip-version-check -q cmake ninja
    fi
    export PATH="$TOOLS_VENV/bin:$PATH"
fi
say "using $(cmake --version | head -1), ninja $(ninja --version)"

# --- source ----------------------------------------------------------------------------------
mkdir -p "$LLAMACPP_DIR"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    SDIST="$LLAMACPP_DIR/llama_cpp_python-$VERSION.tar.gz"
    if [[ ! -f "$SDIST" ]]; then
        say "downloading the llama-cpp-python $VERSION sdist (about 75 MB)"
        nice -n 19 "$PYTHON" -m pip download --disable-pip-version-check -q \
            --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$LLAMACPP_DIR"
    fi
    say "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$LLAMACPP_DIR"
    [[ -f "$SRC/CMakeLists.txt" ]] || die "no vendor/llama.cpp in the sdist $SDIST"
fi
COMMIT="$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)"
say "llama.cpp source: $SRC (commit $COMMIT)"

# --- build -----------------------------------------------------------------------------------
say "configuring (AMX off, GGML_NATIVE off, x86 extensions from /proc/cpuinfo)"
nice -n 19 cmake -S "$SRC" -B "$BUILD" -G Ninja "${CMAKE_FLAGS[@]}" >"$LLAMACPP_DIR/configure.log" 2>&1 \
    || { tail -30 "$LLAMACPP_DIR/configure.log" >&2; die "cmake configure failed (log: $LLAMACPP_DIR/configure.log)"; }
say "compiling llama-server with nice -n 19, -j $JOBS (about 10-15 minutes on 2 cores)"
start=$(date +%s)
nice -n 19 cmake --build "$BUILD" --target llama-server -j "$JOBS" >"$LLAMACPP_DIR/build.log" 2>&1 \
    || { tail -30 "$LLAMACPP_DIR/build.log" >&2; die "build failed (log: $LLAMACPP_DIR/build.log)"; }
say "compiled in $(( $(date +%s) - start )) s"

[[ -x "$BIN" ]] || die "the build finished but $BIN is missing"
if grep -q "GGML_AMX_INT8\|-mamx" "$BUILD/compile_commands.json" 2>/dev/null; then
    die "AMX flags found in the compile commands: the AMX switch did not take"
fi
printf '%s' "$STAMP_TEXT" >"$STAMP"
printf '%s\n' "$COMMIT" >"$BUILD/.llama-cpp-commit"
ln -sfn "$BIN" "$LINK"
say "done: $LINK"
"$BIN" --version 2>&1 | head -3 || true
