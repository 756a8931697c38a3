"""Bounded JSON parsing for bytes the project did not write itself.

Every JSON document the harness reads from outside the running process (a KV dump's
metadata, a store manifest, a store-protocol frame's metadata, a calibration index) goes
through :func:`parse`: its size is checked before it is decoded and its nesting depth
before it is parsed, so a hostile file gives one clear error, never a ``RecursionError``
from deep inside the JSON decoder (the kind of safetensors CVE-2023-37470: metadata the
reader trusts to be small and flat) and never a run of minutes over a huge value.
:func:`int_list` checks a parsed value is a flat list of integers (token ids).

Standard library only; the codec, which imports no other project package, bounds its own
container headers in ``codec.bitstream``. Not runnable.
"""

from __future__ import annotations

import json
import re

# Nesting the project's own documents never exceed: a manifest is four levels deep, a
# dump's token ids one, a frame's metadata two; 32 leaves room and stays far below the
# interpreter's recursion limit (1000), which the C JSON decoder counts against.
DEFAULT_MAX_DEPTH = 32

# A JSON string, escapes included (the brackets inside one are text, not nesting).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class JsonBoundsError(ValueError):
    """A JSON document over its size or depth bound, malformed, or of the wrong type.
    The message is one line naming the document."""


def nesting_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest nesting of ``[``/``{`` in ``text`` (JSON), strings excluded; 0 for a
    scalar. Stops counting once ``stop_above`` is exceeded (returns that depth + 1), so a
    hostile document costs one pass at most. Malformed text gives some depth, never an error."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        else:
            depth -= 1
    return deepest


def _no_constants(name: str):
    raise ValueError(f"non-finite number {name}")


def parse(data: bytes | bytearray | memoryview | str, *, what: str, max_bytes: int,
          max_depth: int = DEFAULT_MAX_DEPTH, expect: type | tuple[type, ...] | None = None,
          error: type[Exception] = JsonBoundsError):
    """Parse one JSON document of at most ``max_bytes`` bytes (UTF-8) and ``max_depth``
    levels of nesting.

    Args:
      data: the document, bytes (UTF-8) or str.
      what: its name in messages, e.g. "KV dump x.safetensors: token_ids".
      max_bytes: the size bound in bytes (str: its UTF-8 length, checked by characters
        first so that a huge str is refused without encoding it).
      max_depth: the nesting bound (``[[1]]`` is 2 deep).
      expect: the type(s) the top level must have (e.g. ``dict``), or None for any.
      error: the exception class raised (the caller's documented error; it is called
        with one str argument).

    Returns the parsed value (dict, list, str, int, float, bool or None). NaN and
    Infinity are refused.

    Raises ``error`` (default :class:`JsonBoundsError`) when the document is over either
    bound, not UTF-8, not JSON, or of another top-level type than ``expect``.
    """
    if isinstance(data, str):
        if len(data) > max_bytes:   # each character is at least one UTF-8 byte
            raise error(f"{what}: {len(data)} characters, over the {max_bytes}-byte limit")
        text = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > max_bytes:
            raise error(f"{what}: {len(data)} bytes, over the {max_bytes}-byte limit")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    else:
        raise error(f"{what}: expected JSON bytes or str, got {type(data).__name__}")
    if len(text) > max_bytes // 4 and len(text.encode("utf-8")) > max_bytes:
        raise error(f"{what}: over the {max_bytes}-byte limit")
    depth = nesting_depth(text, stop_above=max_depth)
    if depth > max_depth:
        raise error(f"{what}: JSON nested more than {max_depth} level{'s' if max_depth != 1 else ''} deep")
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except RecursionError:   # not reached after the depth check; kept as a last guard
        raise error(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise error(f"{what}: not valid JSON ({msg})") from None
    if expect is not None and not isinstance(value, expect):
        names = expect.__name__ if isinstance(expect, type) else " or ".join(t.__name__ for t in expect)
        raise error(f"{what}: expected a JSON {_json_name(names)}, got {_json_name(type(value).__name__)}")
    return value


def _json_name(py: str) -> str:
    return {"dict": "object", "list": "array", "str": "string", "int": "integer", "float": "number",
            "bool": "boolean", "NoneType": "null"}.get(py, py)


def int_list(value, *, what: str, max_len: int, lo: int = 0, hi: int = 2**31 - 1,
             error: type[Exception] = JsonBoundsError) -> list[int]:
    """``value`` checked to be a flat list of at most ``max_len`` integers in ``[lo, hi]``
    (bools are not integers). Returns it as a list of int. Raises ``error`` otherwise."""
    if not isinstance(value, list):
        raise error(f"{what}: expected a JSON array of integers, got {_json_name(type(value).__name__)}")
    if len(value) > max_len:
        raise error(f"{what}: {len(value)} entries, over the limit of {max_len}")
    for i, x in enumerate(value):
        if type(x) is not int:
            raise error(f"{what}: entry {i} is a JSON {_json_name(type(x).__name__)}, expected an integer")
        if not lo <= x <= hi:
            raise error(f"{what}: entry {i} = {x} outside [{lo}, {hi}]")
    return list(value)
