"""What stream_load returns: the per-chunk record (ChunkStat) and the load's outcome
(LoadResult), plus the decode function type and its default (codec.decode_kv on CPU).

Pure data, apart from the receiving machinery (streaming.wire_clock) and the fetch
helpers (streaming.load), so a caller reading results needs only this module.
Not runnable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

DecodeFn = Callable[[bytes], Any]


def default_decode_fn() -> DecodeFn:
    """codec.decode_kv on CPU (imported lazily: the link itself knows no codec)."""
    from codec import decode_kv

    return lambda data: decode_kv(data, device="cpu")


@dataclass
class ChunkStat:
    """Per-chunk record. Units: bytes, seconds. level None when text_fallback."""

    index: int
    level: int | None
    text_fallback: bool
    bytes: int
    transfer_s: float
    decode_s: float
    crc_ok: bool
    refetched: bool
    token_start: int = 0
    token_end: int = 0
    fetch_start_s: float = 0.0  # offsets from the start of the load
    fetch_end_s: float = 0.0
    decode_end_s: float = 0.0
    note: str = ""


@dataclass
class LoadResult:
    """Outcome of stream_load. decoded[i] is decode_fn's output for chunk i, or None for a
    text chunk (the caller recomputes token ranges text_token_ranges with the engine)."""

    hit: bool
    key: str
    reason: str = ""
    manifest: Any = None
    chunks: list[ChunkStat] = field(default_factory=list)
    decoded: list[Any] = field(default_factory=list)
    total_s: float = 0.0
    manifest_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None
    decisions: list = field(default_factory=list)
    # transfers cut on overrun, one dict each: chunk, level, deadline_s, wire_s (s from the
    # request to the cut), start_s, early (cut by the progress projection), rule ("projection"
    # or "deadline": the policy's timer), received_bytes, wire_clock_bytes / wire_clock_s (the
    # wire clock's bytes and first-to-last-byte seconds at the last progress check, or None)
    abandoned: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @property
    def text_token_ranges(self) -> list[tuple[int, int]]:
        return [(c.token_start, c.token_end) for c in self.chunks if c.text_fallback]

    @property
    def recompute_tokens(self) -> int:
        return sum(b - a for a, b in self.text_token_ranges)

    def to_dict(self) -> dict:
        """JSON-able summary (without the decoded tensors)."""
        return {
            "hit": self.hit, "key": self.key, "reason": self.reason, "error": self.error,
            "total_s": self.total_s, "manifest_s": self.manifest_s, "transfer_s": self.transfer_s,
            "decode_s": self.decode_s, "bytes": self.bytes, "recompute_tokens": self.recompute_tokens,
            "chunks": [asdict(c) for c in self.chunks],
            "decisions": [asdict(d) for d in self.decisions],
            "abandoned": list(self.abandoned),
        }

