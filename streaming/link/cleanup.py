"""What removes a shaped link's leftovers: whether the netns method is usable here
(netns_available), the removal of namespaces and veths left by dead runs (cleanup_stale),
and the teardown registry that closes every live link on SIGINT/SIGTERM/SIGHUP and at
interpreter exit (installed when the first link opens).

Apart from streaming.link (the ShapedLink itself), which re-exports these names. Not
runnable; `python -m streaming.link --cleanup` calls cleanup_stale.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import threading
import time
import weakref

from streaming.link.rules import NS_RE, VETH_RE, pid_alive, run_cmd


def netns_available() -> tuple[bool, str]:
    """(True, "") if the netns method can be used here, else (False, reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not running as root (netns + tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"iproute2 tool {tool!r} not found"
    return True, ""


def kill_ns_pids(ns: str) -> None:
    cp = run_cmd(["ip", "netns", "pids", ns], check=False)
    pids = [int(p) for p in cp.stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in pids if pid_alive(p)]
        if not live:
            return
        for p in live:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(pid_alive(p) for p in live):
            time.sleep(0.05)


def cleanup_stale(verbose: bool = False) -> list[str]:
    """Remove namespaces and veths with our prefix whose owner pid is dead.

    Returns the names removed. Safe to call any time (does nothing without root/iproute2).
    Limitation: an owner pid reused by an unrelated process keeps its leftovers alive
    until that process exits.
    """
    ok, _ = netns_available()
    if not ok:
        return []
    removed = []
    cp = run_cmd(["ip", "netns", "list"], check=False)
    for line in cp.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NS_RE.match(name)
        if m and not pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid():
            kill_ns_pids(name)
            run_cmd(["ip", "netns", "del", name], check=False)
            removed.append(name)
    cp = run_cmd(["ip", "-o", "link", "show"], check=False)
    for line in cp.stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = VETH_RE.match(name)
        if m and not pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid():
            run_cmd(["ip", "link", "del", name], check=False)
            removed.append(name)
    if verbose and removed:
        print(f"streaming.link: removed stale {removed}", file=sys.stderr)
    return removed


# --------------------------------------------------------------------------- teardown registry
LIVE_LINKS: "weakref.WeakSet" = weakref.WeakSet()  # the open ShapedLinks (streaming.link)
_HANDLERS_INSTALLED = False
_PREV_HANDLERS: dict[int, object] = {}


def _close_all() -> None:
    for link in list(LIVE_LINKS):
        try:
            link.close()
        except Exception as e:  # noqa: BLE001 - teardown must go on
            print(f"streaming.link: teardown error: {e}", file=sys.stderr)


def _on_signal(signum, frame):
    prev = _PREV_HANDLERS.get(signum)
    if prev == signal.SIG_IGN:  # e.g. SIGHUP under nohup: the process keeps running
        return None
    _close_all()
    if callable(prev):
        return prev(signum, frame)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    # SIGTERM/SIGHUP: an exception, so every with-block of the caller unwinds (engines,
    # servers, temp folders); exit status 128 + signal number, as for a signal death
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                _PREV_HANDLERS[sig] = signal.getsignal(sig)
                signal.signal(sig, _on_signal)
            except (ValueError, OSError):
                pass
    _HANDLERS_INSTALLED = True
