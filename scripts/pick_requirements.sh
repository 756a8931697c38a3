#!/usr/bin/env bash
# Print the requirements file scripts/setup.sh installs, a TAB, and why:
#   $CACHEGEN_REQUIREMENTS when set; else requirements-gpu.txt when `nvidia-smi -L` lists a
#   GPU (an NVIDIA driver is present and sees a device); else requirements.txt (CPU stack).
# Exit 2 (one line on stderr) when the chosen file does not exist.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -n "${CACHEGEN_REQUIREMENTS:-}" ]; then
    REQ="$CACHEGEN_REQUIREMENTS"; WHY="CACHEGEN_REQUIREMENTS"
elif command -v nvidia-smi >/dev/null 2>&1 && grep -q '^GPU ' <<<"$(nvidia-smi -L 2>/dev/null || true)"; then
    REQ="$ROOT/requirements-gpu.txt"; WHY="nvidia-smi lists a GPU"
else
    REQ="$ROOT/requirements.txt"; WHY="no NVIDIA GPU found"
fi
[ -f "$REQ" ] || { echo "error: requirements file $REQ not found" >&2; exit 2; }
printf '%s\t%s\n' "$REQ" "$WHY"
