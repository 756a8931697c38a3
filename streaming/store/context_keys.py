"""Context keys as names: the one length bound and the plain-name rule that every source
and the connector's trust check apply, and the file name a key is stored under.

Why one place: a key the trust check accepts must be one every source can save AND look
up; when each had its own limit, keys of 129-255 characters were saved by the local
source and refused by every lookup, and longer ones reached the filesystem's 255-byte
name limit as a raw OSError (kind of LMCache #4827). Here:
  MAX_KEY_CHARS - the bound. The operator's `max_key_chars` (vLLM connector extra config)
      may lower it, never raise it (`key_limit`); the trust check and the local source
      read the same value.
  check_context_key - a plain name [A-Za-z0-9._-], not starting with ".", no "..", 1 to
      the bound characters; one-line ValueError otherwise.
  key_file_name - the folder name of a key in the local source: the key itself when it
      is short (<= PLAIN_NAME_CHARS) and in the shared partition, else "+" and a sha256
      of the partition and the key (65 characters: under any filesystem's name limit; "+"
      is outside the key alphabet, so a hashed name never equals a plain key).
The KV store server and Redis address entries by 64-hex content keys
(streaming.store.format), within the bound by construction.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 stores a context's KV under its
key for reuse. No project import. Not runnable.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

MAX_KEY_CHARS = 1024     # the longest context key accepted anywhere
PLAIN_NAME_CHARS = 128   # keys up to this length (shared partition) are their own file name
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._\-]*$")


def key_limit(configured: Any = None) -> int:
    """The key bound in force: MAX_KEY_CHARS, or the operator's lower `configured` value.
    Raises ValueError (one line) for a value that is not an int in 1..MAX_KEY_CHARS."""
    if configured is None:
        return MAX_KEY_CHARS
    if isinstance(configured, bool) or not isinstance(configured, int) or \
            not 1 <= configured <= MAX_KEY_CHARS:
        raise ValueError(f"max_key_chars must be an integer in 1..{MAX_KEY_CHARS} (the bound "
                         f"every source shares), got {configured!r}")
    return configured


def check_context_key(key: Any, max_chars: int = MAX_KEY_CHARS) -> str:
    """`key` when it is a plain name of 1..min(max_chars, MAX_KEY_CHARS) characters, else a
    one-line ValueError naming what is wrong (type, length, characters)."""
    limit = min(int(max_chars), MAX_KEY_CHARS)
    if not isinstance(key, str):
        raise ValueError(f"context_key must be a string, got {type(key).__name__}")
    if not key or len(key) > limit:
        raise ValueError(f"context_key must have 1..{limit} characters, got {len(key)}")
    if not _NAME_RE.match(key) or ".." in key:
        raise ValueError(f"context_key {key[:80]!r} is not a plain name "
                         "([A-Za-z0-9._-], no leading '.', no '..')")
    return key


def key_file_name(key: str, partition: str = "") -> str:
    """The file (folder) name the local source stores `key` under for `partition` ("" = the
    shared one): the key itself when len(key) <= PLAIN_NAME_CHARS and the partition is
    shared, else "+" + sha256 hex of (partition, key). Raises ValueError for a key that
    check_context_key refuses."""
    check_context_key(key)
    if not partition and len(key) <= PLAIN_NAME_CHARS:
        return key
    h = hashlib.sha256(b"cgh-local-key\x00" + partition.encode("utf-8") + b"\x00" + key.encode("utf-8"))
    return "+" + h.hexdigest()
