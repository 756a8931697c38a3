"""KV dumps: one safetensors file per context holding K, V and metadata.

Tensors ``k`` and ``v``, each ``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the
model's own dtype; string metadata with the model id and weights hash, dtype, layer/head
counts, the token ids and their sha256, the prompt name, plus ``kv_sha256`` (sha256 of the
raw bytes of k then v) so that a corrupted file is detected on load. safetensors stores no
code, so loading a dump never executes anything. Files are written under a temporary name
and renamed (atomic on POSIX), so a half-written dump never exists.

Written by ``python -m kv_extraction_hf ... --out DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from cachegen_common.bounded_json import int_list, parse
from kv_extraction_hf.errors import ExtractionError

DUMP_FORMAT = "cachegen-harness-kv"
DUMP_VERSION = "1"

# Bounds of the JSON lists a dump's metadata holds. A token id list is written without
# spaces or with ", " (json.dumps), a vocabulary id has at most 7 digits: 10 bytes per
# token; 32 allows any spacing a hand edit adds. Other lists (question, continuation,
# answers) are short; 1 MiB is far above any prompt the harness builds.
BYTES_PER_TOKEN = 32
MAX_LIST_FIELD_BYTES = 1 << 20
MAX_TOKEN_ID = 2**31 - 1


def token_ids_sha256(token_ids) -> str:
    """sha256 (hex) of token ids written as a JSON list without spaces, e.g. ``[1,2,3]``."""
    return hashlib.sha256(json.dumps([int(t) for t in token_ids], separators=(",", ":")).encode()).hexdigest()


def kv_sha256(k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 (hex) of the raw bytes of ``k`` then ``v`` (their storage dtype, C order)."""
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _share_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges overlap inside one storage (same tensor, views of
    one buffer, overlapping slices)."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.data_ptr() != sb.data_ptr():
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def save_kv(path: str | os.PathLike, k: torch.Tensor, v: torch.Tensor, metadata: dict | None = None) -> Path:
    """Write ``k`` and ``v`` (each ``[L, T, H_kv, D]``, same shape and dtype) to ``path``.

    ``metadata`` values are stored as strings (non-strings are JSON-encoded). If it holds
    ``token_ids`` (list or JSON string), their sha256 is added as ``token_ids_sha256``.
    Atomic: a temporary file in the same folder is renamed over ``path``. ``k`` and ``v``
    may share storage (the same tensor, views of one buffer, overlapping slices): ``v`` is
    then written from its own copy. Raises ExtractionError for mismatched tensors,
    metadata that is not JSON-serialisable, or a tensor safetensors refuses.
    """
    from safetensors.torch import save_file

    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ExtractionError("k and v must be torch tensors")
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ExtractionError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must both be "
                              "[num_layers, num_tokens, num_kv_heads, head_dim] of one dtype")
    k = k.detach().cpu().contiguous()
    v = v.detach().cpu().contiguous()
    if k.numel() and v.numel() and _share_storage(k, v):
        # the same tensor twice, two views of one buffer, overlapping slices (
        # kind of safetensors #202: it refuses tensors that share memory): V gets its own copy
        v = v.clone()
    try:
        meta = {key: val if isinstance(val, str) else json.dumps(val)
                for key, val in (metadata or {}).items()}
    except (TypeError, ValueError) as exc:
        raise ExtractionError(f"KV dump metadata is not JSON-serialisable: {exc}") from exc
    if "token_ids" in meta:
        ids = metadata_ids(meta, "token_ids", max_len=k.shape[1], what=f"KV dump metadata for {path}: token_ids")
        meta["token_ids_sha256"] = token_ids_sha256(ids)
    meta.update({
        "format": DUMP_FORMAT, "format_version": DUMP_VERSION, "dtype": str(k.dtype).replace("torch.", ""),
        "num_layers": str(k.shape[0]), "num_tokens": str(k.shape[1]), "num_kv_heads": str(k.shape[2]),
        "head_dim": str(k.shape[3]), "kv_sha256": kv_sha256(k, v),
    })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file({"k": k, "v": v}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except (RuntimeError, ValueError, TypeError) as exc:  # safetensors' refusals, one line
        raise ExtractionError(f"cannot write KV dump {path}: {' '.join(str(exc).split())[:200]}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_kv(path: str | os.PathLike, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, str]]:
    """Read a dump written by :func:`save_kv`: returns ``(k, v, metadata)``.

    Checks that the file exists and parses, holds ``k`` and ``v`` of equal 4-D shape and one
    dtype agreeing with the metadata, and (``verify=True``) that the tensor bytes and token
    ids match their recorded sha256. Raises ExtractionError otherwise.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ExtractionError(f"KV dump not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            names = set(fh.keys())
            if names != {"k", "v"}:
                raise ExtractionError(f"KV dump {path} holds tensors {sorted(names)}, expected ['k', 'v']")
            k = fh.get_tensor("k")
            v = fh.get_tensor("v")
    except ExtractionError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad files
        raise ExtractionError(f"corrupt KV dump {path}: {' '.join(str(exc).split())[:200]}") from exc
    if meta.get("format") != DUMP_FORMAT:
        raise ExtractionError(f"{path} is not a KV dump of this harness (format={meta.get('format')!r})")
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ExtractionError(f"corrupt KV dump {path}: k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}")
    expected = [meta.get(f) for f in ("num_layers", "num_tokens", "num_kv_heads", "head_dim")]
    if expected != [str(n) for n in k.shape] or meta.get("dtype") != str(k.dtype).replace("torch.", ""):
        raise ExtractionError(f"corrupt KV dump {path}: tensors {tuple(k.shape)} {k.dtype} disagree with metadata")
    ids = metadata_ids(meta, "token_ids", path, max_len=k.shape[1])
    if verify:
        if meta.get("kv_sha256") != kv_sha256(k, v):
            raise ExtractionError(f"corrupt KV dump {path}: tensor bytes do not match kv_sha256")
        if ids is not None and (token_ids_sha256(ids) != meta.get("token_ids_sha256") or len(ids) != k.shape[1]):
            raise ExtractionError(f"corrupt KV dump {path}: token_ids do not match the KV")
    return k, v, meta


def metadata_ids(meta: dict[str, str], field: str, path: str | os.PathLike = "?",
                 max_len: int | None = None, what: str | None = None) -> list[int] | None:
    """The token ids a dump's metadata ``field`` holds (``token_ids``, ``question_ids``,
    ``continuation_ids``) as a list of int, or None when the field is absent.

    The field is untrusted text: it must be a flat JSON array of at most ``max_len``
    integers in ``[0, 2**31 - 1]`` (``max_len`` None: bounded by size alone), at most
    ``BYTES_PER_TOKEN`` bytes per entry. Raises ExtractionError (one line naming the file
    and field) for text over the size bound, nested deeper than a flat list, not JSON,
    or holding anything but integers in range. ``what`` replaces the message's default
    head, "corrupt KV dump PATH: FIELD".
    """
    text = meta.get(field)
    if text is None:
        return None
    what = what or f"corrupt KV dump {path}: {field}"
    limit = MAX_LIST_FIELD_BYTES if max_len is None else BYTES_PER_TOKEN * max_len + 64
    value = parse(text, what=what, max_bytes=limit, max_depth=1, error=ExtractionError)
    return int_list(value, what=what, max_len=limit if max_len is None else max_len,
                    hi=MAX_TOKEN_ID, error=ExtractionError)


def metadata_strings(meta: dict[str, str], field: str, path: str | os.PathLike = "?") -> list[str]:
    """A dump's metadata ``field`` holding a JSON array of strings (``answers``); [] when
    absent. Raises ExtractionError for text over 1 MiB, nested, not JSON or not strings."""
    text = meta.get(field)
    if text is None:
        return []
    what = f"corrupt KV dump {path}: {field}"
    value = parse(text, what=what, max_bytes=MAX_LIST_FIELD_BYTES, max_depth=1, expect=list,
                  error=ExtractionError)
    if not all(isinstance(x, str) for x in value):
        raise ExtractionError(f"{what}: expected a JSON array of strings")
    return value
