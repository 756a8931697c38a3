#!/usr/bin/env bash
# Fresh-machine smoke: the README's main job as a new user's first run.
#   bash scripts/fresh_smoke.sh               clone + set-up + run_benchmarks.py --quick
#   bash scripts/fresh_smoke.sh --fresh-venv  ... with a new .venv in the clone (what a user
#                                             makes; installs the pinned stack: minutes more)
# The commit (HEAD; uncommitted changes are not part of it) is cloned into an empty
# temporary folder (nothing beside the clone: no ../shared), CACHEGEN_CACHE is a new empty
# folder (the default model is fetched by set-up as a user's would be, the default kvtc
# calibration is fitted from scratch), the hub is off (HF_HUB_OFFLINE=1,
# HF_DATASETS_OFFLINE=1: a fresh machine cannot reach it), then `run_benchmarks.py --quick`
# runs with its default modes (kvtc among them). Passes when it exits 0 and its results
# file says "complete": true, has kvtc runs and records no failure. By default the clone's
# .venv is a symlink to this checkout's .venv (set-up still checks its stamp and imports):
# a fresh venv costs several minutes of installs, beyond the CI's budget for this smoke.
# Everything is removed afterwards. Exit status: 0 pass, 1 fail (the reason on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
FRESH_VENV=0
[ "${1:-}" = "--fresh-venv" ] && FRESH_VENV=1
say() { echo "[fresh-smoke] $*"; }
T0=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/cgh-fresh-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir "$WORK/clone"                      # the clone's parent holds nothing else
COMMIT="$(git rev-parse HEAD)"
git clone -q "$ROOT" "$WORK/clone/repo"
git -C "$WORK/clone/repo" checkout -q --detach "$COMMIT"
REPO="$WORK/clone/repo"
if [ "$FRESH_VENV" = 0 ]; then
    [ -x "$ROOT/.venv/bin/python" ] || { echo "[fresh-smoke] error: no $ROOT/.venv (run bash scripts/setup.sh)" >&2; exit 1; }
    ln -s "$ROOT/.venv" "$REPO/.venv"
fi
export CACHEGEN_CACHE="$WORK/cache" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir "$CACHEGEN_CACHE"
say "commit ${COMMIT:0:12} cloned into $REPO (venv: $([ "$FRESH_VENV" = 1 ] && echo fresh || echo "symlink to $ROOT/.venv")), empty CACHEGEN_CACHE"
(cd "$REPO" && bash scripts/setup.sh) > "$WORK/setup.log" 2>&1 || {
    tail -20 "$WORK/setup.log" >&2; echo "[fresh-smoke] FAIL: set-up in the clone failed" >&2; exit 1; }
T1=$(date +%s)
say "set-up in the clone: $((T1 - T0)) s"
OUT="$WORK/results.json"
rc=0
(cd "$REPO" && .venv/bin/python run_benchmarks.py --quick --out "$OUT") > "$WORK/run.log" 2>&1 || rc=$?
T2=$(date +%s)
if [ "$rc" != 0 ]; then
    grep -v 'it/s\]\|s/it\]' "$WORK/run.log" | tail -20 >&2
    echo "[fresh-smoke] FAIL: run_benchmarks.py --quick exited $rc" >&2
    exit 1
fi
"$ROOT/.venv/bin/python" - "$OUT" <<'PYEOF' || exit 1
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"[fresh-smoke] FAIL: no readable results file: {e}")
problems = []
if doc.get("complete") is not True:
    problems.append('results file lacks "complete": true')
kvtc = [r for r in doc.get("runs", []) if r.get("mode") == "kvtc"]
if not kvtc:
    problems.append("no kvtc runs")
if doc.get("failures"):
    problems.append("failures recorded: " + "; ".join(
        f"{f.get('label')}: {f.get('stage')}: {f.get('reason')}" for f in doc["failures"])[:500])
cal = doc.get("kvtc_calibration") or {}
if not cal.get("hash") or not (cal.get("text") or {}).get("sha256"):
    problems.append("no kvtc calibration (hash and text sha256) recorded")
if problems:
    sys.exit("[fresh-smoke] FAIL: " + "; ".join(problems))
print(f"[fresh-smoke] results ok: complete, {len(doc['runs'])} runs ({len(kvtc)} kvtc), "
      f"calibration {cal['hash'][:16]} on {cal['text'].get('source')}")
PYEOF
say "PASS: run_benchmarks.py --quick $((T2 - T1)) s, total $((T2 - T0)) s"
