#!/usr/bin/env bash
# Optional: a bf16 GGUF of the model for llama.cpp, so that it can be compared in the same precision
# as tokenmill's default (bf16) as well as in the Q4_1 it reads natively.
#
#   bash benchmarks/peers/make_bf16_gguf.sh        # then: compare.py --engines ...,llamacpp-bf16
#   OUTTYPE=q8_0 bash benchmarks/peers/make_bf16_gguf.sh   # a Q8_0 file instead, for --llamacpp-gguf
#                                                          # (against tokenmill's --quantization int8)
#
# It runs llama.cpp's own converter (convert_hf_to_gguf.py, in the sdist setup_llamacpp.sh unpacked)
# on the HF directory export_hf.py wrote (itself dequantized from the embedded Q4_1 GGUF, so the
# weights are the same values, rounded to bf16). The converter needs torch, numpy, transformers and
# sentencepiece: the vLLM virtualenv has them all (tokenmill's lacks sentencepiece), so it is used.
#
# Environment: PEERS_DIR, LLAMA_CPP_PYTHON_VERSION, VLLM_VENV, HF_DIR, OUTTYPE (the converter's
# --outtype: bf16, q8_0, f16, ...; default bf16), OUT (the .gguf written).
# Needs: setup_llamacpp.sh, setup_vllm.sh and export_hf.py run first. Idempotent. Takes ~10 s.
set -euo pipefail

PEERS_DIR="${PEERS_DIR:-$HOME/.cache/tokenmill-peers}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="${PEERS_DIR}/llama.cpp/llama_cpp_python-$VERSION/vendor/llama.cpp"
VLLM_VENV="${VLLM_VENV:-$PEERS_DIR/vllm-venv}"
HF_DIR="${HF_DIR:-$PEERS_DIR/smollm2-135m-hf}"
OUTTYPE="${OUTTYPE:-bf16}"
OUT="${OUT:-$PEERS_DIR/smollm2-135m-$OUTTYPE.gguf}"

die() { printf '[make_bf16_gguf] error: %s\n' "$*" >&2; exit 1; }
[[ -f "$SRC/convert_hf_to_gguf.py" ]] || die "no llama.cpp source at $SRC: run bash benchmarks/peers/setup_llamacpp.sh"
[[ -x "$VLLM_VENV/bin/python" ]] || die "no Python with the converter's needs at $VLLM_VENV: run bash benchmarks/peers/setup_vllm.sh"
[[ -f "$HF_DIR/config.json" ]] || die "no HF export at $HF_DIR: run .venv/bin/python benchmarks/peers/export_hf.py"

if [[ -f "$OUT" && "$OUT" -nt "$HF_DIR/model.safetensors" ]]; then
    echo "[make_bf16_gguf] $OUT is up to date; nothing to do"
    exit 0
fi
echo "[make_bf16_gguf] converting $HF_DIR -> $OUT ($OUTTYPE)"
nice -n 19 "$VLLM_VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$HF_DIR" --outtype "$OUTTYPE" --outfile "$OUT.tmp" \
    >"$OUT.log" 2>&1 || { tail -20 "$OUT.log" >&2; die "conversion failed (log: $OUT.log)"; }
mv "$OUT.tmp" "$OUT"
echo "[make_bf16_gguf] done: $OUT"
