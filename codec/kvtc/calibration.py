"""The KVTC calibration artifact: ``KvtcCalibration`` (bases, means, variances, per-level
steps; immutable, content-addressed by sha256), its bytes (``to_bytes`` / ``from_bytes``,
the same bytes as its file: ``save`` / ``load_calibration``) and checks, and the level
defaults (targets, tiers, sinks, default level). The registry a DECODE finds calibrations
in, and the artifacts interface the KV store uses, is codec/kvtc/registry.py.

Untrusted artifacts are never unpickled (safetensors + JSON). Errors: ``CodecError``
(bad artifact).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from ..errors import CodecError
from ..level_table import KVTC_DEFAULT_LEVEL


CALIBRATION_FORMAT = "kvtc-calibration"
CALIBRATION_VERSION = 1
# The artifact's "kvtc" metadata is a flat record with a small provenance object (a few
# KiB, three levels deep); an artifact over these bounds is not one this codec wrote
# (artifacts come back from a shared KV store: untrusted).
MAX_INFO_CHARS = 1 << 20
MAX_INFO_DEPTH = 16
# level -> target bits per coded element (empirical entropy on the calibration data);
# bf16 is 16 bits per element. Chosen on WikiText-2 VALIDATION windows with the default
# calibration (joint basis of the K and V of 2 layers, metric-whitened; docs/codec.md
# 8.8): level 4 (the default) ~21x with about 60% of cachegen level 1's KL and a higher
# top-1, level 5 the near-lossless one (~11x), levels 0-3 ~55x ... ~26x (level 2 ~31x
# sits near cachegen level 1's KL). A calibration made with ``group_layers=0`` (one basis
# per K/V and layer) is ~1.6-2x larger at each target's quality (8.5-8.7).
DEFAULT_LEVEL_TARGETS: dict[int, float] = {0: 0.25, 1: 0.35, 2: 0.45, 3: 0.55, 4: 0.65,
                                           5: 1.25}
# level -> factor on the keys' water level in the default fit (``fit_calibration(
# key_water=)``; per-(K/V, layer) fits only: none by default since the default fit is
# grouped, docs/codec.md 8.7-8.8)
DEFAULT_KEY_WATER: dict[int, float] = {}
DEFAULT_LEVEL = KVTC_DEFAULT_LEVEL      # codec.level_table (torch-free) holds it
DEFAULT_SINK_TOKENS = 4
DEFAULT_RECENT_TOKENS = 0
MAX_Q = 127                      # |quantized coefficient| <= 127: symbols fit in 255 bins
HASH_RE = re.compile(r"^[0-9a-f]{64}$")


# ----------------------------------------------------------------------- calibration
def default_calibration_dir() -> Path:
    """``$CACHEGEN_CACHE/kvtc`` or ``~/.cache/cachegen-harness/kvtc`` (not created)."""
    root = os.environ.get("CACHEGEN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "cachegen-harness")
    return Path(root) / "kvtc"


@dataclass
class KvtcCalibration:
    """A fitted KVTC calibration, the one form it has from the fit to the decode: made by
    ``fit_calibration``, written / read as bytes (``to_bytes`` / ``from_bytes``; a file:
    ``save`` / ``load_calibration``; the KV store keeps the same bytes under cal/<hash>),
    found by a decode in ``codec.kvtc.registry`` by ``hash``. Immutable (the tensors are
    never written to); ``hash`` is set at construction. Shapes (C = H * D):

    mean [2, L, C] float32 (index 0 = K, 1 = V); basis [2, L, C, C] float32, column j of
    basis[kv, l] is component j (orthonormal; variances descending, or with a ``metric``
    variance / water-level weight descending: kept components are a prefix); var [2, L, C]
    float32 (component variances on the calibration data); step [NL, 2, L, C] float32:
    quantization step per level (row order = ``levels``), 0 = component dropped (a
    suffix, by the component order above). ``analysis`` [2, L, C, C] float32 or None:
    the encoder's matrix of a metric-whitened fit (coefficients = (x - mean) @ analysis;
    ``basis`` is then the decoder's synthesis matrix, basis^T analysis = I); None = the
    encoder uses ``basis`` (orthonormal).
    ``key_space``: "pre_rope" (keys are decorrelated with RoPE undone; ``rope_theta``
    > 0) or "post_rope". ``shrink`` [NL, 2, L, C] float32 or None: centroid
    reconstruction offsets (a non-zero q decodes to (|q| - shrink) sign(q) step; None =
    bin middles, artifacts made before it existed). ``rounding``: the encoder's
    quantizer, q = sign(u) floor(|u| + rounding) (0.5 = nearest). ``meta``: free-form provenance (model, weights hash, data,
    tokens). ``hash``: sha256 hex of the canonical content (``content_hash``).

    ``group_layers`` = G > 0 (kvtc format 4, a joint transform, docs/codec.md 8.8): the
    K and V of G consecutive layers share ONE basis. Group g covers layers [gG, min(L,
    (g+1)G)); its feature vector is [K_l, V_l for each layer l of the group] (C each,
    keys pre-RoPE when ``key_space`` says so), Cg = 2 G C wide (a last, shorter group is
    zero-padded: padded features have zero variance and are never kept). The tensors are
    then mean [NG, Cg], basis / analysis [NG, Cg, Cg], var [NG, Cg], step [NL, NG, Cg]
    with NG = ceil(L / G). 0 = one basis per (K/V, layer), the shapes above.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    mean: np.ndarray
    basis: np.ndarray
    var: np.ndarray
    step: np.ndarray
    levels: tuple
    targets: tuple
    default_level: int = DEFAULT_LEVEL
    key_space: str = "post_rope"
    rope_theta: float = 0.0
    per_head: bool = False
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int = DEFAULT_RECENT_TOKENS
    meta: dict = field(default_factory=dict)
    shrink: Optional[np.ndarray] = None
    rounding: float = 0.5
    analysis: Optional[np.ndarray] = None
    group_layers: int = 0
    hash: str = ""
    _torch: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hash", self.content_hash())
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value) -> None:
        """Immutable once made: the hash names the content (setting ``hash`` to the value
        it already has is allowed, for callers written when it was set by hand)."""
        if self.__dict__.get("_sealed") and not (name == "hash" and value == self.hash):
            raise AttributeError(f"KvtcCalibration is immutable (setting {name!r})")
        object.__setattr__(self, name, value)

    # ---- identity ------------------------------------------------------------------
    def _header_meta(self) -> dict:
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
                "num_layers": self.num_layers, "num_heads": self.num_heads,
                "head_dim": self.head_dim, "levels": list(self.levels),
                "targets": list(self.targets), "default_level": self.default_level,
                "key_space": self.key_space, "rope_theta": float(self.rope_theta),
                "per_head": bool(self.per_head), "sink_tokens": self.sink_tokens,
                "recent_tokens": self.recent_tokens, "meta": self.meta,
                # only when not the default: artifacts made before these existed keep
                # their hash
                **({"rounding": float(self.rounding)} if self.rounding != 0.5 else {}),
                **({"group_layers": int(self.group_layers)} if self.group_layers else {})}

    def tensors(self) -> dict[str, np.ndarray]:
        t = {"mean": self.mean, "basis": self.basis, "var": self.var, "step": self.step}
        if self.shrink is not None:
            t["shrink"] = self.shrink
        if self.analysis is not None:
            t["analysis"] = self.analysis
        return t

    def content_hash(self) -> str:
        """sha256 hex over the canonical JSON of the parameters and the little-endian
        bytes of each tensor (name, dtype, shape, data; names sorted)."""
        h = hashlib.sha256()
        h.update(json.dumps(self._header_meta(), sort_keys=True).encode())
        for name, a in sorted(self.tensors().items()):
            a = np.ascontiguousarray(a, dtype="<f4")
            h.update(f"\0{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    @property
    def C(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_groups(self) -> int:
        """NG = ceil(L / group_layers) (0 for an ungrouped calibration)."""
        G = self.group_layers
        return -(-self.num_layers // G) if G else 0

    def group_layer_ids(self, g: int) -> range:
        """The layers of group ``g`` (grouped calibrations)."""
        G = self.group_layers
        return range(g * G, min(self.num_layers, (g + 1) * G))

    def n_keep(self, level: int) -> np.ndarray:
        """int [2, L] (ungrouped) or [NG] (grouped): components kept per (K/V, layer)
        or per layer group at ``level``."""
        return (self.step[self.levels.index(level)] > 0).sum(-1)

    def describe(self) -> dict:
        return {"calibration": self.hash, "key_space": self.key_space,
                "per_head": self.per_head, "levels": list(self.levels),
                "targets_bits_per_element": list(self.targets)}

    def torch_params(self, level: int) -> dict:
        """Cached float32 torch tensors for ``level``: mean [2, L, 1, C], basis
        [2, L, C, n] (the ENCODER's matrix: ``analysis`` when the calibration has one, else
        ``basis``; n = max kept components; columns beyond a layer's own count are
        zero), step [2, L, 1, n] (1 where dropped), basis_ts [2, L, n, C] (the synthesis
        ``basis`` scaled by the steps, for decode), colsum [2, L, C] (its column sums),
        n (int), keep (kept components per [K/V][layer]); the decoder adds bf16 copies
        ``basis_ts_bf16`` / ``mean_bf16`` on first use (``inverse.inverse_layers``)."""
        if level not in self._torch and self.group_layers:
            self._torch[level] = self._grouped_params(level)
        if level not in self._torch:
            i = self.levels.index(level)
            keep = self.n_keep(level)
            n = max(1, int(keep.max()))
            basis = torch.from_numpy(np.array(self.basis[:, :, :, :n], np.float32))
            step = np.array(self.step[i][:, :, :n], np.float32)
            mask = step > 0
            basis = basis * torch.from_numpy(mask)[:, :, None, :]
            step[~mask] = 1.0
            # encode: the analysis matrix (= basis when orthonormal; its inverse-transpose
            # for a metric-whitened calibration)
            enc = basis if self.analysis is None else torch.from_numpy(
                np.array(self.analysis[:, :, :, :n], np.float32)) * \
                torch.from_numpy(mask)[:, :, None, :]
            self._torch[level] = {
                "mean": torch.from_numpy(np.array(self.mean, np.float32))[:, :, None, :],
                "basis": enc.contiguous(),
                "basis_t": basis.transpose(-1, -2).contiguous(),
                "step": torch.from_numpy(step)[:, :, None, :], "n": n,
                # decode: step folded into the inverse basis, [2, L, n, C], and its
                # column sums [2, L, C] (the per-layer symbol offset enters as a bias)
                "basis_ts": (basis * torch.from_numpy(step)[:, :, None, :]
                             ).transpose(-1, -2).contiguous(),
                "keep": [[int(x) for x in row] for row in keep],
                # centroid offsets [2, L, 1, n] (None: bin middles)
                "shrink": None if self.shrink is None else torch.from_numpy(
                    np.where(mask, np.array(self.shrink[i][:, :, :n], np.float32), 0.0
                             ).astype(np.float32))[:, :, None, :].contiguous()}
            self._torch[level]["colsum"] = self._torch[level]["basis_ts"].sum(dim=2)
        return self._torch[level]

    def _grouped_params(self, level: int) -> dict:
        """``torch_params`` of a grouped calibration: mean [NG, 1, Cg], basis (the
        encoder's matrix) [NG, Cg, n], step [NG, 1, n] (1 where dropped), basis_ts [NG, n,
        Cg] (synthesis x step), colsum [NG, Cg], n, keep = [[kept per group], []] (the
        kept layout's column counts: one list, no second K/V list)."""
        i = self.levels.index(level)
        keep = self.n_keep(level)
        n = max(1, int(keep.max()))
        step = np.array(self.step[i][:, :n], np.float32)
        mask = torch.from_numpy(step > 0)[:, None, :]
        basis = torch.from_numpy(np.array(self.basis[:, :, :n], np.float32)) * mask
        enc = basis if self.analysis is None else torch.from_numpy(
            np.array(self.analysis[:, :, :n], np.float32)) * mask
        step[step <= 0] = 1.0
        bts = (basis * torch.from_numpy(step)[:, None, :]).transpose(-1, -2).contiguous()
        return {"mean": torch.from_numpy(np.array(self.mean, np.float32))[:, None, :],
                "basis": enc.contiguous(), "step": torch.from_numpy(step)[:, None, :],
                "n": n, "basis_ts": bts, "colsum": bts.sum(dim=1),
                "keep": [[int(x) for x in keep], []], "shrink": None}

    # ---- bytes and file ----------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The artifact: safetensors (float32 tensors) with the JSON parameters and the
        hash as metadata; ``from_bytes`` reads it back (no pickle)."""
        from safetensors.numpy import save

        md = {"kvtc": json.dumps(self._header_meta(), sort_keys=True), "hash": self.hash}
        return save({k: np.ascontiguousarray(v, np.float32) for k, v in self.tensors().items()},
                    metadata=md)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "(bytes)") -> "KvtcCalibration":
        """Read and verify an artifact (``to_bytes``' form; untrusted: format, version,
        shapes, finiteness, recorded hash = content hash; never unpickled). ``where``
        names the source in errors. Raises CodecError."""
        return _from_bytes(data, where)

    def save(self, out: Union[str, os.PathLike]) -> Path:
        """Write ``to_bytes()`` to a file. ``out``: a file path, or an existing folder (the
        file is then ``<folder>/<hash>.safetensors``). Atomic (temp file + rename).
        Returns the path."""
        p = Path(out)
        if p.is_dir():
            p = p / f"{self.hash}.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, p)
        return p


def _nesting(value) -> int:
    """Nesting depth of a parsed JSON value (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def load_calibration(path: Union[str, os.PathLike]) -> KvtcCalibration:
    """Read and verify a calibration artifact file (``KvtcCalibration.from_bytes`` of its
    bytes). Raises CodecError if the file is missing, not a KVTC calibration, of another
    version, inconsistent, or its content does not match its recorded hash."""
    p = Path(path)
    if not p.is_file():
        raise CodecError(f"KVTC calibration file not found: {p}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CodecError(f"cannot read KVTC calibration {p}: {e}") from None
    return _from_bytes(data, str(p))


def _safetensors_metadata(data: bytes) -> dict:
    """The ``__metadata__`` dict of safetensors bytes (header: u64 little-endian length,
    then JSON). Raises ValueError on a malformed header."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(f"header of {n} bytes exceeds the data")
    head = json.loads(bytes(data[8:8 + n]))
    md = head.get("__metadata__", {}) if isinstance(head, dict) else None
    if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
        raise ValueError("metadata is not a string map")
    return md


def _from_bytes(data: bytes, where: str) -> KvtcCalibration:
    """``KvtcCalibration.from_bytes``. Raises CodecError."""
    from safetensors.numpy import load

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"{where}: calibration data must be bytes, got {type(data).__name__}")
    try:
        md = _safetensors_metadata(data)
        t = load(bytes(data))
        raw_info = md.get("kvtc", "null")
        if len(raw_info) > MAX_INFO_CHARS:
            raise CodecError(f"{where}: calibration metadata of {len(raw_info)} characters, over "
                             f"the limit of {MAX_INFO_CHARS} (not an artifact this codec wrote)")
        info = json.loads(raw_info)
        if _nesting(info) > MAX_INFO_DEPTH:
            raise CodecError(f"{where}: calibration metadata nested more than {MAX_INFO_DEPTH} "
                             f"levels deep")
    except CodecError:
        raise
    except RecursionError:   # JSON nested deeper than the interpreter allows: hostile bytes
        raise CodecError(f"cannot read KVTC calibration {where}: metadata nested too deeply"
                         ) from None
    except Exception as e:   # safetensors/JSON parse errors of damaged bytes
        raise CodecError(f"cannot read KVTC calibration {where}: {type(e).__name__}: {e}"
                         ) from None
    if not isinstance(info, dict) or info.get("format") != CALIBRATION_FORMAT:
        raise CodecError(f"{where} is not a KVTC calibration artifact")
    if info.get("version") != CALIBRATION_VERSION:
        raise CodecError(f"{where}: calibration version {info.get('version')!r}, this codec "
                         f"reads version {CALIBRATION_VERSION}")
    try:
        L, H, D = int(info["num_layers"]), int(info["num_heads"]), int(info["head_dim"])
        levels = tuple(int(x) for x in info["levels"])
        cal = KvtcCalibration(
            L, H, D, t["mean"], t["basis"], t["var"], t["step"], levels,
            tuple(float(x) for x in info["targets"]), int(info["default_level"]),
            str(info["key_space"]), float(info["rope_theta"]), bool(info["per_head"]),
            int(info["sink_tokens"]), int(info["recent_tokens"]), dict(info["meta"]),
            shrink=t.get("shrink"), rounding=float(info.get("rounding", 0.5)),
            analysis=t.get("analysis"), group_layers=int(info.get("group_layers", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError(f"{where}: malformed KVTC calibration ({type(e).__name__}: {e})") from None
    check_calibration(cal, where)
    if md.get("hash") != cal.hash:
        raise CodecError(f"{where}: content hash {cal.hash[:16]}... does not match the "
                         f"recorded {str(md.get('hash'))[:16]}... (damaged file)")
    return cal


def check_calibration(cal: KvtcCalibration, where: str) -> None:
    L, C, NL = cal.num_layers, cal.C, len(cal.levels)
    G = cal.group_layers
    if isinstance(G, bool) or not isinstance(G, int) or G < 0 or (G and G > max(1, L)):
        raise CodecError(f"{where}: group_layers {G!r} must be 0 or in [1, {L}]")
    if G and (cal.shrink is not None or cal.per_head):
        raise CodecError(f"{where}: a grouped calibration has no centroid offsets and no "
                         f"per-head bases")
    if G:
        NG, Cg = cal.num_groups, 2 * G * C
        want = {"mean": (NG, Cg), "basis": (NG, Cg, Cg), "var": (NG, Cg),
                "step": (NL, NG, Cg)}
        if cal.analysis is not None:
            want["analysis"] = (NG, Cg, Cg)
    else:
        want = {"mean": (2, L, C), "basis": (2, L, C, C), "var": (2, L, C),
                "step": (NL, 2, L, C)}
    if cal.shrink is not None:
        want["shrink"] = (NL, 2, L, C)
    if cal.analysis is not None and not G:
        want["analysis"] = (2, L, C, C)
    for name, shape in want.items():
        a = getattr(cal, name)
        if not isinstance(a, np.ndarray) or a.shape != shape:
            raise CodecError(f"{where}: calibration tensor {name!r} has shape "
                             f"{getattr(a, 'shape', None)}, expected {shape}")
        if not np.isfinite(a).all():
            raise CodecError(f"{where}: calibration tensor {name!r} is not finite")
    if min(L, cal.num_heads, cal.head_dim) < 1 or NL < 1 or len(cal.targets) != NL \
            or len(set(cal.levels)) != NL or cal.default_level not in cal.levels:
        raise CodecError(f"{where}: calibration dimensions or levels are invalid")
    if cal.key_space not in ("pre_rope", "post_rope") or \
            (cal.key_space == "pre_rope" and (cal.rope_theta <= 0 or cal.head_dim % 2)):
        raise CodecError(f"{where}: bad key_space {cal.key_space!r} / rope_theta "
                         f"{cal.rope_theta}")
    if cal.shrink is not None and ((cal.shrink < 0).any() or (cal.shrink > 0.5).any()):
        raise CodecError(f"{where}: centroid offsets outside [0, 0.5]")
    if not 0.0 < cal.rounding <= 0.5:
        raise CodecError(f"{where}: rounding {cal.rounding} outside (0, 0.5]")
    if (cal.step < 0).any() or cal.sink_tokens < 0 or cal.recent_tokens < 0:
        raise CodecError(f"{where}: negative steps or token counts")


# Tail tiers (kvtc format 3, docs/codec.md 8.7): the last R1 tokens of a context coded at
# level B1, the R2 before them at level B2, ...; the rest at the chunk's level. The value
# error of a context token reaches the output weighted by the attention it gets, and the
# last few hundred tokens get most of it (docs/codec.md 8.6), so coding them finer lowers
# the KL at equal bytes. level -> ((R1, B1), (R2, B2), ...), from the end of the context.
# None by default since the grouped calibration (docs/codec.md 8.8): its untiered levels
# are simpler and robust to where the question sits; a caller may still pass
# ``KvtcConfig(tiers=...)`` (e.g. ((64, 5), (320, 4)), once measured as level 3).
DEFAULT_LEVEL_TIERS: dict[int, tuple] = {}
# level -> exact attention-sink tokens when the config does not say (levels not named: the
# calibration's ``sink_tokens``)
DEFAULT_LEVEL_SINKS: dict[int, int] = {}


def level_tiers(level: Optional[int]) -> tuple:
    """The tail tiers of a kvtc level (``DEFAULT_LEVEL_TIERS``; () = untiered)."""
    return tuple(DEFAULT_LEVEL_TIERS.get(DEFAULT_LEVEL if level is None else level, ()))
