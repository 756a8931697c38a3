"""Operating points: for a named quality target, the smallest-size level of each codec whose
KL on a model's calibration windows meets it, as plain data the codec and the benchmarks
read without loading a model.

A level means a different quality on each model (on SmolLM2-135M cachegen 1 has KL 0.040
nats/token against the lossless KV, on Gemma 3 270M 0.272). A user asks for a quality
instead; the model side (``kv_extraction_hf.calibrate.operating_points``) measures every
level of every codec on calibration text windows (a *table*, content-addressed like a
kvtc calibration) and this module picks, per codec and target, the level. KVTC
(arXiv 2511.01815) and NVIDIA Model-Optimizer's KV AutoQuant choose settings by the same
measure (forward KL against the unquantized model) on calibration data.

Targets (``parse_target``):
- ``near-lossless``: KL <= 0.01 nats/token and top-1 agreement >= 0.95;
- ``lmcache``: KL no worse than LMCache's default schedule (``cachegen-ref`` level 0,
  ``REFERENCE``) measured on the same calibration windows of the same model;
- ``kl:X`` (or a bare number): KL <= X nats/token.

The margin (``meets``): a level meets a target when the 95% bootstrap CI UPPER bound of
its mean calibration KL is <= the target's KL (and, with a top-1 floor, its mean top-1
agreement is >= the floor). The KL bound carries the margin; top-1 is compared by its mean
because it is a coarse share (a 32-token continuation moves it in steps of 1/32: its CI
lower bound stayed under 0.95 for every level of every codec on 8 calibration windows of
SmolLM2, cachegen 5's mean 0.953 included). The KL's CI bound rather than ``mean <= target / 1.25``
because the margin then scales with what the calibration windows actually show: a level
whose KL varies a lot between windows, or one measured on few windows, needs more room,
and a near-constant one is not pushed a level up for nothing. The held-out check of the
benchmark (``python -m bench.quality --targets``) is the held-out CI upper bound <= 1.25x
the target.

Stored: a table (``table_bytes`` / ``table_from_bytes``: canonical JSON, sorted keys, no
whitespace, named by its sha256) in ``$CACHEGEN_CACHE/operating-points/<hash>.json`` beside
the kvtc calibrations (``default_dir``). An ``OperatingPoint`` names its table's hash; its
own ``hash`` is the sha256 of its canonical JSON. Errors: ValueError (bad target spelling),
``TargetUnmet`` (a ValueError: no level meets the target; one line naming the closest
level and its KL), ``CodecError`` (a stored table that does not match its hash or is not
one).

    python -m bench.quality --targets near-lossless lmcache      # fits (or loads), then measures
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from .errors import CodecError

__all__ = ["NEAR_LOSSLESS_KL", "NEAR_LOSSLESS_TOP1", "REFERENCE", "TABLE_FORMAT", "Target",
           "TargetUnmet", "OperatingPoint", "parse_target", "meets", "choose_level",
           "operating_point", "canonical_json", "table_bytes", "table_from_bytes", "save_table",
           "load_table", "default_dir"]

NEAR_LOSSLESS_KL = 0.01          # nats/token against the lossless KV
NEAR_LOSSLESS_TOP1 = 0.95        # share of positions whose argmax is the lossless argmax
REFERENCE = ("cachegen-ref", 0)  # LMCache's default schedule (codec.schedules level 0)
TABLE_FORMAT = "operating-point-table"
TABLE_VERSION = 1
MAX_TABLE_BYTES = 8 << 20        # a table is a few KiB per codec level; a shared folder is untrusted
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_SIG_DIGITS = 6


class TargetUnmet(ValueError):
    """No level of a codec meets a target on the calibration windows (one-line message
    naming the closest level and its KL)."""


@dataclass(frozen=True)
class Target:
    """A quality target. ``name``: "near-lossless", "lmcache" or "kl:X"; ``kl``: the KL
    bound (nats/token), None for "lmcache" until resolved on a table (``resolve``);
    ``min_top1``: a floor on top-1 agreement (share, 0..1) or None."""

    name: str
    kl: Optional[float] = None
    min_top1: Optional[float] = None

    def resolve(self, rows: Sequence[dict]) -> "Target":
        """This target with its KL bound set: for "lmcache", the mean calibration KL of
        ``REFERENCE``'s row in ``rows`` (table rows, as ``choose_level``). Raises ValueError
        when the table has no reference row."""
        if self.kl is not None:
            return self
        ref = [r for r in rows if (r["codec"], r["level"]) == REFERENCE]
        if not ref:
            raise ValueError(f"target {self.name} needs {REFERENCE[0]} level {REFERENCE[1]} "
                             "(LMCache's schedule) in the calibration table")
        return Target(self.name, float(ref[0]["kl"]), self.min_top1)

    def describe(self) -> str:
        kl = "KL <= ?" if self.kl is None else f"KL <= {self.kl:.4g}"
        return f"{self.name} ({kl}" + (f", top-1 >= {self.min_top1:g})" if self.min_top1 is not None else ")")


def parse_target(spec: str) -> Target:
    """``"near-lossless"`` | ``"lmcache"`` | ``"kl:X"`` | ``"X"`` (X > 0, nats/token) ->
    ``Target``. Raises ValueError (one line) on anything else."""
    s = str(spec).strip().lower()
    if s == "near-lossless":
        return Target("near-lossless", NEAR_LOSSLESS_KL, NEAR_LOSSLESS_TOP1)
    if s == "lmcache":
        return Target("lmcache")
    num = s[3:] if s.startswith("kl:") else s
    try:
        x = float(num)
    except ValueError:
        raise ValueError(f"unknown quality target {spec!r} (near-lossless, lmcache, or kl:X with X "
                         "in nats/token)") from None
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"target KL must be a positive number of nats/token, got {num!r}")
    return Target(f"kl:{x:g}", x)


def meets(row: dict, target: Target) -> bool:
    """True when a table row meets ``target`` (resolved) with the margin of this module:
    ``row["kl_ci"][1] <= target.kl`` and, with a top-1 floor, ``row["top1"] >=
    target.min_top1``."""
    if target.kl is None:
        raise ValueError(f"target {target.name} is not resolved on a table")
    ok = row["kl_ci"][1] <= target.kl
    if target.min_top1 is not None:
        ok = ok and row["top1"] >= target.min_top1
    return bool(ok)


def choose_level(rows: Sequence[dict], codec: str, target: Target) -> dict:
    """The row of ``codec`` with the largest ``ratio`` (smallest size) among those that
    meet ``target`` (``meets``; ties: the higher level, the finer one).

    ``rows``: table rows ``{"codec", "level", "kl", "kl_ci": [lo, hi], "top1", "top1_ci":
    [lo, hi], "ratio", "n"}`` (KL in nats/token, ratio = KV dtype bytes / coded bytes).
    Raises ValueError when ``codec`` has no row, ``TargetUnmet`` when none meets the target:
    one line naming the closest row (the one with the smallest KL) and its KL."""
    target = target.resolve(rows)
    mine = [r for r in rows if r["codec"] == codec and r["level"] is not None]
    if not mine:
        raise ValueError(f"the calibration table has no level of codec {codec!r}")
    ok = [r for r in mine if meets(r, target)]
    if ok:
        return max(ok, key=lambda r: (r["ratio"], r["level"]))
    best = min(mine, key=lambda r: (r["kl_ci"][1], -r["ratio"]))
    raise TargetUnmet(
        f"no level of {codec} meets {target.describe()} on the calibration windows; closest: "
        f"{codec} {best['level']} at {best['ratio']:.2f}x, KL {best['kl']:.4g} "
        f"[{best['kl_ci'][0]:.4g}, {best['kl_ci'][1]:.4g}], top-1 {best['top1']:.3f}")


@dataclass(frozen=True)
class OperatingPoint:
    """One codec's level for one target on one model, as measured on its calibration
    windows. ``kl`` / ``kl_ci``: mean calibration KL (nats/token) and its 95% bootstrap CI;
    ``top1`` / ``top1_ci`` likewise (share); ``n``: calibration windows; ``ratio``: KV dtype
    bytes / coded bytes on them; ``target_kl`` / ``min_top1``: the resolved target;
    ``text``: the calibration text's record (source, sha256); ``weights_hash``: the
    model's; ``table``: the hash of the table it was chosen from."""

    codec: str
    level: int
    target: str
    target_kl: float
    min_top1: Optional[float]
    kl: float
    kl_ci: tuple
    top1: float
    top1_ci: tuple
    n: int
    ratio: float
    text: dict
    weights_hash: str
    table: str

    def record(self) -> dict:
        """The plain record (JSON-ready), ``hash`` included."""
        d = asdict(self)
        d["kl_ci"], d["top1_ci"] = list(self.kl_ci), list(self.top1_ci)
        return dict(d, hash=self.hash)

    @property
    def hash(self) -> str:
        """sha256 hex of the canonical JSON of the record without ``hash``."""
        d = asdict(self)
        d["kl_ci"], d["top1_ci"] = list(self.kl_ci), list(self.top1_ci)
        return hashlib.sha256(canonical_json(d)).hexdigest()


