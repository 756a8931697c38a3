"""The codec is safe to call from several threads.

4-8 threads in one process calling ``codec.encode_kv`` / ``codec.decode_kv`` of several
codecs at once on KV big enough for the parallel numba kernels used to abort the process
(numba workqueue layer: "Concurrent access has been detected", exit 134). The checks run
in a child process so that an abort fails the test instead of killing pytest; results
must be bit-identical to serial calls, and a failing call (corrupt bytes) raises
CodecError in its own thread without disturbing the others."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(r"""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import codec
    from codec import threads

    THREADS = int(sys.argv[1])
    # [4, 512, 2, 64]: 2*L*T*C = 524288 symbols >= threads.PARALLEL_MIN_SYMBOLS, so the
    # parallel numba kernels are the ones used by a lone caller
    L, T, H, D = 4, 512, 2, 64
    assert 2 * L * T * H * D >= threads.PARALLEL_MIN_SYMBOLS
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(L, T, H, D, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(L, T, H, D, generator=g).to(torch.bfloat16)

    names = []
    for n in sorted(codec.CODECS):
        try:
            codec.encode_kv(k[:, :32], v[:, :32], codec=n)
            names.append(n)
        except ValueError as e:           # codecs that need a calibration artifact
            assert "calibration" in str(e), (n, e)
    jobs = [(n, lv) for n in names for lv in ((None, 0) if codec.levels(n) else (None,))]
    serial = {}
    for n, lv in jobs:
        data = codec.encode_kv(k, v, codec=n, level=lv)
        serial[(n, lv)] = (data, codec.decode_kv(data))
    bad = bytearray(serial[("cachegen", None)][0])
    bad[len(bad) // 2] ^= 0xFF

    def enc(job):
        return "enc", job, codec.encode_kv(k, v, codec=job[0], level=job[1])

    def dec(job):
        return "dec", job, codec.decode_kv(serial[job][0])

    def dec_chunks(job):
        chunks = codec.encode_chunks(k, v, codec=job[0], level=job[1], chunk_tokens=256)
        return "chunks", job, codec.decode_chunks(chunks)

    def corrupt(_):
        try:
            codec.decode_kv(bytes(bad))
        except codec.CodecError:
            return "corrupt", None, None
        raise AssertionError("corrupt bytes decoded")

    tasks = []
    for rnd in range(3):
        for job in jobs:
            tasks += [(enc, job), (dec, job), (dec, job)]
        tasks += [(dec_chunks, ("cachegen", None)), (corrupt, None)]
    with ThreadPoolExecutor(THREADS) as ex:
        futs = [ex.submit(f, a) for f, a in tasks]
        results = [f.result() for f in futs]
    n = 0
    for kind, job, out in results:
        if kind == "enc":
            assert out == serial[job][0], ("encode differs", job)
        elif kind in ("dec", "chunks"):
            want = serial[job][1]
            if kind == "chunks":
                want = codec.decode_chunks(codec.encode_chunks(
                    k, v, codec=job[0], level=job[1], chunk_tokens=256))
            assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), (kind, job)
        n += 1
    print("OK", THREADS, n, sorted(names))
""")


def _run_child(threads: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", CHILD, str(threads)], cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("threads", [4, 8])
def test_concurrent_encode_decode_is_bit_exact_and_never_aborts(threads):
    r = _run_child(threads)
    assert r.returncode == 0, (f"child exited {r.returncode} (134 = abort, e.g. numba "
                               f"'Concurrent access has been detected'):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    assert r.stdout.startswith(f"OK {threads} "), r.stdout


def test_run_kernel_falls_back_to_serial_when_busy():
    """The dispatch itself: a busy lock means the serial build, never a wait or a second
    parallel kernel; an exception releases the lock."""
    from codec import threads as T

    calls = []
    par = lambda x: calls.append(("par", x)) or "par"     # noqa: E731
    ser = lambda x: calls.append(("ser", x)) or "ser"     # noqa: E731
    assert T.run_kernel(par, ser, True, 1) == "par"
    assert T.run_kernel(par, ser, False, 2) == "ser"
    with T.PARALLEL_LOCK:
        assert T.run_kernel(par, ser, True, 3) == "ser"

    def boom(x):
        raise ValueError("kernel failed")

    with pytest.raises(ValueError, match="kernel failed"):
        T.run_kernel(boom, ser, True, 4)
    assert not T.PARALLEL_LOCK.locked()
    assert calls == [("par", 1), ("ser", 2), ("ser", 3)]


LAYER_CHILD = textwrap.dedent(r"""
    import sys

    import torch

    first = sys.argv[1]
    if first == "num_workers":
        from codec.threads import num_workers
        num_workers()
    elif first == "encode":      # the first codec call of a process: an encode (save path)
        import codec
        k = torch.randn(4, 256, 2, 64).to(torch.bfloat16)
        codec.encode_kv(k, k.clone(), codec="cachegen", level=1)
    elif first == "decode":
        import codec
        k = torch.randn(4, 256, 2, 64).to(torch.bfloat16)
        data = codec.encode_kv(k, k.clone(), codec="cachegen", level=1)
        codec.decode_kv(data)
    elif first == "decode_cpus_probe":   # the vLLM connector's record of the decode's threads
        import numba  # noqa: F401  (imported, no kernel run yet)
        from third_party.vllm import decode_cpus
        decode_cpus.thread_probe()
    import numba
    print("LAYER", numba.threading_layer(), "TORCH", torch.get_num_threads())
""")


@pytest.mark.parametrize("first", ["num_workers", "encode", "decode", "decode_cpus_probe"])
def test_numba_never_takes_the_openmp_layer(first):
    """Whatever the process asks numba first (its thread count, an encode, a decode, the
    connector's thread probe), numba's pool runs on the "workqueue" layer: OpenMP would
    share torch's OpenMP runtime and resize its team (in vLLM's CPU worker, one OpenMP
    thread bound to one core, a second thread then spun at the barrier and every forward
    ran ~10x slower)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", LAYER_CHILD, first], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LAYER workqueue" in r.stdout, r.stdout + r.stderr[-2000:]
