"""A command's defaults file (``--config FILE``): reading it (YAML, TOML or JSON) and
parsing a command line over it, so that flags given on the command line win.

Apart from :mod:`cachegen_common.flags` (the spellings of the shared flags), which documents
the behaviour; import these names from here. Standard library only (PyYAML is imported
only to read a ``.yaml`` file).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
"""The folder of the commands' defaults files."""


class ConfigFileError(ValueError):
    """A defaults file that cannot be read, is malformed, or names an unknown key."""


def load_config(path: Path) -> dict[str, Any]:
    """The mapping in a defaults file (``.yaml``/``.yml``, ``.toml``, ``.json``; an empty
    YAML file is ``{}``).

    Raises:
        ConfigFileError: unreadable, malformed, or not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigFileError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - yaml/toml/json parse errors: one line
        first = " ".join(str(exc).split())[:200]
        raise ConfigFileError(f"config {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: "
                              f"{first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config {path} must be a mapping of keys to values")
    return data


def parser_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The destinations of the parser's options (what a defaults file may set)."""
    return {a.dest for a in parser._actions if a.dest not in ("help", "config", argparse.SUPPRESS)}


def parse_with_config(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None
                      ) -> argparse.Namespace:
    """Parse ``argv`` with the defaults of ``--config FILE`` (or the parser's default
    ``--config``) applied first: flags on the command line win. A bad file exits 2 with a
    one-line error (``parser.error``)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=parser.get_default("config"))
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            data = load_config(known.config)
        except ConfigFileError as exc:
            parser.error(str(exc))
        unknown = sorted(set(data) - parser_dests(parser))
        if unknown:
            parser.error(f"config {known.config}: unknown key(s) {unknown}; known: "
                         f"{sorted(parser_dests(parser))}")
        parser.set_defaults(**data)
    return parser.parse_args(argv)
