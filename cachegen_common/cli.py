"""The exit convention every command (bench/, kv_extraction_hf, the vLLM check scripts of tests/)
shares: a body that raises one of its expected errors prints one ``error: <message>`` line
on stderr and exits 2 (CONTRIBUTING.md, "bad input gets one clear line and a non-zero
exit"); a body that returns exits 0. One function so that the commands cannot drift apart
in how they fail."""
from __future__ import annotations

import sys
from collections.abc import Callable


def exit_status(body: Callable[[], object], errors: tuple[type[BaseException], ...]) -> int:
    """Run ``body()``; return 0, or 2 after printing ``error: <exc>`` to stderr when it
    raises one of ``errors`` (any other exception propagates)."""
    try:
        body()
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
