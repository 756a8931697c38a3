"""The identity record of a stored KV entry (`EntryIdentity`): what made its bytes.

The dataclass itself - its fields, validation, JSON form and key material (fingerprint,
codec tag). Apart from the check every reader runs (streaming.identity_check) and from
the helpers that compute an identity from a model folder or a codec
(streaming.identity_sources), so that the record, its comparison and its sources can each
be read alone. Public names are also importable from streaming.identity. Not runnable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

IDENTITY_FORMAT = "cgh-identity-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json")
_STR_FIELDS = ("model_id", "weights_hash", "tokenizer_hash", "dtype", "config_hash", "codec",
               "codec_version", "calibration_hash", "kv_layout")
# strings checked for type only (kv_config is compared through config_hash; partition always
# compared, "" included: see streaming.identity_check)
_OTHER_STR_FIELDS = ("kv_config", "partition")
# left out of the JSON form (hence of the key) when empty: identities without them keep
# their keys
_OMIT_EMPTY = ("kv_layout", "kv_config", "config_hash", "partition")
_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim")
# fields that do not enter codec_tag(): model_id and weights_hash enter the key directly
_KEYED_APART = ("model_id", "weights_hash")


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
    calibration_hash: hash of a calibration artifact the codec used (e.g. kvtc), or "";
    several joined by "+" when each layer group has its own (sliding-window storage:
    ``calibration_hashes``).
    kv_layout: "" = the full layout (every layer every token); else the sliding-window
    layout's tag (``codec.window.layout_tag``: which tokens each layer keeps). Left out
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
    level_configs: tuple[tuple[int, str], ...] = field(default=())
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
            pairs = tuple(sorted((int(lv), str(h)) for lv, h in (lc or ())))
        except (TypeError, ValueError) as e:
            raise ValueError(f"level_configs must be (level, config hash) pairs: {e}") from None
        if len({lv for lv, _ in pairs}) != len(pairs):
            raise ValueError("level_configs lists a level twice")
        object.__setattr__(self, "level_configs", pairs)
        if self.kv_config:
            from cachegen_common.kv_config import kv_config_hash

            h = kv_config_hash(self.kv_config)
            if self.config_hash and self.config_hash != h:
                raise ValueError("config_hash does not match kv_config")
            object.__setattr__(self, "config_hash", h)

    # ----------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        """JSON-able dict (level_configs as {"level": hash}), with the format tag."""
        d = asdict(self)
        d["level_configs"] = {str(lv): h for lv, h in self.level_configs}
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
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **kw) -> "EntryIdentity":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        return EntryIdentity(**d)

    def calibration_hashes(self) -> tuple[str, ...]:
        """The calibration artifacts the entry needs (``calibration_hash`` split at "+")."""
        return tuple(h for h in self.calibration_hash.split("+") if h)

    @property
    def levels(self) -> tuple[int, ...]:
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

