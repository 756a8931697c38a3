"""The numerics record of the result files (cachegen_common/machine.py): CPU vendor and
model, the AMX / AVX512 / AVX2 flags, torch's CPU capability and the ISA oneDNN uses; and
that ``ONEDNN_MAX_CPU_ISA`` (the second kernel family CI runs under) reaches oneDNN.

Run: .venv/bin/python -m pytest tests/harness/test_machine.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cachegen_common import machine

ROOT = Path(__file__).resolve().parents[2]

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16

processor\t: 1
vendor_id\t: OtherVendor
model name\t: ignored
flags\t\t: fpu
"""
AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu avx2 avx512f avx512_bf16
"""
VERBOSE = """onednn_verbose,v1,info,oneDNN v3.7.1 (commit x)
onednn_verbose,v1,info,cpu,isa:Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer support
onednn_verbose,v1,primitive,info,template:operation,engine,primitive,implementation,prop_kind
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ab::f0 dst:bf16::blocked:ab::f0,,,16x64:64x32,6.1
"""


def test_cpu_info_parses_the_first_processor():
    got = machine.cpu_info(INTEL)
    assert got["cpu_vendor"] == "GenuineIntel" and got["cpu_model"] == "Intel(R) Xeon(R) Processor"
    assert got["cpu_flags"] == {f: True for f in machine.FLAGS}
    amd = machine.cpu_info(AMD)
    assert amd["cpu_vendor"] == "AuthenticAMD"
    assert amd["cpu_flags"] == {"amx_bf16": False, "amx_tile": False, "avx512_bf16": True,
                                "avx512_fp16": False, "avx512f": True, "avx2": True}
    none = machine.cpu_info("")
    assert none["cpu_vendor"] is None and set(none["cpu_flags"].values()) == {None}


def test_parse_onednn_verbose():
    got = machine.parse_onednn_verbose(VERBOSE)
    assert got == {"onednn_isa": "Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer support",
                   "onednn_matmul_impl": "brg_matmul:avx10_1_512_amx"}
    assert machine.parse_onednn_verbose("nothing here") == {"onednn_isa": None, "onednn_matmul_impl": None}


def test_numerics_record_of_this_machine():
    rec = machine.numerics()
    assert set(rec) == {"cpu_vendor", "cpu_model", "cpu_flags", "torch_cpu_capability", "onednn_isa",
                        "onednn_matmul_impl", "onednn_bf16", "onednn_max_cpu_isa"}
    assert set(rec["cpu_flags"]) == set(machine.FLAGS)
    assert rec["onednn_max_cpu_isa"] == (os.environ.get("ONEDNN_MAX_CPU_ISA") or
                                         os.environ.get("DNNL_MAX_CPU_ISA") or None)
    if Path("/proc/cpuinfo").exists():
        flags = set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                         if ln.startswith("flags")).split(":", 1)[1].split())
        assert rec["cpu_flags"] == {f: f in flags for f in machine.FLAGS}
    assert isinstance(rec["torch_cpu_capability"], str) and rec["torch_cpu_capability"]
    json.dumps(rec)
    # the result files carry it
    from harness.results import environment
    assert environment()["numerics"] == rec


def test_onednn_max_cpu_isa_reaches_onednn():
    # the CI pass under ONEDNN_MAX_CPU_ISA=AVX2 must really change the kernel family: the
    # record of a child process under it names the variable, and oneDNN then has no
    # bf16 matmul (no AVX512-BF16 / AMX kernel: the bf16 products are torch's own)
    code = "import json; from cachegen_common.machine import numerics; print(json.dumps(numerics()))"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120, check=True).stdout
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["onednn_max_cpu_isa"] == "AVX2"
    assert rec["onednn_bf16"] is False
    assert rec["onednn_matmul_impl"] is None or "amx" not in rec["onednn_matmul_impl"]
