"""Every way a run ends leaves nothing behind (harness.lifecycle, issue: terminated runs).

A fake run in a subprocess (the run's registry, a cachegen-run-* temp folder, a child
process standing in for vLLM's engine core) is ended by SIGTERM, SIGHUP, SIGINT and
SIGKILL; the first three must clean up themselves, a SIGKILLed run's leftovers must be
removed by the next run's stale cleanup.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.signals import default_sigint

from harness import lifecycle

ROOT = Path(__file__).resolve().parents[2]

CHILD = (
    "import mmap, os, time\n"
    "name = f'psm_cgtest{os.getpid()}'\n"
    "fd = os.open('/dev/shm/' + name, os.O_CREAT | os.O_RDWR, 0o600)\n"
    "os.ftruncate(fd, 4096)\n"
    "m = mmap.mmap(fd, 4096)\n"
    "print(name, flush=True)\n"
    "time.sleep(600)\n")

FAKE_RUN = r"""
import subprocess, sys, tempfile, time
CHILD = sys.argv[2]
from harness import lifecycle
lifecycle.install_signal_handlers()
try:
    with lifecycle.RunRegistry() as reg:
        with tempfile.TemporaryDirectory(prefix="cachegen-run-", dir=sys.argv[1]) as tmp:
            reg.add_dir(tmp)
            child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
            shm = child.stdout.readline().strip()  # the child maps it, as vLLM's engine core does
            reg.snapshot()
            print(tmp, child.pid, shm, flush=True)
            while True:
                time.sleep(0.2)
except KeyboardInterrupt:
    raise SystemExit(130)
"""


def _alive(pid: int) -> bool:
    return lifecycle.proc_start_time(pid) is not None


def _start(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CACHEGEN_CACHE=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-c", FAKE_RUN, str(tmp_path), CHILD], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_sigint)
    line = p.stdout.readline().split()
    assert len(line) == 3, p.stderr.read()
    shm = Path("/dev/shm") / line[2]
    assert shm.exists()
    return p, Path(line[0]), int(line[1]), shm


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_signal_unwinds_and_cleans_up(tmp_path, sig, code):
    p, tmp, child, shm = _start(tmp_path)
    assert tmp.is_dir() and _alive(child)
    rec = json.loads(next((tmp_path / "cache" / "runs").glob("*.json")).read_text())
    assert rec["shm"] == [shm.name] and [r["pid"] for r in rec["processes"]] == [child]
    assert len(list((tmp_path / "cache" / "runs").glob("*.json"))) == 1
    p.send_signal(sig)
    p.wait(timeout=30)
    assert p.returncode == code, p.stderr.read()
    assert not tmp.exists() and not shm.exists()
    assert not _alive(child)
    assert list((tmp_path / "cache" / "runs").glob("*.json")) == []


def test_sigkilled_run_is_cleaned_by_the_next(tmp_path):
    p, tmp, child, shm = _start(tmp_path)
    p.kill()
    p.wait(timeout=30)
    assert tmp.is_dir() and _alive(child) and shm.exists()  # nothing of the killed run cleaned up
    said = []
    removed = lifecycle.cleanup_stale_runs(cache=tmp_path / "cache", log=said.append)
    assert not tmp.exists() and not _alive(child) and not shm.exists()
    assert any(f"process {child}" in r for r in removed) and any("folder" in r for r in removed)
    assert f"shared memory {shm.name}" in removed
    assert len(said) == 1 and f"pid {p.pid}" in said[0]
    assert list((tmp_path / "cache" / "runs").glob("*.json")) == []


def test_stale_cleanup_spares_live_runs_and_reused_pids(tmp_path):
    runs = lifecycle.runs_dir(tmp_path)
    me = {"pid": os.getpid(), "start_time": lifecycle.proc_start_time(os.getpid()),
          "dirs": [str(tmp_path / "mine")], "processes": [], "shm": []}
    (tmp_path / "mine").mkdir()
    (runs / f"{os.getpid()}.json").write_text(json.dumps(me))
    # a dead run whose recorded child pid was reused by a live process: never killed
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead = {"pid": 999999999, "start_time": 1, "dirs": [str(tmp_path / "gone")],
                "processes": [{"pid": sleeper.pid, "start_time": 1, "cmd": "old"}], "shm": []}
        (tmp_path / "gone").mkdir()
        (runs / "999999999.json").write_text(json.dumps(dead))
        (runs / "garbage.json").write_text("{not json")
        removed = lifecycle.cleanup_stale_runs(cache=tmp_path)
        assert removed == [f"folder {tmp_path / 'gone'}"]
        assert _alive(sleeper.pid) and (tmp_path / "mine").is_dir()
        assert sorted(p.name for p in runs.iterdir()) == [f"{os.getpid()}.json"]
    finally:
        sleeper.kill()
        sleeper.wait()
