"""Identity of a stored KV entry: what made its bytes (model, tokenizer, dtype, shape, codec
config), and the one check every reader runs before using an entry.

Paper: CacheGen section 5 stores a context's encoded KV for reuse; reuse is only correct
for the same model and the same codec configuration (LMCache's cache key likewise carries
the model name, world size and KV dtype, `lmcache/utils.py: CacheEngineKey`). This module
is the harness's single definition of that identity: the store key (streaming.store
`entry_key`) hashes all of it, the manifest of every entry (store server, Redis, local
folder) repeats it, and every reader - the store client, the Redis client, the local-folder
source, the HF engine path and the vLLM connector - calls `check_entry(expected, found)`
and treats any mismatch as a miss with the returned reason, never as data.

Three parts, in this order: the record (`EntryIdentity`: fields, validation, JSON form, key
material), the readers' check (`check_entry`, `merge_expected`), and where the fields come
from (a model folder's weights and tokenizer hashes, a loaded model's info, the codec's
config hashes and version).

No model, codec or network import at module level: the fields are strings and ints. Helpers
that hash a model folder (`folder_weights_hash`, `folder_tokenizer_hash`) read files only;
`codec_identity` imports the codec lazily. Not runnable.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from cachegen_common.files import files_sha256
from cachegen_common.kv_config import describe_difference

IDENTITY_FORMAT = "cgh-identity-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json")
_STR_FIELDS = ("model_id", "weights_hash", "tokenizer_hash", "dtype", "config_hash", "codec",
               "codec_version", "calibration_hash", "kv_layout")
# strings checked for type only (kv_config is compared through config_hash; partition always
# compared, "" included: see streaming.identity)
_OTHER_STR_FIELDS = ("kv_config", "partition")
# left out of the JSON form (hence of the key) when empty: identities without them keep
# their keys
_OMIT_EMPTY = ("kv_layout", "kv_config", "config_hash", "partition")
_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim")
# fields that do not enter codec_tag(): model_id and weights_hash enter the key directly
_KEYED_APART = ("model_id", "weights_hash")
NO_LEVEL_KEY = "none"  # the JSON / store-key form of level None (a codec without levels)


def parse_level(value: Any) -> int | None:
    """A stored level from its JSON value: an int >= 0 (a codec level), or None (the one
    slot of a codec without levels). Raises ValueError for anything else (bool, str,
    float, negative)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a stored level is an int >= 0 or null (no level), got {str(value)[:40]!r}")
    return int(value)


def level_key(level: int | None) -> str:
    """The text form of a stored level in JSON object keys and store keys: its decimal
    number, or NO_LEVEL_KEY ("none") for level None. Raises ValueError for a bad level."""
    lv = parse_level(level)
    return NO_LEVEL_KEY if lv is None else str(lv)


def parse_level_key(text: Any) -> int | None:
    """The level of a level_key() text ("none" -> None, "3" -> 3). Raises ValueError for
    anything else (e.g. "-1", " 3", "03", "None")."""
    if text == NO_LEVEL_KEY:
        return None
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or str(int(text)) != text:
        raise ValueError(f"a stored level key is a decimal level or {NO_LEVEL_KEY!r}, got {str(text)[:40]!r}")
    return int(text)


def level_order(level: int | None) -> int:
    """Sort key of stored levels: None (no level) first, then ascending levels."""
    return -1 if level is None else int(level)


