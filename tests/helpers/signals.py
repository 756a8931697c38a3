"""Signal handling of the child processes that tests start."""
from __future__ import annotations


def default_sigint() -> None:
    """``preexec_fn`` of a child that a test interrupts with SIGINT: the default disposition,
    so its Python raises KeyboardInterrupt even when this test run inherited SIGINT ignored
    (a shell starts background jobs that way, e.g. ``cmd &`` without job control)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
