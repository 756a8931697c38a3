"""What of the machine changes numerics: one record for results.json, quality.json and
codec_bench.json.

Purpose: a figure computed with bf16 matmuls depends on the CPU's kernel family (oneDNN
picks AMX, AVX512-BF16 or AVX2 kernels, whose reduction orders differ; we measured
batch-1 vs batch-7 logits, a bf16 prefill and the calibration probe moving with it), so
every result file records which one ran. ``numerics()`` returns:

- ``cpu_vendor``, ``cpu_model``: /proc/cpuinfo ``vendor_id`` / ``model name``
  (``platform.processor()`` elsewhere);
- ``cpu_flags``: {flag: bool} for ``FLAGS`` (amx_bf16, amx_tile, avx512_bf16,
  avx512_fp16, avx512f, avx2) from /proc/cpuinfo (None each where it cannot be read);
- ``torch_cpu_capability``: ``torch.backends.cpu.get_cpu_capability()`` (the vector ISA
  of torch's own kernels, e.g. "AVX512");
- ``onednn_isa``: the ISA line oneDNN prints when it creates its first primitive
  (``ONEDNN_VERBOSE=1``, a child process running one bf16 and one float32 matmul; e.g.
  "Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer support"), and
  ``onednn_matmul_impl``: the implementation of that bf16 matmul (e.g.
  "brg_matmul:avx10_1_512_amx"); None both when oneDNN ran no primitive (then torch's own
  kernels did the bf16 product: e.g. ``ONEDNN_MAX_CPU_ISA=AVX2`` on this torch);
- ``onednn_bf16``: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` (whether torch sends
  bf16 matmuls to oneDNN; it honours ``ONEDNN_MAX_CPU_ISA``);
- ``onednn_max_cpu_isa``: the environment variable ``ONEDNN_MAX_CPU_ISA`` (or the older
  ``DNNL_MAX_CPU_ISA``) when set, else None.

torch is imported only inside the function (for its own fields; None without torch); the
child process runs once per process (cached; ~2-4 s, 60 s timeout, None on any failure).

Run the test: .venv/bin/python -m pytest tests/harness/test_machine.py -q
"""
from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["FLAGS", "numerics", "cpu_info", "parse_onednn_verbose"]

FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")

_PROBE = (
    "import torch\n"
    "a = torch.ones(16, 64, dtype=torch.bfloat16); b = torch.ones(64, 32, dtype=torch.bfloat16)\n"
    "torch.mm(a, b)\n"
    "torch.mm(a.float(), b.float())\n"
)
_ISA_RE = re.compile(r"^(?:onednn|dnnl)_verbose,(?:v\d+,)?info,cpu,isa:(.*)$")


def cpu_info(text: Optional[str] = None) -> dict[str, Any]:
    """``{"cpu_vendor", "cpu_model", "cpu_flags"}`` from /proc/cpuinfo (or ``text``, its
    content, for tests): the first processor's vendor_id, model name and the ``FLAGS``
    present in its flags line. Without /proc/cpuinfo: platform.processor() as the model,
    None for the vendor and each flag."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break              # the first processor's block only
            continue
        key, _, val = line.partition(":")
        fields.setdefault(key.strip(), val.strip())
    flags = set(fields.get("flags", "").split())
    have = bool(flags)
    return {"cpu_vendor": fields.get("vendor_id") or None,
            "cpu_model": fields.get("model name") or platform.processor() or None,
            "cpu_flags": {f: (f in flags) if have else None for f in FLAGS}}


def parse_onednn_verbose(out: str) -> dict[str, Optional[str]]:
    """``{"onednn_isa", "onednn_matmul_impl"}`` from oneDNN's verbose output: the text of
    the ``info,cpu,isa:`` line and the implementation field of the first bf16 matmul
    ``exec`` line (None each when absent)."""
    isa = impl = None
    for line in out.splitlines():
        line = line.strip()
        m = _ISA_RE.match(line)
        if m and isa is None:
            isa = m.group(1).strip()
        parts = line.split(",")
        if impl is None and "exec" in parts and "matmul" in parts and "src:bf16" in line:
            i = parts.index("matmul")
            if i + 1 < len(parts):
                impl = parts[i + 1]
    return {"onednn_isa": isa, "onednn_matmul_impl": impl}


@functools.lru_cache(maxsize=1)
def _onednn_probe() -> tuple:
    env = dict(os.environ, ONEDNN_VERBOSE="1", OMP_NUM_THREADS="1")
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                           timeout=60, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return (None, None)
    if r.returncode != 0:
        return (None, None)
    got = parse_onednn_verbose(r.stdout + "\n" + r.stderr)
    return (got["onednn_isa"], got["onednn_matmul_impl"])


def numerics() -> dict[str, Any]:
    """The record described in the module docstring (a JSON-ready dict; never raises)."""
    rec = cpu_info()
    cap = bf16 = None
    try:
        import torch

        try:
            cap = str(torch.backends.cpu.get_cpu_capability())
        except Exception:  # noqa: BLE001 - an older torch
            cap = None
        try:
            bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except Exception:  # noqa: BLE001 - a torch without oneDNN
            bf16 = None
        isa, impl = _onednn_probe()
    except ImportError:
        isa = impl = None
    rec.update({"torch_cpu_capability": cap, "onednn_isa": isa, "onednn_matmul_impl": impl,
                "onednn_bf16": bf16,
                "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")
                or os.environ.get("DNNL_MAX_CPU_ISA") or None})
    return rec
