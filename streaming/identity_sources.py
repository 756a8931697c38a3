"""Where the fields of an entry identity come from: a model folder (weights and tokenizer
hashes), a loaded model's info, and the codec (config hashes per level, codec version).

Reads files only and imports the codec lazily (inside the functions), so the identity
record (streaming.identity_entry) stays free of both. Also importable from
streaming.identity. Not runnable.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from cachegen_common.files import files_sha256
from streaming.identity_entry import TOKENIZER_FILES, EntryIdentity


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


def codec_identity(base: EntryIdentity, codec: str,
                   levels: Iterable[int | None] | Mapping[int, int | None], config: Any = None,
                   calibration_hash: str = "") -> EntryIdentity:
    """`base` (a model identity) plus the codec fields for `codec`.

    levels: the codec levels stored (None = the codec's default level, stored under level
    number 0 as the harness's chunk keys do), or a mapping {stored level number: codec
    level} when the store numbers them otherwise. Each level's full config is hashed for
    base.num_layers (codec.config_hash). Raises ValueError for an unknown codec or level."""
    pairs = levels.items() if isinstance(levels, Mapping) else \
        [(0 if lv is None else int(lv), lv) for lv in levels]
    lc = tuple((int(slv), codec_config_hash(codec, lv, config, base.num_layers)) for slv, lv in pairs)
    return base.replace(codec=codec, codec_version=codec_version(), level_configs=lc,
                        calibration_hash=calibration_hash or "")