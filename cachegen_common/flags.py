"""The flags every command shares: one spelling, one meaning, one unit per idea.

After lm-eval's argument groups: a command calls the adders for the ideas it has, with its
own default where it has one. The spellings (and their old, hidden spellings):

========================  =====================  =========================================
flag                      argparse dest          old spellings (hidden, same dest)
========================  =====================  =========================================
``--model``               ``model``              -
``--data-path``           ``data_path``          ``--data``
``--out``                 ``out``                ``--json``
``--seed``                ``seed``               -
``--bandwidth-mbps``      ``bandwidth_mbps``     ``--rate-mbps``
``--link-method``         ``link_method``        ``--method``
``--quick``               ``quick``              -
``--verbose`` / ``-v``    ``verbose``            -
``--repeats``             ``repeats``            ``--reps``
``--context-tokens``      ``context_tokens``     ``--context``, ``--tokens`` (where a command had them)
``--config FILE``         ``config``             -
========================  =====================  =========================================

Units: bandwidth in Mbit/s (10**6 bits/s; :mod:`cachegen_common.units` converts), context sizes in
tokens, repeats a count. An old spelling parses to the same dest (so scripts keep working)
and is left out of ``--help``.

``--config FILE`` names a defaults file (``configs/<command>.yaml``; ``.toml`` and
``.json`` read too): its keys are the command's argparse dests; :func:`parse_with_config`
loads it (or the command's default file), sets the parser's defaults from it and parses,
so flags given on the command line win. An unknown key or an unreadable file is a
:class:`ConfigFileError` (a one-line error and exit 2 through ``parser.error``).

Standard library only (PyYAML is imported only to read a ``.yaml`` file). The defaults
file's reading and its merge with the parser are in :mod:`cachegen_common.config_file`
(import ``load_config``, ``parse_with_config``, ``ConfigFileError`` from there).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from cachegen_common.config_file import CONFIGS

__all__ = ["DEPRECATED", "LINK_METHODS", "add_model", "add_data_path",
           "add_out", "add_seed", "add_bandwidth", "add_link_method", "add_quick",
           "add_verbose", "add_repeats", "add_context_tokens", "add_config"]

LINK_METHODS = ("auto", "netns", "userspace")
"""How a link is shaped: auto (netns as root, else userspace), netns (veth + tc tbf in
network namespaces; root), userspace (a token-bucket proxy on loopback)."""

DEPRECATED: dict[str, tuple[str, ...]] = {
    "data_path": ("--data",),
    "out": ("--json",),
    "bandwidth_mbps": ("--rate-mbps",),
    "link_method": ("--method",),
    "repeats": ("--reps",),
}
"""dest -> the old spellings every command accepts (hidden from --help)."""


def _add(parser, flag: str, dest: str, aliases: Iterable[str] = (), *,
         short: Optional[str] = None, **kw: Any) -> argparse.Action:
    names = [short, flag] if short else [flag]
    action = parser.add_argument(*names, dest=dest, **kw)
    hidden = {k: v for k, v in kw.items() if k not in ("help", "default", "metavar", "required")}
    for old in (*DEPRECATED.get(dest, ()), *aliases):
        parser.add_argument(old, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                            **hidden)
    return action


def add_model(parser, *, default: Optional[str] = None, help: Optional[str] = None):
    """``--model SPEC``: an HF id, a local HF folder or a .gguf file (default: the embedded
    SmolLM2-135M-Instruct, unless the command gives another default)."""
    return _add(parser, "--model", "model", default=default, metavar="SPEC",
                help=help or "model: HF id, local HF folder or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")


def add_data_path(parser, *, default: Optional[str] = None, help: Optional[str] = None,
                  type=None):
    """``--data-path PATH`` (old: ``--data``): the command's input data, a file or folder."""
    kw = {"type": type} if type else {}
    return _add(parser, "--data-path", "data_path", default=default, metavar="PATH",
                help=help or "your data: a file or folder (default: the command's own)", **kw)


