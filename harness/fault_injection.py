"""Fault injection for the main job's own tests (off by default): make a codec fail on
purpose, to check that a failing codec never ends the run.

``CACHEGEN_FAULT=kvtc-decode`` (environment): every kvtc decode in this process raises
``codec.CodecError("kvtc: injected fault ...")``, as a decode of corrupt or non-finite
data would. Unset (the default) or empty: nothing is changed. Any other value is refused
with a one-line BenchmarkError (``install`` raises it), so a typo is never a silent no-op.
Only in-process decodes are affected (the HF engine, the perplexity pass); a vLLM
worker process is not patched.

Run: ``CACHEGEN_FAULT=kvtc-decode python run_benchmarks.py --quick --engine hf``.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

FAULT_ENV = "CACHEGEN_FAULT"
FAULTS = ("kvtc-decode",)


@contextlib.contextmanager
def install(log=print) -> Iterator[str | None]:
    """Apply the fault named by ``$CACHEGEN_FAULT`` for the duration of the block (yields
    its name, or None when none is set); restores the patched function after.
    Raises harness.contexts.BenchmarkError for an unknown fault name."""
    name = os.environ.get(FAULT_ENV, "").strip()
    if not name:
        yield None
        return
    from harness.contexts import BenchmarkError

    if name not in FAULTS:
        raise BenchmarkError(f"{FAULT_ENV}={name!r} is not a known fault ({', '.join(FAULTS)})")
    from codec.errors import CodecError
    from codec.kvtc import KvtcCodec

    original = KvtcCodec.decode

    def failing_decode(self, *args, **kwargs):
        raise CodecError(f"kvtc: injected fault ({FAULT_ENV}={name})")

    KvtcCodec.decode = failing_decode
    log(f"fault injection: {FAULT_ENV}={name} (every kvtc decode in this process fails)")
    try:
        yield name
    finally:
        KvtcCodec.decode = original
