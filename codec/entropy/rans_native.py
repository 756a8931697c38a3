"""Native (C) rANS decode + dequantization: build once with the machine's compiler, call via ctypes.

Purpose: the hot loop of CacheGen's decode (Liu et al., SIGCOMM 2024, section 5.2,
arithmetic decoding with a model per (layer, channel); section 5.3, decoding that keeps up
with the stream) as a small C kernel, codec/entropy/native/rans_decode.c, a port of the numba
kernel ``codec.entropy.rans_kernels._decode_impl`` with the same inputs, outputs and per-stream
error codes (docs/bitstream.md sections 2-3). With AVX2, work items of up to 4 quads of one
kv run in two 8-lane vectors (16 rANS states; gathers for the LUT, the model rows, the
next words and the dequantization table); else the scalar loop over 8 lanes. Workers are
pthreads taking items from one atomic counter; ctypes releases the GIL for the call.

Build: ``gcc -O3 -march=native -shared -fPIC -pthread`` (``$CC`` if set) into
``$CACHEGEN_CACHE/native/<hash>/rans_decode.so`` (default cache ``~/.cache/cachegen-harness``),
hash = sha256 of the source, the compiler's version, the flags and the CPU (model name and
flags of /proc/cpuinfo), so a changed source or a different machine builds anew; the
library is compiled to a temporary name in that folder and renamed into place (atomic: a
concurrent process sees no half-written file). ``scripts/setup.sh`` builds it; otherwise the
first decode does.

Default where it builds with AVX2 (``CACHEGEN_NATIVE`` read at each decode): unset, the
native kernel decodes when the library builds and has its AVX2 lanes (measured faster than
numba, docs/notes/2026-12-07-simd-rans-decode.md); ``CACHEGEN_NATIVE=0`` forces the numba
kernel; ``CACHEGEN_NATIVE=1`` takes the native kernel even without AVX2 (its scalar loop).
``CACHEGEN_NATIVE_SIMD=0`` runs the native scalar loop (side-by-side checks).
2-byte outputs (bf16/fp16) of the vector lanes go through a per-worker tile (one vector
store per step, then 16 x 16 transposes into whole output rows: the lanes decode down the
columns of the token-major output); ``CACHEGEN_NATIVE_TILE=0`` stores straight into the
output instead (the same values; side-by-side checks). No compiler,
or a failed build or load: the numba kernel, with one warning line per process saying why.

Run it: .venv/bin/python -m codec.entropy.rans_native   (builds, prints the library's path)
Run the tests: .venv/bin/python -m pytest tests/codec/test_rans_native.py -q
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

__all__ = ["SOURCE", "ABI", "library_path", "load", "wanted", "enabled", "disabled", "native_items",
           "decode_into", "simd", "simd_wanted", "use_native", "main"]

SOURCE = Path(__file__).resolve().parent / "native" / "rans_decode.c"
ABI = 3                       # cg_rans_abi() of the source this wrapper speaks to
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-std=c99")
_LOCK = threading.Lock()
_STATE: dict = {}             # "lib": CDLL | None, "why": str (set once per process)


def _cache_root() -> Path:
    return Path(os.environ.get("CACHEGEN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "cachegen-harness"))


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "gcc"
    return shutil.which(cc) or shutil.which("cc")


def _cpu_id() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def library_path(cc: str | None = None) -> Path:
    """Where the library for this source, compiler and CPU lives (it may not exist yet).
    Raises RuntimeError when no C compiler is found."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cc} --version failed: {e}") from None
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), ver.encode(), " ".join(FLAGS).encode(), _cpu_id().encode()):
        h.update(part)
        h.update(b"\0")
    return _cache_root() / "native" / h.hexdigest()[:20] / "rans_decode.so"