@dataclass(frozen=True)
class EntryIdentity:
    """Everything that changes the bytes of a stored entry. "" / 0 / () = not known.

    model_id: model name or path as the writer knows it; weights_hash: sha256 (hex) of the
    weight files (`folder_weights_hash`); tokenizer_hash: sha256 of the tokenizer files
    (`folder_tokenizer_hash`); dtype: torch dtype name of the KV ("bfloat16");
    num_layers, num_kv_heads, head_dim: the KV shape [L, T, H, D] without T;
    codec: codec name ("cachegen", "kivi2", ...); codec_version: the codec package's
    bitstream/algorithm version (`codec.CODEC_VERSION`); level_configs: ((level, full
    config hash), ...) for every stored level (`codec.config_hash(codec, level, config)`);
    level None = the one slot of a codec without levels (JSON key "none", `level_key`);
    calibration_hash: hash of a calibration artifact the codec used (e.g. kvtc), or "";
    several joined by "+" when each layer group has its own (sliding-window storage:
    ``calibration_hashes``).
    kv_layout: "" = the full layout (every layer every token); else the sliding-window
    layout's tag (``codec.window.layout.layout_tag``: which tokens each layer keeps). Left out
    of the JSON form when "" (so full-layout identities and their keys are unchanged).
    kv_config: canonical JSON of the model config's K/V-shaping fields
    (cachegen_common.kv_config.kv_config: RoPE theta and scaling, windows, attention
    scaling, geometry); config_hash: its sha256 (computed from kv_config when not given;
    ValueError when both are given and disagree). A reader that knows config_hash misses
    an entry with another one, naming the differing field.
    partition: "" = the shared partition; else a digest of a request's isolation keys (the
    vLLM connector derives it from the request's cache_salt and LoRA adapter).
    Compared always, "" included: a partition never reads another's entries, and the key
    differs with it. kv_config, config_hash and partition are left out of the JSON form
    when "" (identities without them keep their keys).
    """

    model_id: str = ""
    weights_hash: str = ""
    tokenizer_hash: str = ""
    dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    codec: str = ""
    codec_version: str = ""
    level_configs: tuple[tuple[int | None, str], ...] = field(default=())
    calibration_hash: str = ""
    kv_layout: str = ""
    kv_config: str = ""
    config_hash: str = ""
    partition: str = ""

    def __post_init__(self) -> None:
        for n in _STR_FIELDS + _OTHER_STR_FIELDS:
            v = getattr(self, n)
            if v is None:
                object.__setattr__(self, n, "")
            elif not isinstance(v, str) or "\x00" in v:
                raise ValueError(f"identity field {n} must be a str without NUL, got {v!r}")
        for n in _INT_FIELDS:
            v = getattr(self, n)
            if v is None:
                v = 0
            if isinstance(v, bool) or int(v) != v or int(v) < 0:
                raise ValueError(f"identity field {n} must be an int >= 0, got {v!r}")
            object.__setattr__(self, n, int(v))
        lc = self.level_configs
        if isinstance(lc, Mapping):
            lc = lc.items()
        try:
            pairs = tuple(sorted(((parse_level(lv), str(h)) for lv, h in (lc or ())),
                                 key=lambda p: level_order(p[0])))
        except (TypeError, ValueError) as e:
            raise ValueError(f"level_configs must be (level, config hash) pairs: {e}") from None
        if len({lv for lv, _ in pairs}) != len(pairs):
            raise ValueError("level_configs lists a level twice")
        if None in {lv for lv, _ in pairs} and len(pairs) > 1:
            raise ValueError("level_configs mixes the no-level slot with numbered levels")
        object.__setattr__(self, "level_configs", pairs)
        if self.kv_config:
            from cachegen_common.kv_config import kv_config_hash

            h = kv_config_hash(self.kv_config)
            if self.config_hash and self.config_hash != h:
                raise ValueError("config_hash does not match kv_config")
            object.__setattr__(self, "config_hash", h)

    # ----------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        """JSON-able dict (level_configs as {level_key(level): hash}), with the format tag."""
        d = asdict(self)
        d["level_configs"] = {level_key(lv): h for lv, h in self.level_configs}
        for n in _OMIT_EMPTY:
            if not d[n]:
                del d[n]
        d["format"] = IDENTITY_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "EntryIdentity":
        """Build from to_dict()'s output (unknown keys ignored). Raises ValueError."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"identity must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        lc = kw.get("level_configs")
        if isinstance(lc, Mapping):
            kw["level_configs"] = {parse_level_key(k): h for k, h in lc.items()}
        return cls(**kw)

    def replace(self, **kw) -> "EntryIdentity":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        return EntryIdentity(**d)

    def calibration_hashes(self) -> tuple[str, ...]:
        """The calibration artifacts the entry needs (``calibration_hash`` split at "+")."""
        return tuple(h for h in self.calibration_hash.split("+") if h)

    @property
    def levels(self) -> tuple[int | None, ...]:
        """The stored levels in order ((None,) for a codec without levels)."""
        return tuple(lv for lv, _ in self.level_configs)

    def model_part(self) -> "EntryIdentity":
        """The same identity without its codec fields (what an engine knows by itself)."""
        return EntryIdentity(self.model_id, self.weights_hash, self.tokenizer_hash, self.dtype,
                             self.num_layers, self.num_kv_heads, self.head_dim,
                             kv_config=self.kv_config, config_hash=self.config_hash,
                             partition=self.partition)

    # ----------------------------------------------------------------- key material
    def fingerprint(self) -> str:
        """sha256 (hex) of every field except model_id and weights_hash (canonical JSON)."""
        d = self.to_dict()
        for k in _KEYED_APART:
            d.pop(k)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(b"cgh-entry-identity\x00" + blob).hexdigest()

    def codec_tag(self) -> str:
        """The store key's codec tag: "<codec>#<fingerprint[:32]>". Any change of the codec
        config, level set, codec version, calibration, tokenizer, dtype, shape, model config
        or partition changes it, hence the key (streaming.store.entry_key)."""
        if not self.codec:
            raise ValueError("an entry identity needs a codec name to make a store key")
        return f"{self.codec}#{self.fingerprint()[:32]}"

    def require_complete(self) -> "EntryIdentity":
        """Writers must know model_id, weights_hash, codec and level_configs. Returns self;
        raises ValueError naming the missing fields."""
        missing = [n for n in ("model_id", "weights_hash", "codec") if not getattr(self, n)]
        if not self.level_configs:
            missing.append("level_configs")
        if missing:
            raise ValueError(f"entry identity incomplete: {', '.join(missing)} missing")
        return self


def check_entry(expected: EntryIdentity | Mapping | None, found: Mapping | EntryIdentity | None,
                levels: Iterable[int] | None = None) -> str | None:
    """None when a stored entry may be served for `expected`, else the reason (one line).

    Every field `expected` knows ("" / 0 = unknown) must be present and equal in `found`
    (the entry's identity dict, from its manifest); an entry without an identity, or
    without a field the reader knows, is a mismatch - never served on trust. A model
    config that differs is named by its first differing field ("model config rope_theta
    differs: entry has ..., reader expects ..."). The partition is compared always ("" is
    the shared partition, not unknown): an entry of another partition is a miss. Expected
    level_configs must appear with the same config hash in the entry; `levels`, when
    given, are stored levels the reader will fetch (None: the no-level slot of a codec
    without levels) and must be in the entry's level_configs.
    Raises nothing: a malformed `found` is a mismatch.
    """
    if expected is None:
        return None
    try:
        exp = expected if isinstance(expected, EntryIdentity) else EntryIdentity.from_dict(expected)
    except (ValueError, TypeError) as e:
        return f"reader identity unusable: {e}"
    if found is None:
        if exp == EntryIdentity():
            return None
        return "entry carries no identity (written before identities were recorded)"
    try:
        got = found if isinstance(found, EntryIdentity) else EntryIdentity.from_dict(found)
    except (ValueError, TypeError) as e:
        return f"entry identity malformed: {e}"
    if exp.partition != got.partition:
        return "entry belongs to another cache partition (cache_salt / LoRA adapter differ)"
    for n in _STR_FIELDS + _INT_FIELDS:
        want, have = getattr(exp, n), getattr(got, n)
        if n == "config_hash" and want and want != have:
            if not have:
                return "entry records no model config (written before configs were recorded)"
            return describe_difference(got.kv_config, exp.kv_config)
        if want and want != have:
            return f"{n} mismatch: entry has {have!r}, reader expects {want!r}" if have else \
                f"entry has no {n}, reader expects {want!r}"
    if got.kv_layout and not exp.kv_layout and exp.level_configs:
        # a reader that names the levels it wants but not a window layout wants the full one
        return f"entry stores a sliding-window layout ({got.kv_layout[:40]}...), reader expects the full layout"
    have_lc = dict(got.level_configs)
    for lv, h in exp.level_configs:
        if lv not in have_lc:
            return f"level {level_key(lv)} not in the entry (it has levels {sorted(have_lc, key=level_order)})"
        if have_lc[lv] != h:
            return (f"level {level_key(lv)} config mismatch: entry encoded with config {have_lc[lv][:16]}, "
                    f"reader expects {h[:16]} (codec schedule changed?)")
    if levels is not None and exp.codec:
        for lv in levels:
            try:
                lv = parse_level(lv)
            except ValueError as e:
                return f"reader level unusable: {e}"
            if lv not in have_lc:
                return f"level {level_key(lv)} not in the entry (it has levels {sorted(have_lc, key=level_order)})"
    return None


def merge_expected(*parts: EntryIdentity | Mapping | None) -> EntryIdentity:
    """Combine expectations field by field (first known value wins; a later DIFFERENT known
    value raises ValueError: the reader's own model and a request disagree)."""
    out: dict[str, Any] = {}
    for p in parts:
        if p is None:
            continue
        e = p if isinstance(p, EntryIdentity) else EntryIdentity.from_dict(p)
        for f in fields(EntryIdentity):
            v = getattr(e, f.name)
            if not v:
                continue
            if f.name in out and out[f.name] != v:
                raise ValueError(f"conflicting expectations for {f.name}: {out[f.name]!r} vs {v!r}")
            out[f.name] = v
    return EntryIdentity(**out)


def folder_weights_hash(folder: str | os.PathLike) -> str:
    """sha256 (hex) over a model folder's weight files in name order (*.safetensors, else
    *.bin): name + NUL + bytes per file - the same value as
    kv_extraction_hf.model.weights_hash (which caches it). Raises FileNotFoundError when
    the folder holds no weight files."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no weight files (*.safetensors or *.bin) in {folder}")
    return files_sha256(files)


def folder_tokenizer_hash(folder: str | os.PathLike) -> str:
    """sha256 (hex) over the tokenizer files of a model folder (TOKENIZER_FILES present, in
    that order: name + NUL + bytes), "" when there are none."""
    folder = Path(folder)
    h = hashlib.sha256(b"cgh-tokenizer\x00")
    n = 0
    for name in TOKENIZER_FILES:
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
            n += 1
    return h.hexdigest() if n else ""


def model_identity(info: Any, tokenizer_hash: str = "") -> EntryIdentity:
    """Model part of an identity from an object with the attributes of
    kv_extraction_hf.model.ModelInfo (model_id, weights_hash, dtype, num_layers,
    num_kv_heads, head_dim; optional path, used for the tokenizer hash when not given;
    optional kv_config, the canonical JSON of the config's K/V-shaping fields,
    cachegen_common.kv_config.config_json_of)."""
    if not tokenizer_hash and getattr(info, "path", None):
        try:
            tokenizer_hash = folder_tokenizer_hash(info.path)
        except OSError:
            tokenizer_hash = ""
    return EntryIdentity(
        model_id=str(getattr(info, "model_id", "") or ""),
        weights_hash=str(getattr(info, "weights_hash", "") or ""),
        tokenizer_hash=tokenizer_hash,
        dtype=str(getattr(info, "dtype", "") or "").replace("torch.", ""),
        num_layers=int(getattr(info, "num_layers", 0) or 0),
        num_kv_heads=int(getattr(info, "num_kv_heads", 0) or 0),
        head_dim=int(getattr(info, "head_dim", 0) or 0),
        kv_config=str(getattr(info, "kv_config", "") or ""),
    )


def codec_config_hash(codec: str, level: int | None, config: Any = None,
                      num_layers: int | None = None) -> str:
    """`codec.config_hash(codec, level, config, num_layers=...)`: a hash of everything that
    changes the bytes of `level` of `codec` (None = its default level) - codec name,
    resolved level, full resolved config, codec and container versions - for a model of
    `num_layers` layers (None/0 = unknown). Imports the codec lazily. Raises ValueError for
    an unknown codec or level."""
    import codec as codec_pkg

    return str(codec_pkg.config_hash(codec, level, config, num_layers=num_layers or None))


def codec_version() -> str:
    """`codec.CODEC_VERSION` as a string (bumped whenever any codec's bytes change)."""
    import codec as codec_pkg

    return str(codec_pkg.CODEC_VERSION)


def level_slot(codec: str, level: int | None) -> int | None:
    """The store's level of `level` of `codec`: the codec level resolved once
    (codec.resolve_level: None -> the codec's default; 0 stays 0), or None for a codec
    without levels (stored in its own slot, "none" in keys and manifests: never level 0).
    Imports the codec lazily. Raises ValueError for an unknown codec or level."""
    import codec as codec_pkg

    return codec_pkg.resolve_level(codec, level)


def codec_identity(base: EntryIdentity, codec: str,
                   levels: Iterable[int | None] | Mapping[int, int | None], config: Any = None,
                   calibration_hash: str = "") -> EntryIdentity:
    """`base` (a model identity) plus the codec fields for `codec`.

    levels: the codec levels stored (None = the codec's default level, or no level for a
    codec without levels), each stored under `level_slot` (the resolved level; None for a
    codec without levels), or a mapping {stored level: codec level} when the store numbers
    them otherwise. Each level's full config is
    hashed for base.num_layers (codec.config_hash). Raises ValueError for an unknown codec
    or level."""
    pairs = levels.items() if isinstance(levels, Mapping) else \
        [(level_slot(codec, lv), lv) for lv in levels]
    lc = tuple((parse_level(slv), codec_config_hash(codec, lv, config, base.num_layers)) for slv, lv in pairs)
    return base.replace(codec=codec, codec_version=codec_version(), level_configs=lc,
                        calibration_hash=calibration_hash or "")