def operating_point(table: dict, codec: str, target: Target) -> OperatingPoint:
    """The ``OperatingPoint`` of ``codec`` for ``target`` on a table (``table_from_bytes``
    form: ``rows``, ``text``, ``model.weights_hash``, ``hash``). Raises as ``choose_level``."""
    t = target.resolve(table["rows"])
    r = choose_level(table["rows"], codec, t)
    return OperatingPoint(codec=codec, level=int(r["level"]), target=t.name, target_kl=float(t.kl),
                          min_top1=t.min_top1, kl=r["kl"], kl_ci=tuple(r["kl_ci"]), top1=r["top1"],
                          top1_ci=tuple(r["top1_ci"]), n=int(r["n"]), ratio=r["ratio"],
                          text=dict(table["text"]), weights_hash=table["model"]["weights_hash"],
                          table=table["hash"])


# ----------------------------------------------------------------------------- the table
def _round(x):
    """Floats to ``_SIG_DIGITS`` significant digits, recursively: the table's hash must
    not depend on the last bits of a float sum (thread count, BLAS order)."""
    if isinstance(x, float):
        return float(f"{x:.{_SIG_DIGITS}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def canonical_json(doc) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace (floats rounded to 6 significant
    digits): the bytes the hashes of this module are taken over. Raises ValueError on NaN."""
    return json.dumps(_round(doc), sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def table_bytes(table: dict) -> tuple[bytes, str]:
    """(canonical bytes, sha256 hex) of a table ``{"format", "version", "model", "text",
    "settings", "rows", ...}`` (any ``hash`` key is left out of the bytes)."""
    body = {k: v for k, v in table.items() if k != "hash"}
    body.setdefault("format", TABLE_FORMAT)
    body.setdefault("version", TABLE_VERSION)
    data = canonical_json(body)
    return data, hashlib.sha256(data).hexdigest()


def table_from_bytes(data: bytes, expected_hash: Optional[str] = None) -> dict:
    """The table of ``data`` (``table_bytes``' form) with its ``hash`` added. Raises
    CodecError (one line) when over MAX_TABLE_BYTES, not JSON, not a table, or its sha256 is
    not ``expected_hash``."""
    if len(data) > MAX_TABLE_BYTES:
        raise CodecError(f"operating-point table of {len(data)} bytes is over {MAX_TABLE_BYTES}")
    h = hashlib.sha256(data).hexdigest()
    if expected_hash is not None and h != expected_hash:
        raise CodecError(f"operating-point table bytes hash to {h[:16]}, not {str(expected_hash)[:16]}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CodecError(f"operating-point table is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT or not isinstance(doc.get("rows"), list):
        raise CodecError("not an operating-point table (format / rows missing)")
    for r in doc["rows"]:
        if not isinstance(r, dict) or not {"codec", "level", "kl", "kl_ci", "top1", "top1_ci", "ratio", "n"} <= set(r):
            raise CodecError("operating-point table row lacks codec/level/kl/kl_ci/top1/top1_ci/ratio/n")
    return dict(doc, hash=h)


def default_dir() -> Path:
    """``$CACHEGEN_CACHE/operating-points`` or ``~/.cache/cachegen-harness/operating-points``
    (beside the kvtc calibrations' ``kvtc/``; not created)."""
    root = os.environ.get("CACHEGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "cachegen-harness")
    return Path(root) / "operating-points"


def save_table(table: dict, folder: Optional[Path] = None) -> str:
    """Write a table as ``<folder>/<sha256>.json`` (atomic; ``default_dir`` by default);
    returns its hash. The same content always gets the same name and bytes."""
    data, h = table_bytes(table)
    folder = Path(folder) if folder is not None else default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{h}.json"
    if not path.is_file():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return h


def load_table(h: str, folder: Optional[Path] = None) -> dict:
    """The table named ``h`` from ``<folder>/<h>.json`` (verified against ``h``). Raises
    CodecError when ``h`` is not a sha256 hex, the file is missing, or it does not verify."""
    if not isinstance(h, str) or not _HASH_RE.match(h):
        raise CodecError(f"{str(h)[:80]!r} is not an operating-point table hash")
    path = (Path(folder) if folder is not None else default_dir()) / f"{h}.json"
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_TABLE_BYTES + 1)
    except OSError:
        raise CodecError(f"operating-point table {h[:16]} is not in {path.parent}") from None
    return table_from_bytes(data, h)