def _build(cc: str, dest: Path) -> None:
    """Compile SOURCE into dest via a temporary file in dest's folder and an atomic rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rans_decode.", suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{cc} failed: {msg[-1] if msg else 'rc ' + str(r.returncode)}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.cg_rans_abi() != ABI:
        raise RuntimeError(f"{path} speaks interface {lib.cg_rans_abi()}, expected {ABI}")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.cg_rans_decode.argtypes = [p] * 7 + [i64] * 6 + [p] * 4 + [i64] * 8 + [i32, p, i32, i32, i64]
    lib.cg_rans_simd.restype = i32
    lib.cg_rans_quads.restype = i32
    lib.cg_rans_decode.restype = i32
    return lib


def load(build: bool = True) -> ctypes.CDLL | None:
    """The loaded library, building it first if needed (and `build`); None when the build
    or load failed (one warning line, once per process)."""
    with _LOCK:
        if "lib" in _STATE:
            return _STATE["lib"]
        lib, why = None, None
        if True:
            try:
                cc = _compiler()
                path = library_path(cc)
                if not path.exists():
                    if not build:
                        return None
                    _build(cc, path)
                lib = _open(path)
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                why = f"native build/load failed ({e})"
        _STATE["lib"], _STATE["why"] = lib, why
        if lib is None:
            warnings.warn(f"codec: native rANS decoder off: {why}; using the numba kernel",
                          RuntimeWarning, stacklevel=2)
        return lib


def wanted() -> bool:
    """False when ``CACHEGEN_NATIVE`` is 0/off/no/false (read at each decode): the numba
    kernel decodes. Unset (or anything else) the native decoder is wanted; `use_native`
    then takes it when it builds, with its AVX2 lanes unless ``CACHEGEN_NATIVE=1`` asks
    for it even without them (the scalar C loop is slower than numba:
    docs/notes/2026-12-06-native-rans-decode.md, docs/notes/2026-12-07-simd-rans-decode.md)."""
    return _env_native() not in ("0", "off", "no", "false")


def _env_native() -> str:
    return os.environ.get("CACHEGEN_NATIVE", "").strip().lower()


def use_native() -> ctypes.CDLL | None:
    """The library to decode with now, or None for the numba kernel: None when
    `wanted` is False, inside `disabled`, when the build or load failed (one warning per
    process), or when the library lacks the AVX2 lanes and ``CACHEGEN_NATIVE`` is not
    1/on/yes/true."""
    if _STATE.get("off") or not wanted():
        return None
    lib = load()
    if lib is None:
        return None
    if not lib.cg_rans_simd() and _env_native() not in ("1", "on", "yes", "true"):
        return None
    return lib


def simd_wanted() -> bool:
    """False when ``CACHEGEN_NATIVE_SIMD`` is 0/off/no/false (read at each decode): the
    native kernel then runs its scalar loop (for side-by-side checks); on by default."""
    return os.environ.get("CACHEGEN_NATIVE_SIMD", "1").strip().lower() not in ("0", "off", "no", "false")


def simd(lib: ctypes.CDLL | None = None) -> bool:
    """True when the loaded library has the AVX2 lanes compiled in (the CPU has AVX2)."""
    lib = lib if lib is not None else load()
    return lib is not None and bool(lib.cg_rans_simd())


def _fits_int32(words, n_models: int, deq_k, deq_v) -> bool:
    """The vector lanes index with int32: word indices, table indices and the tables'
    byte offsets must all stay below 2^31."""
    lim = 2 ** 31 - 8
    return words.size < lim and n_models * 257 < lim and max(deq_k.nbytes, deq_v.nbytes) < lim


def enabled() -> bool:
    """True when the native decoder is in use (`use_native`; builds it if wanted)."""
    return use_native() is not None


@contextlib.contextmanager
def disabled():
    """Inside this context (process-wide, not nestable across threads): `decode_into`
    returns False, so the numba kernel decodes; for side-by-side benchmarks and tests."""
    _STATE["off"] = _STATE.get("off", 0) + 1
    try:
        yield
    finally:
        _STATE["off"] -= 1


def native_items(items: np.ndarray, L: int, T: int, B: int, n_blocks: int, n_groups: int,
                 nq: int = 8, lanes: int = 4) -> np.ndarray:
    """Group the quads of codec.entropy.rans_cpu._work_items (int64 [n, 2]: first stream,
    lanes) into native items of up to `nq` quads of one kv and one token-block length (the
    kernel's 8-lane vectors: ``cg_rans_quads()``). Returns int64 [m, nq + 1]: (number of
    quads, first stream of each quad, unused = 0); a single-lane stream is (0, stream, 0,
    ...). Quads
    of one item stay in stream order, so consecutive groups of one row stay neighbours
    (the scalar loop merges those into 8 lanes)."""
    quad = items[:, 1] == lanes
    qs = items[quad, 0]
    singles = items[~quad, 0]
    kv = (qs // n_blocks) // n_groups // L
    b = qs % n_blocks
    blen = np.minimum(B, T - b * B)
    order = np.lexsort((qs, blen, kv))
    qs, kv, blen = qs[order], kv[order], blen[order]
    key = kv * (B + 1) + blen
    start = np.r_[0, np.flatnonzero(np.diff(key)) + 1] if qs.size else np.zeros(0, np.int64)
    rank = np.arange(qs.size) - np.repeat(start, np.diff(np.r_[start, qs.size]))
    item_of = np.cumsum((rank % nq == 0)) - 1 if qs.size else np.zeros(0, np.int64)
    n_vec = int(item_of[-1]) + 1 if qs.size else 0
    out = np.zeros((n_vec + singles.size, nq + 1), dtype=np.int64)
    np.add.at(out[:, 0], item_of, 1)
    out[item_of, 1 + rank % nq] = qs
    out[n_vec:, 1] = singles
    return out


def decode_into(words, w_off, packed, cum, lut, mi, items, L, T, C, G, B, out_k, out_v, deq_k,
                deq_v, t_stride, hd, t_off, err, workers: int) -> bool:
    """Run the native kernel with the (already validated) arguments of
    ``codec.entropy.rans_cpu.decode_streams_into``; returns False (nothing written) when the
    native decoder is off or the element size is not 1, 2 or 4 bytes.

    Args: words uint16 [n_words + pad] (zero padded); w_off int64 [n_streams + 1];
      packed int64 [n_models, 256]; cum uint32 [n_models, 257]; lut uint8 [n_models, 256];
      mi uint16 [2, L, C]; items int64 [n, 2] (as `codec.entropy.rans_cpu._work_items`); out_k/out_v
      C-contiguous [L, T_out, C]; deq_k/deq_v C-contiguous [L, R, NS] of out's dtype;
      err int64 [n_streams] (written: per-stream error code, 0 = ok); workers >= 1 threads.
    """
    esize = out_k.dtype.itemsize
    if esize not in (1, 2, 4):
        return False
    lib = use_native()
    if lib is None:
        return False
    n_groups, n_blocks = -(-C // G), -(-T // B)
    it = np.ascontiguousarray(native_items(items, L, T, B, n_blocks, n_groups, int(lib.cg_rans_quads())), dtype=np.int64)
    pk32 = np.ascontiguousarray(packed, dtype=np.int64).astype(np.uint32)  # reachable rows fit
    cu32 = np.ascontiguousarray(cum, dtype=np.uint32)
    args = (words, w_off, pk32, cu32, np.ascontiguousarray(lut, np.uint8),
            np.ascontiguousarray(mi, np.uint16), it)
    ptr = [a.ctypes.data for a in args]
    rc = lib.cg_rans_decode(*ptr, it.shape[0], L, T, C, G, B, out_k.ctypes.data, out_v.ctypes.data,
                            deq_k.ctypes.data, deq_v.ctypes.data, out_k.shape[1], deq_k.shape[1],
                            deq_k.shape[2], deq_v.shape[1], deq_v.shape[2], t_stride, hd, t_off, esize, err.ctypes.data,
                            max(1, int(workers)),
                            int(simd_wanted() and _fits_int32(words, cu32.shape[0], deq_k, deq_v)),
                            cu32.shape[0])
    if rc < 0:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Build (if needed) and load the library; print its path. Exit 0 if it loads, 1 if not."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m codec.entropy.rans_native", description=main.__doc__)
    ap.parse_args(argv)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lib = load()
    if lib is None:
        print(f"native rANS decoder: off ({_STATE.get('why')}); the numba kernel is used", file=sys.stderr)
        return 1
    print(f"native rANS decoder: {library_path()}")
    del w
    return 0


if __name__ == "__main__":
    sys.exit(main())