def add_out(parser, *, default: Any = None, help: Optional[str] = None, type=None):
    """``--out PATH`` (old: ``--json``): where the command writes its result file."""
    kw = {"type": type} if type else {}
    return _add(parser, "--out", "out", default=default, metavar="PATH",
                help=help or "result file (JSON, written atomically)", **kw)


def add_seed(parser, *, default: Optional[int] = 0, help: Optional[str] = None):
    """``--seed N``: the seed of the command's generators (prompts, offsets, data)."""
    return _add(parser, "--seed", "seed", type=int, default=default, metavar="N",
                help=help or "seed of the prompt / data generators (default %(default)s)")


def _bandwidth_arg(text: str) -> float:
    """argparse type of ``--bandwidth-mbps``: cachegen_common.units.check_bandwidth_mbps."""
    from cachegen_common.units import check_bandwidth_mbps
    try:
        return check_bandwidth_mbps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bandwidth(parser, *, default: Any = None, nargs: Optional[str] = None,
                  help: Optional[str] = None):
    """``--bandwidth-mbps R [R ...]`` (old: ``--rate-mbps``): link rate(s) in Mbit/s
    (10**6 bits/s); ``nargs="+"`` for a list."""
    kw = {"nargs": nargs} if nargs else {}
    return _add(parser, "--bandwidth-mbps", "bandwidth_mbps", type=_bandwidth_arg, default=default,
                metavar="MBPS", help=help or "link rate, Mbit/s (default %(default)s)", **kw)


def add_link_method(parser, *, default: Optional[str] = "auto", help: Optional[str] = None):
    """``--link-method {auto,netns,userspace}`` (old: ``--method``): how the link is shaped
    (:data:`LINK_METHODS`)."""
    return _add(parser, "--link-method", "link_method", choices=LINK_METHODS, default=default,
                help=help or "link shaping: auto (netns as root, else userspace), netns (veth + "
                             "tc tbf; root), userspace (token-bucket proxy on loopback) "
                             "(default %(default)s)")


def add_quick(parser, *, help: Optional[str] = None, default: Any = False):
    """``--quick``: a smoke run of the command (its sizes are the command's own); with
    ``default=None`` an absent flag parses to None (for config merging)."""
    if default is None:
        return _add(parser, "--quick", "quick", action="store_const", const=True, default=None,
                    help=help or "smoke run: small sizes, a few minutes")
    return _add(parser, "--quick", "quick", action="store_true",
                help=help or "smoke run: small sizes, a few minutes")


def add_verbose(parser, *, help: Optional[str] = None, short: bool = True):
    """``--verbose`` / ``-v``: say more on the console (logs, per-step lines)."""
    return _add(parser, "--verbose", "verbose", short="-v" if short else None,
                action="store_true", help=help or "say more on the console")


def add_repeats(parser, *, default: Optional[int] = None, help: Optional[str] = None):
    """``--repeats N`` (old: ``--reps``): timed repeats of each measurement (a count;
    summaries take medians)."""
    return _add(parser, "--repeats", "repeats", type=int, default=default, metavar="N",
                help=help or "timed repeats per measurement, count (default %(default)s)")


def add_context_tokens(parser, *, default: Any = None, nargs: Optional[str] = None,
                       help: Optional[str] = None, aliases: Sequence[str] = ()):
    """``--context-tokens N`` (old, where a command had them: ``aliases``, e.g.
    ``("--context",)`` or ``("--tokens",)``): the context (prefix) size in tokens."""
    kw = {"nargs": nargs} if nargs else {}
    return _add(parser, "--context-tokens", "context_tokens", aliases, type=int,
                default=default, metavar="TOKENS",
                help=help or "context size, tokens (default %(default)s)", **kw)


def add_config(parser, *, default: Optional[Path] = None, help: Optional[str] = None):
    """``--config FILE``: a defaults file (YAML, TOML or JSON; keys are the command's
    argparse dests); flags on the command line override it."""
    where = f" (default: {default.relative_to(CONFIGS.parent)})" if default else ""
    return parser.add_argument("--config", type=Path, default=default, metavar="FILE",
                               help=help or f"defaults file: YAML, TOML or JSON, keys = flag "
                                            f"names with _ for -{where}")
