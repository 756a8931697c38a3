#!/usr/bin/env bash
# One prepared GPU check of the Triton codec: kernel tests on CUDA, correctness
# against the CPU backend (same bytes, decoding both ways), then encode/decode speed on a
# 7B-shaped KV, with the results table printed LAST. Budget: under 5 minutes on one GPU.
#
# Needs only the image's python with torch + triton; numpy/numba/pytest are installed with
# pip if missing and the network allows it (offline: the steps that need them degrade:
# no pytest -> the test step is skipped; no numba -> the pure-Python reference is used for
# the byte comparison and the CPU speed rows are skipped). Creates nothing but pip packages
# and Triton/numba caches.
#
# Usage: bash scripts/gpu_check.sh [--quick] [--out out.json]
#   env PYTHON=/path/to/python to choose the interpreter (default: python3, else python).
set -u
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 TRITON_DEFAULT_FP_FUSION=0
unset TRITON_INTERPRET
start=$(date +%s)

if ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: needs torch + triton and a CUDA device" >&2
    exit 2
fi
for mod in numpy numba pytest; do
    if ! "$PY" -c "import $mod" 2>/dev/null; then
        echo "== installing $mod (offline-tolerant)"
        if ! out=$(timeout 90 "$PY" -m pip install -q --retries 0 --timeout 10 "$mod" 2>&1); then
            echo "$out" | tail -2
            echo "   could not install $mod; continuing without it"
        fi
    fi
done

rc=0
if "$PY" -c "import pytest" 2>/dev/null; then
    echo "== kernel tests on CUDA (tests/codec/test_codec_triton.py)"
    timeout 150 "$PY" -m pytest tests/codec/test_codec_triton.py -q -x -p no:cacheprovider || rc=1
else
    echo "== pytest unavailable: kernel tests skipped (the correctness step still runs)"
fi
echo "== correctness + speed (python -m scripts.gpu_check $*)"
echo "   ($(( $(date +%s) - start )) s so far)"
timeout 240 "$PY" -m scripts.gpu_check "$@" || rc=$((rc | $?))
exit $rc
