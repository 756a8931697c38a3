"""KVTC: transform coding of the KV cache (decorrelate, allocate bits, entropy-code).

Implements the transform-coding KV codec of Staniszewski et al., "KV Cache Transform
Coding for Compact Storage in LLM Inference" (arXiv 2511.01815, 2025), sections 3.1-3.3,
with this project's rANS coder and probability model as the entropy stage:

1. Decorrelation: per layer and per K/V, an orthonormal PCA basis of the H*D features
   (all KV heads of the layer together; block-diagonal per-head bases are a fitting
   option) and a mean, learned once on calibration text (``fit_calibration``). Keys can be
   decorrelated BEFORE rotary position embedding: the encoder undoes RoPE (rotate-half
   convention, the calibration's ``rope_theta``) at the token's absolute position and the
   decoder redoes it, so the codec stays model-free (docs/codec.md section "KVTC").
2. Bit allocation: reverse water-filling over the component variances (Cover & Thomas,
   Elements of Information Theory, 2nd ed., theorem 10.3.3): per (K/V, layer) a water
   level theta; components with variance <= theta get zero bits and are dropped, the
   others are quantized uniformly with the same step sqrt(12 theta) (entropy-coded
   uniform scalar quantization has equal-step optimal allocation at high rate). Each
   level's theta scale is solved on the calibration data so that the measured empirical
   entropy meets the level's target bits per element. With a distortion metric (how the
   model uses K and V: the query energy along each key channel, the output projection's
   gain for values; ``fit_calibration(metric=, whiten=True)``, docs/codec.md 8.5) the PCA
   and the water-filling run in the metric-whitened space (x S, S = M^(1/2) per head), so
   the allocation minimises the error the model sees rather than the plain MSE; the
   artifact then holds the encoder's ``analysis`` matrix S U beside the decoder's
   ``basis`` S^-1 U.
   Joint transform over layer groups (kvtc format 4, the default calibration; this
   project's addition, docs/codec.md 8.8): with ``group_layers`` = G the K and V of G
   consecutive layers share ONE basis (each (K/V, layer) block whitened by its metric
   and scaled by its water-level weight, the blocks concatenated, one PCA per group and
   one water level for all): K, V and neighbouring layers are all projections of the
   same residual stream, and the joint basis codes what they share once (the idea of
   cross-layer SVD, Chang et al., "xKV: Cross-Layer SVD for KV-Cache Compression",
   arXiv 2503.18893, 2025, here with bit allocation and entropy coding). On the default
   model it roughly halves the weighted error at equal bytes.
3. Entropy coding: the quantized coefficients of each (K/V, layer)'s kept components
   only (the "kept" column layout, kvtc format 2: all of them concatenated, split into
   two halves) go through ``codec.entropy.encode_symbols`` (per-column models clustered
   into a codebook, 32-bit rANS; docs/bitstream.md sections 1-4 and 4.5) - the same
   coder as cachegen. The older padded layout (every layer at the largest kept width)
   is still decoded. A grouped calibration codes each group's kept columns the same way
   (layout "grouped", one symbol offset per group).
4. The first ``sink_tokens`` tokens of the context (attention sinks) and optionally the
   last ``recent_tokens`` are stored exactly, as KVTC and CacheGen's variant do.
5. Tail tiers (kvtc format 3; this project's addition, docs/codec.md 8.6-8.7): a level
   may code the last R1 (R1 + R2, ...) tokens of the context at finer levels B1 (B2, ...)
   (``DEFAULT_LEVEL_TIERS``, ``KvtcConfig.tiers``): the value error of a token reaches
   the output weighted by the attention it gets, and the last few hundred tokens get
   most of it. The encoder knows each chunk's absolute position (``token_offset``,
   ``total_tokens``); the tail rows are coded as spans of the same container, each with
   its own kept-layout fields and entropy tables, named in the header.

The calibration (bases, means, variances, per-level allocation) is a versioned
safetensors artifact named by the sha256 of its content (``KvtcCalibration.hash``). The
bitstream header names that hash. An ENCODE is given its calibration explicitly
(``KvtcConfig(calibration=...)``: the object, an artifact path or a hash; the
documented default for a model is ``kv_extraction_hf.calibrate.default_calibration``,
resolved once by the caller that owns the model); there is no implicit choice. A
DECODE finds the calibration by the hash its chunk names (content-addressed): among
those registered with ``register_calibration`` (or used by an encode in this process),
else in the cache folder (``$CACHEGEN_CACHE`` or
``~/.cache/cachegen-harness``)/kvtc/<hash>.safetensors, and raises CodecError naming the
hash otherwise.

    from codec import kvtc
    cal = kvtc.fit_calibration(k_samples, v_samples)          # [L, N, H, D] each
    path = cal.save(kvtc.default_calibration_dir())           # <dir>/<hash>.safetensors
    data = codec.encode_kv(k, v, codec="kvtc", level=2,
                           config=kvtc.KvtcConfig(calibration=cal))
    k2, v2 = codec.decode_kv(data)                            # finds it by its hash

Make a calibration for a model: python -m kv_extraction_hf.calibrate --model default --out FILE
Run the tests: .venv/bin/python -m pytest tests/test_codec_kvtc.py -q
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from . import scratch as _scratch
from .errors import CodecError

__all__ = ["KvtcCalibration", "KvtcConfig", "KvtcCodec", "fit_calibration",
           "register_calibration", "registered_calibrations", "get_calibration",
           "load_calibration", "default_calibration_dir", "apply_rope", "undo_rope",
           "CALIBRATION_FORMAT", "CALIBRATION_VERSION", "DEFAULT_LEVEL_TARGETS",
           "DEFAULT_LEVEL_TIERS", "DEFAULT_LEVEL_SINKS", "DEFAULT_KEY_WATER",
           "KVTC_FORMAT_VERSION", "KVTC_TIERED_FORMAT",
           "check_tiers", "level_tiers"]

CALIBRATION_FORMAT = "kvtc-calibration"
CALIBRATION_VERSION = 1
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
DEFAULT_LEVEL = 4
DEFAULT_SINK_TOKENS = 4
DEFAULT_RECENT_TOKENS = 0
MAX_Q = 127                      # |quantized coefficient| <= 127: symbols fit in 255 bins
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_RATE_SAMPLE_TOKENS = 1024       # calibration tokens used to solve the per-level scale


# ------------------------------------------------------------------------------ RoPE
def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [T, 1, D] of the rotate-half RoPE (Su et al., RoFormer, 2021, eq.
    34; the layout of HF transformers' LlamaRotaryEmbedding, computed the same way in
    float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x float32 [L, T, H, D] (D even) by RoPE at ``positions`` int64 [T]
    (same values as ``x * cos + rotate_half(x) * sin``, computed on the two halves)."""
    h = x.shape[-1] // 2
    cos, sin = _rope_cos_sin(positions, 2 * h, theta)
    sin_signed = torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)      # [T, 1, D]
    out = x * cos                        # whole rows at once: contiguous, vectorised
    out.addcmul_(x.roll(h, dims=-1), sin_signed)   # roll = [x2, x1]: rotate_half up to sign
    return out


def undo_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Inverse of ``apply_rope`` (rotation by the negative angle)."""
    cos, sin = _rope_cos_sin(positions, x.shape[-1], theta)
    return x * cos - _rotate_half(x) * sin


# ----------------------------------------------------------------------- calibration
def default_calibration_dir() -> Path:
    """``$CACHEGEN_CACHE/kvtc`` or ``~/.cache/cachegen-harness/kvtc`` (not created)."""
    root = os.environ.get("CACHEGEN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "cachegen-harness")
    return Path(root) / "kvtc"


@dataclass
class KvtcCalibration:
    """A fitted KVTC calibration. Shapes (C = H * D):

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
        ``basis_ts_bf16`` / ``mean_bf16`` on first use (``KvtcCodec._inverse``)."""
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

    # ---- file ----------------------------------------------------------------------
    def save(self, out: Union[str, os.PathLike]) -> Path:
        """Write the artifact. ``out``: a file path, or an existing folder (the file is
        then ``<folder>/<hash>.safetensors``). Atomic (temp file + rename). Returns the
        path."""
        from safetensors.numpy import save_file

        p = Path(out)
        if p.is_dir():
            p = p / f"{self.hash}.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        md = {"kvtc": json.dumps(self._header_meta(), sort_keys=True), "hash": self.hash}
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in self.tensors().items()},
                  str(tmp), metadata=md)
        os.replace(tmp, p)
        return p


def load_calibration(path: Union[str, os.PathLike]) -> KvtcCalibration:
    """Read and verify a calibration artifact (safetensors; no pickle).
    Raises CodecError if the file is missing, not a KVTC calibration, of another version,
    inconsistent, or its content does not match its recorded hash."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise CodecError(f"KVTC calibration file not found: {p}")
    try:
        with safe_open(str(p), framework="numpy") as f:
            md = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
        info = json.loads(md.get("kvtc", "null"))
    except CodecError:
        raise
    except Exception as e:   # safetensors/JSON parse errors of a damaged file
        raise CodecError(f"cannot read KVTC calibration {p}: {type(e).__name__}: {e}") from None
    if not isinstance(info, dict) or info.get("format") != CALIBRATION_FORMAT:
        raise CodecError(f"{p} is not a KVTC calibration artifact")
    if info.get("version") != CALIBRATION_VERSION:
        raise CodecError(f"{p}: calibration version {info.get('version')!r}, this codec "
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
        raise CodecError(f"{p}: malformed KVTC calibration ({type(e).__name__}: {e})") from None
    _check_calibration(cal, str(p))
    cal.hash = cal.content_hash()
    if md.get("hash") != cal.hash:
        raise CodecError(f"{p}: content hash {cal.hash[:16]}... does not match the "
                         f"recorded {str(md.get('hash'))[:16]}... (damaged file)")
    return cal


def _check_calibration(cal: KvtcCalibration, where: str) -> None:
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


# content-addressed registry of loaded calibrations, keyed by hash: where a DECODE finds
# the calibration its chunk names (then the cache folder, ``get_calibration``). An encode
# never picks one from here: it is given its calibration (``KvtcConfig.calibration``).
_CALIBRATIONS: dict[str, KvtcCalibration] = {}
_LOCK = threading.Lock()


def register_calibration(cal: Union[KvtcCalibration, str, os.PathLike]) -> str:
    """Make a calibration (object or artifact path) available, by its hash, to the decode
    of the chunks that name it (``get_calibration``); returns its hash. It does not make
    it an encoder's default (an encode names its calibration:
    ``KvtcConfig(calibration=...)``). Raises CodecError for an unreadable artifact."""
    if not isinstance(cal, KvtcCalibration):
        cal = load_calibration(cal)
    if not cal.hash:
        cal.hash = cal.content_hash()
    with _LOCK:
        _CALIBRATIONS.pop(cal.hash, None)
        _CALIBRATIONS[cal.hash] = cal
    return cal.hash


def registered_calibrations() -> list[str]:
    """Hashes of the registered calibrations (registration order; informational only)."""
    with _LOCK:
        return list(_CALIBRATIONS)


def get_calibration(h: str, search_dir: Optional[Union[str, os.PathLike]] = None
                    ) -> KvtcCalibration:
    """The calibration with hash ``h``: a registered one, else
    ``<search_dir or default_calibration_dir()>/<h>.safetensors`` (then registered).
    Raises CodecError naming the hash when it cannot be found or does not verify."""
    if not isinstance(h, str) or not _HASH_RE.match(h):
        raise CodecError(f"invalid KVTC calibration hash {h!r}")
    with _LOCK:
        cal = _CALIBRATIONS.get(h)
    if cal is not None:
        return cal
    folder = Path(search_dir) if search_dir is not None else default_calibration_dir()
    p = folder / f"{h}.safetensors"
    if not p.is_file():
        raise CodecError(
            f"KVTC calibration {h} is needed to decode this data and is not available: "
            f"register it with codec.kvtc.register_calibration(PATH) or place it at {p} "
            f"(make one with: python -m kv_extraction_hf.calibrate)")
    cal = load_calibration(p)
    if cal.hash != h:
        raise CodecError(f"{p} holds calibration {cal.hash}, not {h}")
    register_calibration(cal)
    return cal


# -------------------------------------------------------------------------- fitting
def _pca(x: np.ndarray, per_head: bool, H: int, D: int) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """x float [N, C] -> (mean [C], basis [C, C] orthonormal columns, var [C]) with
    components sorted by variance, descending. per_head: block-diagonal basis."""
    x = x.astype(np.float64)
    mu = x.mean(0)
    xc = x - mu
    C = x.shape[1]
    if per_head:
        basis = np.zeros((C, C))
        var = np.zeros(C)
        for h in range(H):
            s = slice(h * D, (h + 1) * D)
            cov = xc[:, s].T @ xc[:, s] / max(1, len(x))
            w, u = np.linalg.eigh(cov)
            basis[s, s] = u
            var[s] = w
    else:
        cov = xc.T @ xc / max(1, len(x))
        var, basis = np.linalg.eigh(cov)
    order = np.argsort(-var, kind="stable")
    var = np.clip(var[order], 0.0, None)
    basis = basis[:, order]
    # deterministic sign: the largest-magnitude entry of each column is positive
    sign = np.sign(basis[np.abs(basis).argmax(0), np.arange(C)])
    sign[sign == 0] = 1
    return mu, basis * sign, var


def _quantize(u: np.ndarray, rounding: float) -> np.ndarray:
    """q = sign(u) floor(|u| + rounding), clipped to |q| <= MAX_Q (rounding 0.5 = round to
    nearest; smaller = a dead zone around 0). u: coefficients divided by their steps."""
    q = np.floor(np.abs(u) + rounding)
    np.minimum(q, MAX_Q, out=q)
    return np.copysign(q, u)


def _rate_bits(coef: np.ndarray, step: np.ndarray, rounding: float = 0.5) -> float:
    """Empirical entropy (bits) of the quantized coefficients, one histogram per component
    (step 0 = dropped, 0 bits). coef [..., N, C], step [..., C] (leading dims broadcast:
    all (K/V, layer) at once)."""
    keep = step > 0
    if not keep.any():
        return 0.0
    N = coef.shape[-2]
    cf = np.moveaxis(coef, -2, -1)[keep]                    # [n_kept, N]
    u = cf / step[keep][:, None]
    q = _quantize(u, rounding).astype(np.int32) + MAX_Q
    n = q.shape[0]
    q += (2 * MAX_Q + 1) * np.arange(n, dtype=np.int32)[:, None]
    hist = np.bincount(q.ravel(), minlength=n * (2 * MAX_Q + 1)).astype(np.float64)
    nz = hist[hist > 0]
    return float(-(nz * np.log2(nz / N)).sum())


def _shrink(coef: np.ndarray, step: np.ndarray, rounding: float) -> np.ndarray:
    """Centroid reconstruction offsets: for each component, the delta in [0, 0.5] that
    minimises the squared error of reconstructing a non-zero q at (|q| - delta) sign(q)
    step, i.e. delta = mean(|q| - |u|) over the calibration coefficients with q != 0
    (u = coef / step; the conditional mean of a bin, shared by all non-zero bins as for a
    Laplacian source: Sullivan, "Efficient scalar quantization of exponential and
    Laplacian random variables", IEEE Trans. IT 42(5), 1996). coef [..., N, C], step
    [..., C]; returns [..., C] (0 where dropped or never non-zero)."""
    out = np.zeros(step.shape, np.float64)
    keep = step > 0
    if not keep.any():
        return out
    cf = np.moveaxis(coef, -2, -1)[keep]
    u = cf / step[keep][:, None]
    q = _quantize(u, rounding)
    nzm = q != 0
    cnt = nzm.sum(1)
    d = np.where(nzm, np.abs(q) - np.abs(u), 0.0).sum(1) / np.maximum(cnt, 1)
    out[keep] = np.clip(d, 0.0, 0.5)
    return out


def _steps_for(theta: np.ndarray, var: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Reverse water-filling: step sqrt(12 theta) where var > theta, else 0 (dropped);
    never finer than cap (so |q| <= MAX_Q on the calibration data). theta: one water
    level per (K/V, layer) ([2, L]) or per component ([2, L, C], a weighted distortion)."""
    th = theta if theta.ndim == var.ndim else theta[..., None]
    st = np.sqrt(12.0 * th) * np.ones_like(var)
    st = np.maximum(st, cap)
    st[var <= th] = 0.0
    return st


def _metric_gain(basis: np.ndarray, metric: np.ndarray, H: int, D: int) -> np.ndarray:
    """Gain of each component under a per-head distortion metric, normalised to mean 1.

    basis [C, C] (columns = components, C = H * D); metric [H, D, D] symmetric PSD (the
    error e of head h's features costs e^T metric[h] e). Returns float64 [C]:
    m_i = sum_h u_ih^T metric[h] u_ih / (trace(metric) / C), so isotropic (white) error
    has the same cost as without a metric. With independent zero-mean quantization errors
    per component, E[e^T M e] = sum_i E[e_i^2] m_i exactly (the cross terms vanish)."""
    C = H * D
    u = basis.reshape(H, D, C)
    m = np.einsum("hdc,hde,hec->c", u, metric, u)
    tr = float(np.trace(metric, axis1=1, axis2=2).sum()) / C
    return np.maximum(m / max(tr, 1e-30), 0.0)


def _metric_sqrt(metric: np.ndarray, power: float, H: int, D: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(S, S^-1), float64 [C, C] block-diagonal: S_h = (M_h / mean diag M)^(power / 2)
    (symmetric; eigenvalues floored at 1e-3 of the mean so S^-1 stays bounded).
    metric [H, D, D] symmetric PSD."""
    m = np.asarray(metric, np.float64)
    scale = max(float(np.trace(m, axis1=1, axis2=2).sum()) / (H * D), 1e-30)
    C = H * D
    s, si = np.zeros((C, C)), np.zeros((C, C))
    for h in range(H):
        lam, q = np.linalg.eigh(0.5 * (m[h] + m[h].T) / scale)
        lam = np.maximum(lam, 1e-3) ** (power / 2)
        b = slice(h * D, (h + 1) * D)
        s[b, b] = (q * lam) @ q.T
        si[b, b] = (q / lam) @ q.T
    return s, si


def _solve_levels(w: np.ndarray, var: np.ndarray, cap: np.ndarray, coefs: np.ndarray,
                  n_elem: int, targets: dict, kwater: dict, rounding: float, say
                  ) -> np.ndarray:
    """Per-level quantization steps [NL, *var.shape] (levels sorted): the water scale g of
    each level solved so that the empirical entropy of the quantized calibration
    coefficients ``coefs`` [..., N, C'] is the level's target bits per element
    (``n_elem`` coded elements). w: water-level weights (var's shape or one per block,
    var.shape[:-1]); kwater: level -> factor on the keys' weights (w[0]; ungrouped only).
    The rate falls as the water level grows: a coarse log grid brackets each target, then
    regula falsi (Illinois variant) on log g to within 0.2% of the target."""
    def rate(lg: float, kf: float = 1.0) -> tuple[float, np.ndarray]:
        # lg = log of the water scale; kf = the keys' factor (key_water)
        wl = w if kf == 1.0 else np.concatenate([w[:1] * kf, w[1:]])
        st = _steps_for(np.exp(lg) * wl, var, cap)
        return _rate_bits(coefs, st, rounding) / n_elem, st

    levels = sorted(targets)
    steps = np.zeros((len(levels),) + var.shape, np.float64)
    total = n_elem // max(1, coefs.shape[-2])
    grid = np.linspace(np.log(1e-9), np.log(1e2), 12)
    grid_rates: dict = {}
    for i, lv in enumerate(levels):
        tgt = float(targets[lv])
        kf = float(kwater.get(lv, 1.0))
        if kf not in grid_rates:
            grid_rates[kf] = [rate(float(g), kf)[0] for g in grid]
        grid_rate = grid_rates[kf]
        rate_l = functools.partial(rate, kf=kf)
        j = next((j for j, r in enumerate(grid_rate) if r <= tgt), len(grid) - 1)
        a, b = float(grid[max(0, j - 1)]), float(grid[j])
        ra, rb = grid_rate[max(0, j - 1)], grid_rate[j]
        side = 0
        for _ in range(12):
            if not ra > tgt >= rb or abs(rb - tgt) <= 2e-3 * tgt:
                break
            m = b - (rb - tgt) * (b - a) / (rb - ra)
            rm, _ = rate_l(m)
            if rm > tgt:
                a, ra = m, rm
                if side == -1:
                    rb = tgt + (rb - tgt) / 2
                side = -1
            else:
                b, rb = m, rm
                if side == 1:
                    ra = tgt + (ra - tgt) / 2
                side = 1
        r, st = rate_l(b)
        steps[i] = st
        say(f"level {lv}: target {tgt:.3f} bits/element -> {r:.3f} on the calibration "
            f"data, {int((st > 0).sum())} of {total} components kept")
    return steps


def _fit_grouped(k: torch.Tensor, v: torch.Tensor, G: int, targets: dict,
                 default_level: int, weighting: Any, metric: Optional[tuple],
                 metric_power: float, rounding: float, key_space: str, theta_rope: float,
                 sink_tokens: int, recent_tokens: int, meta: dict, say) -> KvtcCalibration:
    """``fit_calibration`` with ``group_layers`` = G (k pre-RoPE already when asked).
    Block b = (K/V, layer): z_b = (x_b - mean_b) S_b / sqrt(w_b), S_b the metric's square
    root (identity without a metric), w_b the block's water-level weight; group g's
    features are its blocks' z side by side ([K_l, V_l] per layer), and one PCA per group
    and ONE water level for all components (the weighted distortion sum_b ||e_b S_b||^2
    / w_b is the plain squared error of z). analysis_g = blockdiag(S_b / sqrt(w_b)) U_g,
    basis_g = blockdiag(S_b^-1 sqrt(w_b)) U_g (basis^T analysis = I)."""
    L, N, H, D = k.shape
    C = H * D
    NG = -(-L // G)
    Cg = 2 * G * C
    mean = np.zeros((NG, Cg))
    var = np.zeros((NG, Cg))
    basis = np.zeros((NG, Cg, Cg))
    analysis = np.zeros((NG, Cg, Cg))
    cap = np.zeros((NG, Cg))
    rng = np.random.default_rng(0)
    sub = np.sort(rng.choice(N, size=min(N, _RATE_SAMPLE_TOKENS), replace=False))
    coefs = np.zeros((NG, len(sub), Cg), np.float32)
    # per-block whitening matrices and centred, whitened features
    sq = np.zeros((2, L, C, C))
    isq = np.zeros((2, L, C, C))
    blk_mean = np.zeros((2, L, C))
    zvar = np.zeros((2, L))
    for kv, x in enumerate((k, v)):
        for layer in range(L):
            if metric is not None:
                sq[kv, layer], isq[kv, layer] = _metric_sqrt(metric[kv][layer],
                                                             float(metric_power), H, D)
            else:
                sq[kv, layer] = isq[kv, layer] = np.eye(C)
            xl = x[layer].reshape(N, C).numpy().astype(np.float64)
            blk_mean[kv, layer] = xl.mean(0)
            zvar[kv, layer] = ((xl - blk_mean[kv, layer]) @ sq[kv, layer]).var(0).mean()
    if isinstance(weighting, np.ndarray):
        w = weighting.astype(np.float64)
    else:
        w = zvar if weighting == "relative" else np.ones((2, L))
    w = np.maximum(w, 1e-30)
    for g in range(NG):
        ls = range(g * G, min(L, (g + 1) * G))
        width = 2 * len(ls) * C
        a = np.zeros((Cg, Cg))          # blockdiag(S_b / sqrt(w_b)), padded
        ai = np.zeros((Cg, Cg))         # its inverse
        z = np.zeros((N, Cg))
        for j, layer in enumerate(ls):
            for kv, x in enumerate((k, v)):
                sl = slice((2 * j + kv) * C, (2 * j + kv + 1) * C)
                a[sl, sl] = sq[kv, layer] / np.sqrt(w[kv, layer])
                ai[sl, sl] = isq[kv, layer] * np.sqrt(w[kv, layer])
                mean[g, sl] = blk_mean[kv, layer]
                xl = x[layer].reshape(N, C).numpy().astype(np.float64)
                z[:, sl] = (xl - blk_mean[kv, layer]) @ a[sl, sl]
        cov = z[:, :width].T @ z[:, :width] / N
        lam, u = np.linalg.eigh(cov)
        order = np.argsort(-lam, kind="stable")
        lam, u = np.clip(lam[order], 0.0, None), u[:, order]
        sign = np.sign(u[np.abs(u).argmax(0), np.arange(width)])
        sign[sign == 0] = 1
        u = u * sign
        var[g, :width] = lam
        analysis[g, :, :width] = a[:, :width] @ u
        basis[g, :, :width] = ai[:, :width] @ u
        cl = z[:, :width] @ u
        cap[g, :width] = np.abs(cl).max(0) * 1.05 / MAX_Q
        coefs[g, :, :width] = cl[sub]
        say(f"PCA group {g + 1}/{NG} (layers {ls.start}-{ls.stop - 1}, {width} features)")
    steps = _solve_levels(np.ones(NG), var, cap, coefs, 2 * L * len(sub) * C, targets, {},
                          rounding, say)
    levels = sorted(targets)
    cal = KvtcCalibration(
        L, H, D, mean.astype(np.float32), basis.astype(np.float32), var.astype(np.float32),
        steps.astype(np.float32), tuple(levels), tuple(float(targets[x]) for x in levels),
        int(default_level), key_space, theta_rope, False, sink_tokens, recent_tokens,
        dict(meta, group_layers=G), shrink=None, rounding=float(rounding),
        analysis=analysis.astype(np.float32), group_layers=G)
    _check_calibration(cal, "fit_calibration")
    cal.hash = cal.content_hash()
    return cal


def fit_calibration(k_samples: torch.Tensor, v_samples: torch.Tensor, *,
                    positions: Optional[torch.Tensor] = None,
                    rope_theta: Optional[float] = None, per_head: bool = False,
                    level_targets: Optional[dict] = None, default_level: int = DEFAULT_LEVEL,
                    weighting: str = "relative", sink_tokens: int = DEFAULT_SINK_TOKENS,
                    recent_tokens: int = DEFAULT_RECENT_TOKENS, meta: Optional[dict] = None,
                    centroid: bool = False, rounding: float = 0.5,
                    metric: Optional[tuple] = None, metric_power: float = 1.0,
                    whiten: bool = False, key_water: Optional[dict] = None,
                    group_layers: int = 0, progress=None) -> KvtcCalibration:
    """Fit a KVTC calibration on sample KV (pure function: no model, no I/O).

    Args:
      k_samples, v_samples: [L, N, H, D] float tensors (N calibration tokens, e.g. several
        prefills concatenated along tokens), keys as the model caches them (after RoPE).
        Attention-sink tokens should be left out (they are stored exactly).
      positions: int64 [N], each sample token's position in its context; needed with
        ``rope_theta``.
      rope_theta: if given (> 0), keys are decorrelated before RoPE (undone here with the
        rotate-half convention at ``positions``; the codec redoes it at decode).
      per_head: block-diagonal bases (one D x D PCA per KV head) instead of one
        (H*D) x (H*D) basis per layer.
      level_targets: level -> target bits per element (default ``DEFAULT_LEVEL_TARGETS``).
      weighting: how the water level is shared across (K/V, layer): "relative" (theta
        proportional to the mean component variance of that (K/V, layer): same relative
        distortion everywhere), "absolute" (one theta for all: least total MSE), or a
        positive float array [2, L] of per-(K/V, layer) water-level weights (e.g. the
        inverse of a measured sensitivity).
      sink_tokens, recent_tokens: tokens kept exact (first / last of a context).
      meta: provenance (JSON-able dict) recorded in the artifact.
      centroid: store centroid reconstruction offsets (``KvtcCalibration.shrink``) so a
        non-zero coefficient decodes at its bin's conditional mean on the calibration data
        instead of the bin middle (False, the default: bin middles, no ``shrink``
        tensor; the centroid lowers the MSE but raised the KL, docs/codec.md 8.3).
      rounding: the encoder's quantizer offset in (0, 0.5]: q = sign(u) floor(|u| +
        rounding); below 0.5 widens the zero bin (a dead zone), the level's rate target is
        met with a finer step.
      metric: optional (metric_k, metric_v), each float [L, H, D, D] symmetric PSD: how
        much an error of each head's K (in the decorrelated key space) or V features
        costs the model, e^T M e (e.g. keys: the query energy per channel, values: the
        output projection's Gram matrix W_o^T W_o over the head's query group; computed
        by ``kv_extraction_hf.calibrate``). Each component's water level is divided by
        its gain u^T M u (normalised to mean 1 per (K/V, layer), ``_metric_gain``), i.e.
        reverse water-filling of the weighted distortion sum_i m_i D_i (Cover & Thomas
        thm 10.3.3 with weighted components). None = plain MSE per (K/V, layer).
      metric_power: the gain is raised to this power (1 = the weighted distortion
        exactly; 0 = no metric).
      whiten: with ``metric``, decorrelate in the metric's space instead: PCA of x S
        with S = blockdiag_h (M_h / mean diag M)^(p/2) (p = ``metric_power``), so the
        quantization MSE there is the weighted distortion e^T M^p e; the stored ``basis``
        is then the synthesis matrix S^-1 U (not orthonormal) and ``analysis`` = S U the
        encoder's (basis^T analysis = I).
      key_water: optional level -> factor (> 0) on the keys' water levels at that level
        (2 = keys coarser, values finer at the same rate; levels not named: 1). The values
        carry ~3/4 of the KL the model sees (docs/codec.md 8.6); recorded in ``meta``.
      group_layers: G > 0 = one joint basis for the K and V of G consecutive layers
        (kvtc format 4, docs/codec.md 8.8): each (K/V, layer) block is whitened by its
        metric (identity without one) and scaled by 1 / sqrt(its water-level weight), the
        blocks of a group are concatenated and one PCA + one water level serve all groups
        (reverse water-filling of the same weighted distortion, but the components may mix
        K and V and neighbouring layers, which share the residual stream). Not with
        ``per_head``, ``centroid``, ``key_water`` or a ``metric`` without ``whiten``.
      progress: optional callable(str) for progress lines.
    Returns: KvtcCalibration (hash set). Source: PCA + reverse water-filling (module doc).
    Raises: ValueError on bad shapes, too few samples or bad options.
    """
    say = progress or (lambda s: None)
    for name, t in (("k_samples", k_samples), ("v_samples", v_samples)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor [L, N, H, D]")
    if k_samples.shape != v_samples.shape:
        raise ValueError(f"k/v sample shapes differ: {tuple(k_samples.shape)} vs "
                         f"{tuple(v_samples.shape)}")
    L, N, H, D = k_samples.shape
    if N < 2:
        raise ValueError(f"need at least 2 calibration tokens, got {N}")
    if not (isinstance(weighting, str) and weighting in ("relative", "absolute")) and \
            not (isinstance(weighting, np.ndarray) and weighting.shape == (2, L)
                 and (weighting > 0).all()):
        raise ValueError(f"weighting must be 'relative', 'absolute' or a positive array "
                         f"[2, L], got {weighting!r}")
    if not (isinstance(rounding, (int, float)) and 0.0 < rounding <= 0.5):
        raise ValueError(f"rounding must be in (0, 0.5], got {rounding!r}")
    if metric is not None:
        if not (isinstance(metric, (tuple, list)) and len(metric) == 2 and all(
                isinstance(m, np.ndarray) and m.shape == (L, H, D, D) and
                np.isfinite(m).all() for m in metric)):
            raise ValueError(f"metric must be a pair of finite arrays [L, H, D, D] = "
                             f"{(L, H, D, D)}")
        if not (isinstance(metric_power, (int, float)) and 0.0 <= metric_power <= 2.0):
            raise ValueError(f"metric_power must be in [0, 2], got {metric_power!r}")
    targets = dict(DEFAULT_LEVEL_TARGETS if level_targets is None else level_targets)
    kwater = dict(key_water or {})
    if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1e6
           or lv not in targets for lv, f in kwater.items()):
        raise ValueError(f"key_water must map levels of the targets to factors > 0, got "
                         f"{key_water!r}")
    if len(targets) < 1 or default_level not in targets or \
            any(not (isinstance(t, (int, float)) and t > 0) for t in targets.values()):
        raise ValueError(f"bad level_targets {targets!r} / default_level {default_level}")
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or \
            not 0 <= group_layers <= L:
        raise ValueError(f"group_layers must be an int in [0, {L}], got {group_layers!r}")
    if group_layers and (per_head or centroid or kwater or
                         (metric is not None and not whiten)):
        raise ValueError("group_layers does not combine with per_head, centroid, "
                         "key_water or a metric without whiten")
    C = H * D
    k = k_samples.detach().to("cpu", torch.float32)
    v = v_samples.detach().to("cpu", torch.float32)
    key_space = "post_rope"
    theta_rope = 0.0
    if rope_theta:
        if positions is None or tuple(positions.shape) != (N,):
            raise ValueError("rope_theta needs positions, an int tensor [N]")
        if D % 2:
            raise ValueError("pre-RoPE decorrelation needs an even head_dim")
        k = undo_rope(k, positions.to(torch.int64), float(rope_theta))
        key_space, theta_rope = "pre_rope", float(rope_theta)
    if group_layers:
        return _fit_grouped(
            k, v, group_layers, targets, default_level, weighting, metric, metric_power,
            rounding, key_space, theta_rope, int(sink_tokens), int(recent_tokens),
            dict(meta or {}, calibration_tokens=N,
                 weighting=weighting if isinstance(weighting, str)
                 else [[float(x) for x in r] for r in weighting]), say)
    mean = np.zeros((2, L, C), np.float64)
    basis = np.zeros((2, L, C, C), np.float64)
    var = np.zeros((2, L, C), np.float64)
    rng = np.random.default_rng(0)
    sub = np.sort(rng.choice(N, size=min(N, _RATE_SAMPLE_TOKENS), replace=False))
    coefs = np.zeros((2, L, len(sub), C), np.float32)
    cap = np.zeros((2, L, C), np.float64)
    analysis = np.zeros((2, L, C, C), np.float64) if (whiten and metric is not None) else None
    for kv, x in enumerate((k, v)):
        for layer in range(L):
            xl = x[layer].reshape(N, C).numpy()
            if analysis is not None:
                sq, isq = _metric_sqrt(metric[kv][layer], float(metric_power), H, D)
                mean[kv, layer] = xl.astype(np.float64).mean(0)
                _, u, var[kv, layer] = _pca(xl.astype(np.float64) @ sq, False, H, D)
                analysis[kv, layer] = sq @ u
                basis[kv, layer] = isq @ u
                cl = (xl.astype(np.float64) - mean[kv, layer]) @ analysis[kv, layer]
            else:
                mean[kv, layer], basis[kv, layer], var[kv, layer] = _pca(xl, per_head, H, D)
                cl = (xl.astype(np.float64) - mean[kv, layer]) @ basis[kv, layer]
            # steps never so fine that calibration coefficients clip at |q| = MAX_Q
            cap[kv, layer] = np.abs(cl).max(0) * 1.05 / MAX_Q
            coefs[kv, layer] = cl[sub]
        say(f"PCA {'KV'[kv]}: {L} layers done")
    if isinstance(weighting, np.ndarray):
        w = weighting.astype(np.float64)
    else:
        w = var.mean(-1) if weighting == "relative" else np.ones((2, L))
    w = np.maximum(w, 1e-30)
    if metric is not None and metric_power and analysis is None:
        gain = np.stack([np.stack([_metric_gain(basis[kv, layer], metric[kv][layer]
                                                .astype(np.float64), H, D)
                                   for layer in range(L)]) for kv in range(2)])
        # a component the metric ignores gets a water level 1e6 x the layer's: dropped
        w = w[..., None] / np.maximum(gain, 1e-6) ** float(metric_power)     # [2, L, C]
        # a component is kept while the water level is below var / w: order the
        # components by var / w, descending, so that the kept ones are a prefix at every
        # level (the codec codes the first n columns)
        order = np.argsort(-(var / w), axis=-1, kind="stable")               # [2, L, C]
        basis = np.take_along_axis(basis, order[:, :, None, :], axis=-1)
        var = np.take_along_axis(var, order, axis=-1)
        w = np.take_along_axis(w, order, axis=-1)
        cap = np.take_along_axis(cap, order, axis=-1)
        coefs = np.take_along_axis(coefs, order[:, :, None, :], axis=-1)
    n_elem = 2 * L * len(sub) * C
    levels = sorted(targets)
    steps = _solve_levels(w, var, cap, coefs, n_elem, targets, kwater, rounding, say)
    shrink = np.zeros((len(levels), 2, L, C), np.float64)
    if centroid:
        for i in range(len(levels)):
            shrink[i] = _shrink(coefs, steps[i], rounding)
    cal = KvtcCalibration(
        L, H, D, mean.astype(np.float32), basis.astype(np.float32), var.astype(np.float32),
        steps.astype(np.float32), tuple(levels), tuple(float(targets[x]) for x in levels),
        int(default_level), key_space, theta_rope, bool(per_head), int(sink_tokens),
        int(recent_tokens), dict(meta or {}, calibration_tokens=N,
                                 weighting=weighting if isinstance(weighting, str)
                                 else [[float(x) for x in r] for r in weighting],
                                 **({"key_water": {str(k): float(f) for k, f in
                                                   sorted(kwater.items())}}
                                    if kwater else {})),
        shrink=shrink.astype(np.float32) if centroid else None, rounding=float(rounding),
        analysis=None if analysis is None else analysis.astype(np.float32))
    _check_calibration(cal, "fit_calibration")
    cal.hash = cal.content_hash()
    return cal


# ---------------------------------------------------------------------------- codec
@dataclass(frozen=True)
class KvtcConfig:
    """Per-call options of the ``kvtc`` codec (pass as ``config=`` to ``encode_kv`` /
    ``encode_chunks``). ``calibration``: a KvtcCalibration, an artifact path or a hash
    naming the calibration this encode uses (required: None is refused with a ValueError
    naming the default, ``kv_extraction_hf.calibrate.default_calibration``; a hash is
    looked up like a decode's, registered then cache folder); ``level``: None =
    the calibration's default; ``recent_tokens`` / ``sink_tokens``: None = the
    calibration's (sinks: the level's ``DEFAULT_LEVEL_SINKS`` entry first);
    ``chunk_tokens``: ``encode_chunks``' default chunk size; ``tiers``:
    tail tiers ((tokens, level), ...) from the end of the context (kvtc format 3,
    docs/codec.md 8.7), None = the level's (``DEFAULT_LEVEL_TIERS``), () = none."""

    calibration: Any = None
    level: Optional[int] = None
    recent_tokens: Optional[int] = None
    sink_tokens: Optional[int] = None
    chunk_tokens: int = 1024
    tiers: Optional[tuple] = None

    def describe(self) -> dict:
        d = {"calibration": getattr(self.calibration, "hash", self.calibration),
             "level": self.level, "recent_tokens": self.recent_tokens,
             "sink_tokens": self.sink_tokens}
        if self.tiers is not None:
            d["tiers"] = [list(p) for p in self.tiers]
        return d

    def to_dict(self) -> dict:
        """The fields as a dict for ``codec.config_hash`` (``tiers`` only when set, so the
        hashes of configs made before it existed do not change)."""
        import dataclasses

        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(d["calibration"], KvtcCalibration):   # named by its hash
            d["calibration"] = d["calibration"].hash or d["calibration"].content_hash()
        elif isinstance(d["calibration"], os.PathLike):
            d["calibration"] = os.fspath(d["calibration"])
        if self.tiers is None:
            d.pop("tiers")
        else:
            d["tiers"] = [list(p) for p in self.tiers]
        return d


def _resolve_calibration(c: Any, L: int, H: int, D: int) -> KvtcCalibration:
    """The calibration an encode was given (``KvtcConfig.calibration``: the object, an
    artifact path, or the hash of a registered / cache-folder one). ValueError when none
    is given: there is no implicit "latest of this shape" choice."""
    if c is None:
        raise ValueError(
            f"kvtc encode needs its calibration: pass config=codec.kvtc.KvtcConfig("
            f"calibration=CAL) with CAL a KvtcCalibration, an artifact path or its hash "
            f"(the documented default for a model: "
            f"kv_extraction_hf.calibrate.default_calibration(bundle); the KV here has "
            f"L={L}, H={H}, D={D})")
    if isinstance(c, KvtcCalibration):
        if not c.hash:
            c.hash = c.content_hash()
        register_calibration(c)
        cal = c
    elif isinstance(c, str) and _HASH_RE.match(c):
        try:
            cal = get_calibration(c)
        except CodecError as e:
            raise ValueError(str(e)) from None
    elif isinstance(c, (str, os.PathLike)):
        try:
            cal = get_calibration(register_calibration(c))
        except CodecError as e:
            raise ValueError(str(e)) from None
    else:
        raise ValueError(f"calibration must be a KvtcCalibration, a path or a hash, "
                         f"got {type(c).__name__}")
    if (cal.num_layers, cal.num_heads, cal.head_dim) != (L, H, D):
        raise ValueError(f"calibration {cal.hash[:16]} is for L={cal.num_layers}, "
                         f"H={cal.num_heads}, D={cal.head_dim}; the KV has L={L}, H={H}, D={D}")
    return cal


def _exact_counts(T: int, token_offset: int, total_tokens: int, sink: int, recent: int
                  ) -> tuple[int, int]:
    """(tokens at the start of this chunk that are attention sinks, tokens at its end that
    are among the last ``recent`` of the context)."""
    ns = max(0, min(T, sink - token_offset))
    first_recent = max(total_tokens - recent, token_offset + ns)
    nr = max(0, min(T - ns, token_offset + T - first_recent))
    return ns, nr


# Column layouts of the coded symbols (docs/bitstream.md 4.5). Format 1 ("padded", header
# field ``layout`` absent): K and V each [L, Tq, n], n = the level's largest kept width,
# columns past a layer's own count always the offset symbol. Format 2 (``layout`` =
# "kept"): only each (K/V, layer)'s kept columns, in one [Tq, S] concatenation split into
# two equal halves (the entropy stage's K and V arrays, [1, Tq, ceil(S/2)] each).
KVTC_FORMAT_VERSION = 2
KVTC_TIERED_FORMAT = 3           # a tiered level's chunks: format 2 plus tail spans
KVTC_LAYOUT = "kept"
_PADDED = None


def _n_kept(keep: list) -> int:
    """S: kept columns of all (K/V, layer) together."""
    return int(sum(keep[0]) + sum(keep[1]))


def _kept_nbins(keep: list, offs: list, half: int) -> tuple[int, int]:
    """Alphabet sizes of the two halves of the kept layout: max(2, 2M + 1) with M the
    largest offset of a (K/V, layer) that has a column in that half (the pad column of an
    odd S is symbol 0)."""
    nb, col = [2, 2], 0
    for kv in (0, 1):
        for nl, o in zip(keep[kv], offs[kv]):
            if nl:
                for hf in {min(col // half, 1), min((col + nl - 1) // half, 1)}:
                    nb[hf] = max(nb[hf], 2 * int(o) + 1)
            col += nl
    return nb[0], nb[1]


def _kept_halves(syms: list, keep: list, offs: list, Tq: int
                 ) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The kept layout of symbols ``syms`` = [K, V] uint8 [L, Tq, n]: (half_a, half_b)
    uint8 [1, Tq, ceil(S/2)] (columns (kv, layer, component) in order, a zero pad column
    at the end of an odd S) and their alphabet sizes."""
    S = _n_kept(keep)
    half = max(1, (S + 1) // 2)
    flat = np.zeros((Tq, 2 * half), np.uint8)
    col = 0
    for kv in (0, 1):
        for layer, nl in enumerate(keep[kv]):
            flat[:, col:col + nl] = syms[kv][layer, :, :nl]
            col += nl
    nba, nbb = _kept_nbins(keep, offs, half)
    return (np.ascontiguousarray(flat[None, :, :half]),
            np.ascontiguousarray(flat[None, :, half:]), nba, nbb)


class _KeptSymbols:
    """The decoded symbols of one of K/V in the kept layout: the two halves a, b uint8
    [Tq, half] and each layer's first column in their concatenation."""

    def __init__(self, a: np.ndarray, b: np.ndarray, keep: list, kv: int):
        self.a, self.b = torch.from_numpy(a), torch.from_numpy(b)
        self.half = a.shape[1]
        self.keep = keep[kv]
        start = sum(keep[0]) if kv == 1 else 0
        self.start = [start + sum(self.keep[:i]) for i in range(len(self.keep))]

    def pieces(self, layer: int) -> list:
        """[(first, last, uint8 view [Tq, last - first])]: the kept columns of ``layer``
        (two pieces when they straddle the halves)."""
        s, nl, h = self.start[layer], self.keep[layer], self.half
        e = s + nl
        if e <= h:
            return [(0, nl, self.a[:, s:e])]
        if s >= h:
            return [(0, nl, self.b[:, s - h:e - h])]
        return [(0, h - s, self.a[:, s:]), (h - s, nl, self.b[:, :e - h])]

    def padded(self, offs: list, n: int) -> np.ndarray:
        """The same symbols in the padded layout, uint8 [L, Tq, n] (dropped columns = the
        layer's offset symbol): for tests and the reference decode."""
        L, Tq = len(self.keep), self.a.shape[0]
        out = _scratch.np_empty((L, Tq, n), np.uint8)
        for layer in range(L):
            out[layer] = offs[layer]
            for lo, hi, src in self.pieces(layer):
                out[layer, :, lo:hi] = src.numpy()
        return out


# Tail tiers (kvtc format 3, docs/codec.md 8.7): the last R1 tokens of a context coded at
# level B1, the R2 before them at level B2, ...; the rest at the chunk's level. The value
# error of a context token reaches the output weighted by the attention it gets, and the
# last few hundred tokens get most of it (docs/codec.md 8.6), so coding them finer lowers
# the KL at equal bytes. level -> ((R1, B1), (R2, B2), ...), from the end of the context.
# None by default since the grouped calibration (docs/codec.md 8.8): its untiered levels
# are simpler and robust to where the question sits; a caller may still pass
# ``KvtcConfig(tiers=...)`` (e.g. ((64, 5), (320, 4)), round 6's level 3).
DEFAULT_LEVEL_TIERS: dict[int, tuple] = {}
# level -> exact attention-sink tokens when the config does not say (levels not named: the
# calibration's ``sink_tokens``)
DEFAULT_LEVEL_SINKS: dict[int, int] = {}
MAX_TIERS = 8                    # spans per chunk at most (header validation)


def check_tiers(tiers: Any) -> tuple:
    """``tiers`` as a tuple of (tokens, level) int pairs, tokens >= 1, at most
    ``MAX_TIERS``. Raises ValueError otherwise (the levels are checked against the
    calibration by the encoder)."""
    try:
        out = tuple((r, b) for r, b in tiers)
    except (TypeError, ValueError):
        raise ValueError(f"tiers must be a sequence of (tokens, level) pairs, got "
                         f"{tiers!r}") from None
    if len(out) > MAX_TIERS or any(
            isinstance(x, bool) or not isinstance(x, int) for p in out for x in p) or \
            any(r < 1 for r, _ in out):
        raise ValueError(f"tiers must be at most {MAX_TIERS} (tokens >= 1, level) int "
                         f"pairs, got {tiers!r}")
    return out


def level_tiers(level: Optional[int]) -> tuple:
    """The tail tiers of a kvtc level (``DEFAULT_LEVEL_TIERS``; () = untiered)."""
    return tuple(DEFAULT_LEVEL_TIERS.get(DEFAULT_LEVEL if level is None else level, ()))


def _tail_spans(lo: int, hi: int, total: int, tiers: tuple) -> list:
    """[(first absolute token, count, level)] ascending: the rows of the coded range
    [lo, hi) that fall in each tier (the last R1 tokens of ``total`` at B1, the R2 before
    them at B2, ...). Contiguous, and the last one ends at ``hi`` when any exists."""
    spans, end = [], total
    for r, b in tiers:
        s, e = max(end - r, lo), min(end, hi)
        if e > s:
            spans.append((s, e - s, b))
        end -= r
        if end <= lo:
            break
    return spans[::-1]


_SPAN_ARRAY_RE = re.compile(r"^ent_t\d+_")


def _span_array(i: int, name: str) -> str:
    """Container name of tail span i's entropy array ``name`` (ent_X -> ent_t<i>_X)."""
    return f"ent_t{i}_{name[4:]}"


def _parse_spans(raw: Any, cal: KvtcCalibration, first: int, Tq: int, paylen: int
                 ) -> list:
    """Validated ``tiers`` header list of a format-3 chunk (None/absent = no spans).
    Each span: start, count >= 1, level (a calibration level), payload_bytes; contiguous,
    ending at first + Tq (the end of the coded rows), payload_bytes summing to at most
    ``paylen``. Raises CodecError otherwise."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_TIERS:
        raise CodecError(f"kvtc: header tiers must be a list of 1..{MAX_TIERS} spans")
    spans, used = [], 0
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise CodecError(f"kvtc: tail span {i} is not a dict")
        vals = {}
        for key, lo_, hi_ in (("start", first, first + Tq), ("count", 1, Tq),
                              ("payload_bytes", 0, paylen)):
            x = s.get(key)
            if isinstance(x, bool) or not isinstance(x, int) or not lo_ <= x <= hi_:
                raise CodecError(f"kvtc: tail span {i} field {key!r} must be an int in "
                                 f"[{lo_}, {hi_}], got {x!r}")
            vals[key] = x
        lv = s.get("level")
        if isinstance(lv, bool) or lv not in cal.levels:
            raise CodecError(f"kvtc: tail span {i} level {lv!r} not in calibration levels "
                             f"{list(cal.levels)}")
        if spans and vals["start"] != spans[-1]["start"] + spans[-1]["count"]:
            raise CodecError(f"kvtc: tail span {i} does not follow span {i - 1}")
        used += vals["payload_bytes"]
        spans.append({**s, **vals, "level": lv})
    if spans[-1]["start"] + spans[-1]["count"] != first + Tq or used > paylen:
        raise CodecError("kvtc: tail spans do not end at the last coded row or exceed "
                         "the payload")
    return spans


def _code_rows(k: torch.Tensor, v: torch.Tensor, cal: KvtcCalibration, lvl: int,
               pos0: int) -> tuple[dict, Any, int]:
    """Transform-code the rows k, v [L, Tr, H, D] (absolute positions pos0, pos0 + 1, ...:
    keys of a pre-RoPE calibration are rotated back there) at ``lvl``, kept layout
    (format 2). Returns (the header fields layout, n_kept, offset_k, offset_v, entropy;
    the ``codec.entropy.EncodedSymbols``; the number of coded symbols)."""
    from .entropy import encode_symbols

    L, Tq, H, D = k.shape
    P = cal.torch_params(lvl)
    keep = P["keep"]
    if cal.group_layers:
        return _code_rows_grouped(k, v, cal, P, pos0)
    syms, offs = [], []
    for kv, x in enumerate((k, v)):
        x = x.to(torch.float32)
        if kv == 0 and cal.key_space == "pre_rope" and Tq:
            x = undo_rope(x, torch.arange(pos0, pos0 + Tq), cal.rope_theta)
        xc = x.reshape(L, Tq, H * D) - P["mean"][kv]
        coef = torch.bmm(xc, P["basis"][kv]) / P["step"][kv]         # [L, Tq, n]
        if cal.rounding == 0.5:
            q = torch.round(coef)
        else:          # dead zone: sign(u) floor(|u| + rounding)
            q = torch.floor(coef.abs() + cal.rounding).copysign_(coef)
        q = q.clamp_(-MAX_Q, MAX_Q).to(torch.int16)
        off = q.abs().amax(dim=(1, 2)) if Tq else torch.zeros(L, dtype=torch.int16)
        syms.append((q + off[:, None, None]).to(torch.uint8).numpy())
        offs.append([int(o) for o in off])
    # layout "kept" (format 2): only each (K/V, layer)'s own kept columns are coded,
    # concatenated (K layers 0..L-1, then V) into [Tq, S] and split in two halves
    sym_a, sym_b, nba, nbb = _kept_halves(syms, keep, offs, Tq)
    es = encode_symbols(sym_a, sym_b, [nba], [nbb], channels_per_stream=4)
    return ({"layout": KVTC_LAYOUT, "n_kept": _n_kept(keep), "offset_k": offs[0],
             "offset_v": offs[1], "entropy": es.header}, es, int(sym_a.size + sym_b.size))


KVTC_GROUPED_FORMAT = 4          # chunks of a grouped calibration (layout "grouped")
KVTC_GROUPED_LAYOUT = "grouped"


def _group_features(k: torch.Tensor, v: torch.Tensor, cal: KvtcCalibration, pos0: int
                    ) -> torch.Tensor:
    """float32 [NG, Tr, Cg]: each layer group's features [K_l, V_l, ...] of rows k, v [L,
    Tr, H, D] (keys rotated back by RoPE at positions pos0, ... for a pre-RoPE
    calibration), zero-padded past a short last group."""
    L, Tr, H, D = k.shape
    C, G = H * D, cal.group_layers
    kf = k.to(torch.float32)
    if cal.key_space == "pre_rope" and Tr:
        kf = undo_rope(kf, torch.arange(pos0, pos0 + Tr), cal.rope_theta)
    X = torch.zeros((cal.num_groups, Tr, 2 * G * C), dtype=torch.float32)
    for g in range(cal.num_groups):
        for j, layer in enumerate(cal.group_layer_ids(g)):
            X[g, :, 2 * j * C:(2 * j + 1) * C] = kf[layer].reshape(Tr, C)
            X[g, :, (2 * j + 1) * C:(2 * j + 2) * C] = v[layer].reshape(Tr, C)
    return X


def _code_rows_grouped(k: torch.Tensor, v: torch.Tensor, cal: KvtcCalibration, P: dict,
                       pos0: int) -> tuple[dict, Any, int]:
    """``_code_rows`` of a grouped calibration (kvtc format 4, layout "grouped"): per layer
    group, coefficients (x - mean) @ analysis / step rounded, |q| <= MAX_Q, symbol = q +
    the group's offset (max |q|); the kept columns of all groups concatenated [Tr, S] and
    split into two halves for ``codec.entropy.encode_symbols``. Header fields: layout,
    n_kept (S), offsets (per group), entropy."""
    from .entropy import encode_symbols

    Tq = k.shape[1]
    keep = P["keep"]
    X = _group_features(k, v, cal, pos0)
    coef = torch.bmm(X - P["mean"], P["basis"]) / P["step"]                 # [NG, Tq, n]
    q = torch.round(coef) if cal.rounding == 0.5 else \
        torch.floor(coef.abs() + cal.rounding).copysign_(coef)
    q = q.clamp_(-MAX_Q, MAX_Q).to(torch.int16)
    # a group's offset covers its kept columns only (dropped ones are never coded)
    mask = torch.arange(q.shape[-1])[None, :] < torch.tensor(keep[0])[:, None]   # [NG, n]
    off = (q.abs() * mask[:, None, :]).amax(dim=(1, 2)) if Tq else \
        torch.zeros(len(keep[0]), dtype=torch.int16)
    syms = (q + off[:, None, None]).to(torch.uint8).numpy()
    offs = [int(o) for o in off]
    sym_a, sym_b, nba, nbb = _kept_halves([syms, None], keep, [offs, []], Tq)
    es = encode_symbols(sym_a, sym_b, [nba], [nbb], channels_per_stream=4)
    return ({"layout": KVTC_GROUPED_LAYOUT, "n_kept": _n_kept(keep), "offsets": offs,
             "entropy": es.header}, es, int(sym_a.size + sym_b.size))


def _decode_rows(hdr: dict, ent_arrays: dict, payload: Any, cal: KvtcCalibration,
                 lvl: int, P: dict, L: int, Tq: int) -> tuple[list, list]:
    """The symbols of Tq rows coded at ``lvl`` (header fields ``hdr``: layout, n_kept or
    n_components, offset_k/v, entropy): ([K, V] as ``_KeptSymbols`` or uint8 [L, Tq, n],
    [offset_k, offset_v]). Raises CodecError on any inconsistency."""
    from .codecs import need_int
    from .entropy import decode_symbols

    keep = P["keep"]
    layout = hdr.get("layout", _PADDED)
    if (layout == KVTC_GROUPED_LAYOUT) != bool(cal.group_layers):
        raise CodecError(f"kvtc: column layout {layout!r} does not match calibration "
                         f"{cal.hash[:16]} (group_layers {cal.group_layers})")
    if cal.group_layers:
        return _decode_rows_grouped(hdr, ent_arrays, payload, cal, lvl, keep, Tq)
    offs = []
    for tag in ("k", "v"):
        o = hdr.get(f"offset_{tag}")
        if not isinstance(o, list) or len(o) != L or any(
                isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_Q
                for x in o):
            raise CodecError(f"kvtc: bad offset_{tag} in header")
        offs.append(o)
    ent = hdr.get("entropy")
    if not isinstance(ent, dict):
        raise CodecError("kvtc: missing entropy-coder header")
    if layout == KVTC_LAYOUT:            # format 2: each layer's kept columns only
        S = need_int(hdr, "n_kept", 0, 2 * L * cal.C)
        if S != _n_kept(keep):
            raise CodecError(f"kvtc: header has {S} kept columns, level {lvl} of the "
                             f"calibration keeps {_n_kept(keep)}")
        half = max(1, (S + 1) // 2)
        nba, nbb = _kept_nbins(keep, offs, half)
        sa, sb = decode_symbols(ent, ent_arrays, payload, 1, Tq, half, [nba], [nbb])
        if sa.shape != (1, Tq, half) or sb.shape != (1, Tq, half):
            raise CodecError(f"kvtc: decoded symbols have shape {sa.shape}")
        return [_KeptSymbols(sa[0], sb[0], keep, kv) for kv in (0, 1)], offs
    if layout == _PADDED and "start" not in hdr:   # format 1: the max kept width
        n = need_int(hdr, "n_components", 1, cal.C)
        if n != P["n"]:
            raise CodecError(f"kvtc: header has {n} components, level {lvl} of the "
                             f"calibration codes {P['n']}")
        nbk = [max(2, 2 * o + 1) for o in offs[0]]
        nbv = [max(2, 2 * o + 1) for o in offs[1]]
        srcs = list(decode_symbols(ent, ent_arrays, payload, L, Tq, n, nbk, nbv))
        for sym, tag in zip(srcs, "kv"):
            if sym.shape != (L, Tq, n):
                raise CodecError(f"kvtc: decoded {tag} symbols have shape {sym.shape}")
        return srcs, offs
    raise CodecError(f"kvtc: unknown column layout {layout!r} (this decoder reads "
                     f"{KVTC_LAYOUT!r} and, outside tail spans, the older padded layout, "
                     f"field absent)")


def _decode_rows_grouped(hdr: dict, ent_arrays: dict, payload: Any, cal: KvtcCalibration,
                         lvl: int, keep: list, Tq: int) -> tuple[list, list]:
    """The symbols of Tq rows of a grouped calibration (layout "grouped"):
    ([_KeptSymbols over the groups], [offsets per group]). Raises CodecError."""
    from .codecs import need_int
    from .entropy import decode_symbols

    NG = cal.num_groups
    o = hdr.get("offsets")
    if not isinstance(o, list) or len(o) != NG or any(
            isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_Q for x in o):
        raise CodecError(f"kvtc: bad offsets in header (want {NG} ints in [0, {MAX_Q}])")
    ent = hdr.get("entropy")
    if not isinstance(ent, dict):
        raise CodecError("kvtc: missing entropy-coder header")
    S = need_int(hdr, "n_kept", 0, NG * 2 * cal.group_layers * cal.C)
    if S != _n_kept(keep):
        raise CodecError(f"kvtc: header has {S} kept columns, level {lvl} of the "
                         f"calibration keeps {_n_kept(keep)}")
    half = max(1, (S + 1) // 2)
    nba, nbb = _kept_nbins(keep, [o, []], half)
    sa, sb = decode_symbols(ent, ent_arrays, payload, 1, Tq, half, [nba], [nbb])
    if sa.shape != (1, Tq, half) or sb.shape != (1, Tq, half):
        raise CodecError(f"kvtc: decoded symbols have shape {sa.shape}")
    return [_KeptSymbols(sa[0], sb[0], keep, 0)], [o]


# Decode workers (Python threads running torch ops, which release the GIL): at most this
# many, and at most torch.get_num_threads(); one pool per process, made on first use.
_MAX_DECODE_WORKERS = 8
_POOL = None
_POOL_LOCK = threading.Lock()


def _rope_rows_py(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate-half RoPE in place (RoFormer eq. 34; HF's layout): x float32 [T, H, D]
    (C-contiguous), cos/sin float32 [T, D/2]: [x1, x2] -> [x1 cos - x2 sin,
    x2 cos + x1 sin] per head, the same two products and one sum per value as
    ``apply_rope``. Compiled by numba (``_rope_kernel``; nogil: the decode workers run
    it side by side); without numba ``KvtcCodec._inverse`` uses torch ops instead."""
    T, H, D = x.shape
    h = D // 2
    for t in range(T):
        for hh in range(H):
            for j in range(h):
                a = x[t, hh, j]
                b = x[t, hh, j + h]
                c = cos[t, j]
                s = sin[t, j]
                x[t, hh, j] = a * c - b * s
                x[t, hh, j + h] = b * c + a * s


def _rope_bf16_py(src: np.ndarray, dst: np.ndarray, cos: np.ndarray, sin: np.ndarray
                  ) -> None:
    """``_rope_rows_py`` on bf16 rows given as their bit patterns: src, dst uint16 [T, H, D]
    (C-contiguous), cos/sin float32 [T, D/2]. Each value is widened to float32 exactly,
    rotated with the same two products and one sum, and rounded to the nearest bf16 (ties
    to even), i.e. the same bits as widening, ``_rope_rows_py`` and a torch cast, without
    the two float32 copies. Compiled by numba (``_rope_bf16_kernel``)."""
    T, H, D = src.shape
    h = D // 2
    xb = np.empty((H, D), np.uint32)
    yb = np.empty((H, D), np.float32)
    x = xb.view(np.float32)
    y = yb.view(np.uint32)
    for t in range(T):
        for hh in range(H):
            for d in range(D):
                xb[hh, d] = np.uint32(src[t, hh, d]) << np.uint32(16)
        for hh in range(H):
            for j in range(h):
                a = x[hh, j]
                b = x[hh, j + h]
                c = cos[t, j]
                s = sin[t, j]
                yb[hh, j] = a * c - b * s
                yb[hh, j + h] = b * c + a * s
        for hh in range(H):
            for d in range(D):
                v = y[hh, d]
                dst[t, hh, d] = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16))
                                                                  & np.uint32(1))) >> np.uint32(16))


_ROPE_KERNEL = None
_ROPE_BF16_KERNEL = None


@functools.lru_cache(maxsize=32)
def _rope_tables(start: int, T: int, D: int, theta: float) -> tuple:
    """RoPE tables of positions [start, start + T) for the decode, cached (a context's
    chunks start at the same positions every time; computing them costs little, but as
    small multi-threaded torch ops on a busy machine it cost up to ~40 ms per chunk):
    cos [T, 1, D] and signed sin [T, 1, D] float32 tensors (the torch fallback), cos and
    sin float32 [T, D/2] read-only numpy arrays (the numba kernels). At most 32 entries
    (~8 MB at T = 1024, D = 128)."""
    h = D // 2
    cos, sin = _rope_cos_sin(torch.arange(start, start + T), D, theta)
    cos_h, sin_h = cos[:, 0, :h].contiguous(), sin[:, 0, :h].contiguous()      # [T, h]
    cos_np, sin_np = cos_h.numpy(), sin_h.numpy()
    cos_np.setflags(write=False)
    sin_np.setflags(write=False)
    return (cos.contiguous(), torch.cat([-sin_h, sin_h], dim=-1)[:, None, :],
            cos_np, sin_np)


def _jit_or_false(fn):
    """``fn`` compiled by numba (nogil, cached on disk), or False without numba."""
    try:
        from numba import njit
        return njit(cache=True, nogil=True)(fn)
    except ImportError:  # pragma: no cover - numba is in requirements.txt
        return False


def _rope_bf16_kernel():
    """The compiled ``_rope_bf16_py`` (numba, cached on disk), or None without numba."""
    global _ROPE_BF16_KERNEL
    if _ROPE_BF16_KERNEL is None:
        _ROPE_BF16_KERNEL = _jit_or_false(_rope_bf16_py)
    return _ROPE_BF16_KERNEL or None


def _rope_kernel():
    """The compiled ``_rope_rows_py`` (numba, cached on disk; compiled on first use), or
    None without numba."""
    global _ROPE_KERNEL
    if _ROPE_KERNEL is None:
        _ROPE_KERNEL = _jit_or_false(_rope_rows_py)
    return _ROPE_KERNEL or None


def _decode_workers() -> int:
    """Worker threads of ``KvtcCodec._inverse``: the larger of torch's and numba's thread
    counts (numba's is the one the rANS decoder of the same chunk uses; inside the vLLM CPU
    worker torch runs with 1 thread but the decode may use both cores while the engine
    waits on the load, issue 14.2), at most ``_MAX_DECODE_WORKERS``."""
    n = torch.get_num_threads()
    try:
        import numba

        from .threads import configure_threading_layer
        configure_threading_layer()      # get_num_threads launches numba's thread pool
        n = max(n, int(numba.get_num_threads()))
    except Exception:  # noqa: BLE001 - no numba: torch's count
        pass
    return max(1, min(n, _MAX_DECODE_WORKERS))


_BF16_GEMM = None


def _bf16_gemm() -> bool:
    """Whether ``KvtcCodec._inverse`` multiplies in bf16 (float32 accumulation) for a bf16
    destination: the CPU has native bf16 dot products (AVX512-BF16, as torch reports it).
    Without them bf16 products are emulated and slower than float32."""
    global _BF16_GEMM
    if _BF16_GEMM is None:
        try:
            _BF16_GEMM = bool(torch.cpu._is_avx512_bf16_supported())
        except Exception:  # noqa: BLE001 - an older torch: float32 products
            _BF16_GEMM = False
    return _BF16_GEMM


def _decode_pool():
    """The process-wide ThreadPoolExecutor of ``KvtcCodec._inverse`` (created on first
    use; ``_MAX_DECODE_WORKERS`` threads named ``kvtc-decode-*``, idle between decodes)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                from concurrent.futures import ThreadPoolExecutor
                _POOL = ThreadPoolExecutor(_MAX_DECODE_WORKERS, thread_name_prefix="kvtc-decode")
    return _POOL


def _rows(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The first rows * cols elements of the 1-D scratch ``flat`` as a contiguous [rows,
    cols] matrix (a GEMM operand with leading dimension = cols: no undefined element
    inside its rows, whatever the kernel reads; codec/scratch.py)."""
    return flat[:rows * cols].view(rows, cols)


def _split_over_workers(fn, n: int) -> None:
    """Run ``fn(idx)`` over the items 0..n-1: in the calling thread with one worker
    (``_decode_workers()``), else item w, w + W, ... on worker w of ``_decode_pool()``
    (each item's arithmetic is the same either way). Re-raises a worker's exception."""
    workers = min(n, _decode_workers())
    if workers <= 1:
        fn(range(n))
        return
    futs = [_decode_pool().submit(fn, range(w, n, workers)) for w in range(workers)]
    for f in futs:
        f.result()


class KvtcCodec:
    """The ``kvtc`` codec behind ``codec.api`` (see the module docstring).

    Header ("codec_header") fields: config {level, calibration (sha256 hex),
    sink_tokens, recent_tokens}, n_sink, n_recent, layout ("kept"; absent in the older
    padded layout) and n_kept (kept columns of all (K/V, layer); the padded layout has
    n_components, coded columns per layer, instead), offset_k / offset_v (per layer: the
    symbol of coefficient 0, = max |q|), token_offset (the chunk's first position, for
    RoPE), entropy (``codec.entropy`` header); format 3 adds tiers (the tail spans: start,
    count, level, their own layout/n_kept/offset_k/offset_v/entropy, payload_bytes).
    Arrays: sink_k/v, recent_k/v (exact tokens, the KV dtype's bits), ent_* (entropy
    coder; span i's as ent_t<i>_*). docs/bitstream.md section 4.5.
    Decode raises CodecError on any inconsistent field, a missing or different
    calibration, or corrupt streams."""

    name = "kvtc"
    lossless = False
    uses_level = True
    supports_triton = False

    @property
    def levels(self) -> tuple:
        return tuple(sorted(DEFAULT_LEVEL_TARGETS))

    @property
    def default_level(self) -> int:
        return DEFAULT_LEVEL

    def resolve_config(self, num_layers: int, level: Optional[int], config: Any
                       ) -> KvtcConfig:
        """The effective KvtcConfig (level filled in when given)."""
        if config is None:
            config = KvtcConfig()
        if not isinstance(config, KvtcConfig):
            raise ValueError(f"kvtc config must be a codec.kvtc.KvtcConfig, got "
                             f"{type(config).__name__}")
        if level is not None and config.level is not None and level != config.level:
            raise ValueError(f"level={level} contradicts config.level={config.level}")
        if level is not None:
            config = KvtcConfig(config.calibration, level, config.recent_tokens,
                                config.sink_tokens, config.chunk_tokens, config.tiers)
        if config.tiers is not None:
            check_tiers(config.tiers)
        return config

    # ---- encode ----------------------------------------------------------------------
    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        from .codecs import EncodedChunk, to_bits

        L, T, H, D = k.shape
        cfg = self.resolve_config(L, level, config)
        cal = _resolve_calibration(cfg.calibration, L, H, D)
        lvl = cal.default_level if cfg.level is None else cfg.level
        if lvl not in cal.levels:
            raise ValueError(f"unknown kvtc level {lvl!r}; calibration {cal.hash[:16]} has "
                             f"levels {list(cal.levels)}")
        sink = DEFAULT_LEVEL_SINKS.get(lvl, cal.sink_tokens) if cfg.sink_tokens is None \
            else cfg.sink_tokens
        recent = cal.recent_tokens if cfg.recent_tokens is None else cfg.recent_tokens
        for nm, x in (("sink_tokens", sink), ("recent_tokens", recent)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"{nm} must be an int >= 0, got {x!r}")
        tiers = check_tiers(level_tiers(lvl) if cfg.tiers is None else cfg.tiers)
        for _, b in tiers:
            if b not in cal.levels:
                raise ValueError(f"tier level {b!r} is not a level of calibration "
                                 f"{cal.hash[:16]} ({list(cal.levels)})")
        ns, nr = _exact_counts(T, token_offset, total_tokens, sink, recent)
        Tq = T - ns - nr
        spans = _tail_spans(token_offset + ns, token_offset + T - nr, total_tokens, tiers)
        Tb = Tq - sum(c for _, c, _ in spans)          # rows at the base level
        conf: dict[str, Any] = {"level": lvl, "calibration": cal.hash,
                                "sink_tokens": sink, "recent_tokens": recent}
        if tiers:              # absent for an untiered level: format-2 bytes unchanged
            conf["tiers"] = [[r, b] for r, b in tiers]
        header: dict[str, Any] = {"config": conf, "n_sink": ns, "n_recent": nr,
                                  "token_offset": token_offset}
        arrays: dict[str, np.ndarray] = {}
        if ns:
            arrays["sink_k"], arrays["sink_v"] = to_bits(k[:, :ns]), to_bits(v[:, :ns])
        if nr:
            arrays["recent_k"] = to_bits(k[:, T - nr:])
            arrays["recent_v"] = to_bits(v[:, T - nr:])
        # the base rows [ns, ns + Tb) at ``lvl`` (the format-2 fields), then each tail span
        fields, es, nsym = _code_rows(k[:, ns:ns + Tb], v[:, ns:ns + Tb], cal, lvl,
                                      token_offset + ns)
        header.update(fields)
        arrays.update(es.arrays)
        payload, parts = [es.payload], [es]
        if spans:
            tl = []
            for i, (start, count, b) in enumerate(spans):
                r0 = start - token_offset
                f2, e2, n2 = _code_rows(k[:, r0:r0 + count], v[:, r0:r0 + count], cal, b,
                                        start)
                tl.append({"start": start, "count": count, "level": b, **f2,
                           "payload_bytes": len(e2.payload)})
                arrays.update({_span_array(i, nm): a for nm, a in e2.arrays.items()})
                payload.append(e2.payload)
                parts.append(e2)
                nsym += n2
            header["tiers"] = tl
        stats = {"symbols": nsym, "components": cal.torch_params(lvl)["n"],
                 "sink_bytes": int(sum(a.nbytes for nm, a in arrays.items()
                                       if nm.startswith(("sink_", "recent_")))),
                 "entropy_bits": sum(e.entropy_bits for e in parts),
                 "ideal_bits": sum(e.ideal_bits for e in parts),
                 "model_bytes": sum(e.model_bytes for e in parts),
                 "length_table_bytes": sum(e.length_table_bytes for e in parts),
                 "payload_bytes": sum(e.payload_bytes for e in parts), "scale_bytes": 0,
                 "tail_tokens": Tq - Tb}
        return EncodedChunk(header, arrays, b"".join(payload), stats)

    # ---- decode ----------------------------------------------------------------------
    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None):
        from .codecs import DTYPES, from_bits, need_int

        L, T, H, D = shape
        cfgd = header.get("config")
        if not isinstance(cfgd, dict):
            raise CodecError("kvtc: header lacks the config dict")
        h = cfgd.get("calibration")
        cal = get_calibration(h)
        if (cal.num_layers, cal.num_heads, cal.head_dim) != (L, H, D):
            raise CodecError(f"kvtc: calibration {h[:16]} is for L={cal.num_layers}, "
                             f"H={cal.num_heads}, D={cal.head_dim}, the data has "
                             f"L={L}, H={H}, D={D}")
        lvl = cfgd.get("level")
        if isinstance(lvl, bool) or lvl not in cal.levels:
            raise CodecError(f"kvtc: level {lvl!r} not in calibration levels {list(cal.levels)}")
        ns = need_int(header, "n_sink", 0, T)
        nr = need_int(header, "n_recent", 0, T - ns)
        Tq = T - ns - nr
        off0 = need_int(header, "token_offset", 0, 1 << 24)
        # format 3: tail spans (absolute rows [start, start + count) at their own level),
        # contiguous and ending where the coded rows end; the base rows come first
        spans = _parse_spans(header.get("tiers"), cal, off0 + ns, Tq, len(payload))
        Tb = Tq - sum(s["count"] for s in spans)
        span_bytes = sum(s["payload_bytes"] for s in spans)
        base_arrays = {nm: a for nm, a in arrays.items()
                       if nm.startswith("ent_") and not _SPAN_ARRAY_RE.match(nm)}
        pay = memoryview(payload) if not isinstance(payload, memoryview) else payload
        pos = len(pay) - span_bytes
        # (without spans the payload is passed as it came: no copy)
        jobs = [(lvl, off0 + ns, Tb, ns, header, base_arrays,
                 payload if not spans else bytes(pay[:pos]))]
        for i, s in enumerate(spans):
            pre = f"ent_t{i}_"
            sa = {"ent_" + nm[len(pre):]: a for nm, a in arrays.items() if nm.startswith(pre)}
            jobs.append((s["level"], s["start"], s["count"], s["start"] - off0, s, sa,
                         bytes(pay[pos:pos + s["payload_bytes"]])))
            pos += s["payload_bytes"]
        dt = DTYPES[dtype_name]
        res = [_scratch.empty((L, T, H, D), dtype=dt) for _ in range(2)]   # model dtype
        with torch.inference_mode():
            for kv, tag in enumerate(("k", "v")):
                if ns:
                    res[kv][:, :ns] = from_bits(arrays.get(f"sink_{tag}"), dtype_name,
                                                (L, ns, H, D), f"sink_{tag}")
                if nr:
                    res[kv][:, T - nr:] = from_bits(arrays.get(f"recent_{tag}"), dtype_name,
                                                    (L, nr, H, D), f"recent_{tag}")
            for lv, start, count, row, hdr, ent_arrays, pl in jobs:
                P = cal.torch_params(lv)
                srcs, offs = _decode_rows(hdr, ent_arrays, pl, cal, lv, P, L, count)
                if not count:
                    continue
                if cal.group_layers:
                    self._inverse_grouped(
                        srcs[0], offs[0], P, cal, (L, count, H, D),
                        start if cal.key_space == "pre_rope" else None,
                        res[0][:, row:row + count], res[1][:, row:row + count])
                    continue
                for kv in (0, 1):
                    self._inverse(
                        srcs[kv], offs[kv], P, kv, (L, count, H, D),
                        start if kv == 0 and cal.key_space == "pre_rope" else None,
                        cal.rope_theta, out=res[kv][:, row:row + count])
        return res[0], res[1]

    def identity(self, level=None, config=None, num_layers=None) -> dict:
        """Part of ``codec.config_hash`` (store keys): the kvtc bitstream format version
        (``KVTC_FORMAT_VERSION`` = 2 for a level without tail tiers, so that store entries
        of untiered levels written before format 3 stay valid; ``KVTC_TIERED_FORMAT`` = 3
        with the level's tiers ``[[tokens, level], ...]`` for a tiered one) and the level's
        own sink count (``DEFAULT_LEVEL_SINKS``, when it has one), so that a store entry of
        an older format or an older level table is never served.
        ``level``: None = the default level; ``config``: a KvtcConfig whose ``tiers``
        overrides the table. It sees no calibration: a grouped calibration's chunks (format
        4) get the same 2 or 3; the calibration hash, which the store's entry identity
        holds and every chunk header names, tells them apart."""
        lvl = DEFAULT_LEVEL if level is None else level
        if config is not None and getattr(config, "level", None) is not None:
            lvl = config.level
        t = getattr(config, "tiers", None)
        tiers = check_tiers(level_tiers(lvl) if t is None else t)
        sinks = {} if lvl not in DEFAULT_LEVEL_SINKS else {
            "sink_tokens": int(DEFAULT_LEVEL_SINKS[lvl])}
        if not tiers:
            return {"kvtc_format": KVTC_FORMAT_VERSION, **sinks}
        return {"kvtc_format": KVTC_TIERED_FORMAT, "tiers": [[r, b] for r, b in tiers],
                **sinks}

    @staticmethod
    def _inverse(sym, offs: list, P: dict, kv: int, shape: tuple,
                 rope_from: Optional[int], theta: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """KV [L, Tq, H, D] from the symbols (uint8 [L, Tq, n] in the padded layout, or a
        ``_KeptSymbols`` of the kept layout), written into ``out`` (any float dtype, e.g. a
        view of the model-dtype result; None = a new float32 tensor, returned either way).

        Per layer l (at its kept width n_l, dropped components are never multiplied):
        x = sym[:, :n_l] @ B_s[:n_l] + (mean - off * colsum(B_s)), one float32 ``addmm``
        with the step-scaled inverse basis B_s (x = (sym - off) * step @ B^T + mean).
        With centroid offsets (``P["shrink"]``) the coefficients are centred first and
        each non-zero one moved toward 0 by its component's offset:
        x = (q - shrink sign(q)) @ B_s^T + mean. Keys coded before RoPE
        (``rope_from`` = the first token's position; None = no RoPE) are rotated in place
        in that float32 layer (``_rope_rows_py``, a numba kernel: rotate-half RoPE,
        RoFormer eq. 34, [x1 cos - x2 sin, x2 cos + x1 sin] per head; torch ops without
        numba), then the layer is cast into ``out``. No full-size float32 intermediate: each
        worker casts one layer's kept symbol columns at a time into its own buffers.

        Threads: with one worker (``_decode_workers()``: max of torch's and numba's
        thread counts) the layers run in the calling thread; with more, the layers are
        split over ``_decode_pool()`` (Python threads, each running torch ops on one
        thread; torch releases the GIL), so the cores work on whole layers instead of
        synchronising many small parallel regions (a per-layer loop with 2 OpenMP
        threads collapsed ~8x on a busy machine; docs/codec.md section 8.4). Each layer's
        arithmetic is the same ops in the same order either way, so the bytes do not
        depend on the thread count. float32 rounding only: ``_inverse_ref`` (the
        textbook path) agrees within float32 rounding (tests/test_kvtc_decode_fast.py).
        bf16 products: with a bf16 ``out``, no centroid offsets and a CPU with bf16 dot
        products (``_bf16_gemm``), the product is a bf16 ``addmm`` (float32 accumulation)
        of the exact integer coefficients q - off with the step-scaled basis and the mean
        rounded to bf16 (values written straight into ``out``; keys rotated by
        ``_rope_bf16_py`` on the bf16 bits: widened exactly, RoPE in float32, rounded
        once); error within eps_bf16 (|x| + |q| @ |B_s| + |mean|) of the float32 result
        (twice the pair's bound after RoPE; tests/test_kvtc_decode_fast.py), 2-4x faster
        than the float32 product (docs/codec.md 8.4b).
        """
        L, Tq, H, D = shape
        C = H * D
        rope = rope_from is not None
        if out is None:
            out = _scratch.empty((L, Tq, H, D), dtype=torch.float32)
        if L == 0 or Tq == 0:
            return out
        basis = P["basis_ts"][kv]                                         # [L, n, C]
        keep = P["keep"][kv]
        n = basis.shape[1]
        if isinstance(sym, _KeptSymbols):
            pieces = sym.pieces
        else:
            symt = torch.from_numpy(np.ascontiguousarray(sym, np.uint8))  # [L, Tq, n]

            def pieces(layer):
                return [(0, keep[layer], symt[layer, :, :keep[layer]])]
        offt = torch.tensor(offs, dtype=torch.float32)
        shrink = P.get("shrink")
        if shrink is not None:
            shrink = shrink[kv]                                          # [L, 1, n]
            bias = P["mean"][kv, :, 0]                                   # [L, C]
        else:
            bias = P["mean"][kv, :, 0] - offt[:, None] * P["colsum"][kv]   # [L, C]
        h = D // 2
        kern = _rope_kernel() if rope else None
        # bf16 destination, integer coefficients (no centroid offsets) and a CPU with bf16
        # dot products: the product runs in bf16 with float32 accumulation (2-4x faster
        # than float32 here; the basis and mean are rounded to bf16 once, docs/codec.md 8.4b)
        bf16 = out.dtype == torch.bfloat16 and shrink is None and _bf16_gemm()
        if bf16:
            if "basis_ts_bf16" not in P:     # cached beside the float32 tensors
                P["basis_ts_bf16"] = P["basis_ts"].to(torch.bfloat16)
                P["mean_bf16"] = P["mean"][:, :, 0].to(torch.bfloat16)
            basis_h = P["basis_ts_bf16"][kv]                              # [L, n, C]
            mean_h = P["mean_bf16"][kv]                                   # [L, C]
        kern16 = _rope_bf16_kernel() if (bf16 and rope and kern is not None) else None
        if rope:
            cos_full, sin_signed, cos_np, sin_np = _rope_tables(rope_from, Tq, D, theta)

        def layers(idx) -> None:
            with torch.inference_mode():    # a worker thread does not inherit the mode
                _layers(idx)

        def _layers(idx) -> None:
            x = _scratch.empty((Tq, C), dtype=torch.float32)
            # the coefficient operands are flat buffers whose first Tq * nl elements are
            # viewed as a CONTIGUOUS [Tq, nl] matrix (never a column slice of [Tq, n]: on
            # AMX oneDNN's bf16 GEMM reads a row up to its stride, codec/scratch.py)
            qb = _scratch.empty((Tq * n,), dtype=torch.bfloat16 if bf16 else torch.float32)
            xh = _scratch.empty((Tq, C), dtype=torch.bfloat16) if bf16 else None
            q16 = _scratch.empty((Tq * n,), dtype=torch.int16) if bf16 else None
            for layer in idx:
                nl = keep[layer]
                if bf16:
                    # straight into the destination unless RoPE follows (then via float32)
                    dst = out[layer].view(Tq, C) if not rope and out[layer].is_contiguous() \
                        else xh
                    if nl:
                        q, qi = _rows(qb, Tq, nl), _rows(q16, Tq, nl)
                        for lo, hi, src in pieces(layer):
                            qi[:, lo:hi].copy_(src)
                        qi -= offs[layer]        # integer q = symbol - M (int16 ops are
                        q.copy_(qi)              # ~2x faster than bf16 ones); exact in bf16
                        torch.addmm(mean_h[layer], q, basis_h[layer, :nl], out=dst)
                    else:
                        dst.copy_(mean_h[layer].expand(Tq, C))
                    if not rope:
                        if dst is xh:
                            out[layer].copy_(xh.view(Tq, H, D))
                        continue
                    if kern16 is not None and out[layer].is_contiguous():
                        kern16(xh.view(torch.int16).numpy().view(np.uint16).reshape(Tq, H, D),
                               out[layer].view(torch.int16).numpy().view(np.uint16),
                               cos_np, sin_np)
                        continue
                    x.copy_(xh)
                elif nl:
                    q = _rows(qb, Tq, nl)
                    for lo, hi, src in pieces(layer):    # symbols of the kept columns
                        q[:, lo:hi].copy_(src)
                    if shrink is not None:
                        q -= offt[layer]
                        q.addcmul_(torch.sign(q), shrink[layer, :, :nl], value=-1.0)
                    torch.addmm(bias[layer], q, basis[layer, :nl], out=x)
                else:
                    x.copy_(bias[layer].expand(Tq, C))
                xv = x.view(Tq, H, D)
                if rope and kern is not None:
                    kern(x.numpy().reshape(Tq, H, D), cos_np, sin_np)   # in place
                elif rope:   # no numba: the same arithmetic with torch ops
                    xv = xv * cos_full + xv.roll(h, dims=-1) * sin_signed
                out[layer].copy_(xv)

        _split_over_workers(layers, L)
        return out

    @staticmethod
    def _inverse_grouped(sym: "_KeptSymbols", offs: list, P: dict, cal: KvtcCalibration,
                         shape: tuple, rope_from: Optional[int], out_k: torch.Tensor,
                         out_v: torch.Tensor) -> None:
        """K and V [L, Tq, H, D] of a grouped calibration from the symbols of its layer
        groups, written into ``out_k`` / ``out_v`` (views of the model-dtype result).

        Per group g: x = (sym - off) @ B_s[:n_g] + mean, one ``addmm`` [Tq, n_g] x [n_g,
        Cg] (bf16 with float32 accumulation for a bf16 destination on a CPU with bf16 dot
        products, ``_bf16_gemm``; float32 otherwise), then each layer's V slice is copied
        out and its K slice rotated by RoPE from ``rope_from`` (None = no RoPE; the same
        numba kernels as ``_inverse``). Groups are split over ``_decode_pool()`` as
        ``_inverse`` splits layers; each group's arithmetic is the same whatever the thread
        count, so the result does not depend on it."""
        L, Tq, H, D = shape
        C = H * D
        if L == 0 or Tq == 0:
            return
        NG, G = cal.num_groups, cal.group_layers
        keep = P["keep"][0]
        basis = P["basis_ts"]                                              # [NG, n, Cg]
        n, Cg = basis.shape[1], basis.shape[2]
        rope = rope_from is not None
        bf16 = out_k.dtype == torch.bfloat16 and out_v.dtype == torch.bfloat16 and \
            _bf16_gemm()
        if bf16:
            if "basis_ts_bf16" not in P:
                P["basis_ts_bf16"] = P["basis_ts"].to(torch.bfloat16)
                P["mean_bf16"] = P["mean"][:, 0].to(torch.bfloat16)
            basis_h, mean_h = P["basis_ts_bf16"], P["mean_bf16"]
        else:
            offt = torch.tensor(offs, dtype=torch.float32)
            bias = P["mean"][:, 0] - offt[:, None] * P["colsum"]              # [NG, Cg]
        kern = _rope_kernel() if rope else None
        kern16 = _rope_bf16_kernel() if (bf16 and rope and kern is not None) else None
        if rope:
            cos_full, sin_signed, cos_np, sin_np = _rope_tables(rope_from, Tq, D,
                                                                cal.rope_theta)
        h = D // 2

        def groups(idx) -> None:
            with torch.inference_mode():
                _groups(idx)

        def _groups(idx) -> None:
            xb = _scratch.empty((Tq, Cg), dtype=torch.bfloat16 if bf16 else torch.float32)
            # flat operands viewed as contiguous [Tq, nl] (as in ``_inverse``)
            qb = _scratch.empty((Tq * n,), dtype=torch.bfloat16 if bf16 else torch.float32)
            q16 = _scratch.empty((Tq * n,), dtype=torch.int16) if bf16 else None
            kb = _scratch.empty((Tq, C), dtype=xb.dtype) if rope else None
            kf = _scratch.empty((Tq, C), dtype=torch.float32) if rope else None
            for g in idx:
                nl = keep[g]
                if nl:
                    if bf16:
                        q, qi = _rows(qb, Tq, nl), _rows(q16, Tq, nl)
                        for lo, hi, src in sym.pieces(g):
                            qi[:, lo:hi].copy_(src)
                        qi -= offs[g]              # exact integers, exact in bf16
                        q.copy_(qi)
                        torch.addmm(mean_h[g], q, basis_h[g, :nl], out=xb)
                    else:
                        q = _rows(qb, Tq, nl)
                        for lo, hi, src in sym.pieces(g):
                            q[:, lo:hi].copy_(src)
                        torch.addmm(bias[g], q, basis[g, :nl], out=xb)
                else:
                    xb.copy_((mean_h[g] if bf16 else P["mean"][g, 0]).expand(Tq, Cg))
                for j, layer in enumerate(cal.group_layer_ids(g)):
                    ks = xb[:, 2 * j * C:(2 * j + 1) * C]
                    out_v[layer].view(Tq, C).copy_(xb[:, (2 * j + 1) * C:(2 * j + 2) * C])
                    ok = out_k[layer]
                    if not rope:
                        ok.view(Tq, C).copy_(ks)
                        continue
                    if kern16 is not None and ok.is_contiguous():
                        kb.copy_(ks)
                        kern16(kb.view(torch.int16).numpy().view(np.uint16).reshape(Tq, H, D),
                               ok.view(torch.int16).numpy().view(np.uint16), cos_np, sin_np)
                        continue
                    kf.copy_(ks)
                    if kern is not None:
                        kern(kf.numpy().reshape(Tq, H, D), cos_np, sin_np)
                        ok.copy_(kf.view(Tq, H, D))
                    else:
                        xv = kf.view(Tq, H, D)
                        ok.copy_(xv * cos_full + xv.roll(h, dims=-1) * sin_signed)

        _split_over_workers(groups, NG)

    @staticmethod
    def _inverse_ref(sym: np.ndarray, offs: list, P: dict, kv: int, shape: tuple,
                     rope_from: Optional[int], theta: float) -> torch.Tensor:
        """Reference (textbook, slow) inverse of ``_inverse``, float32 [L, Tq, H, D]:
        coefficients c = (sym - off) (centroid: c - shrink sign(c)), x = (c * step) @ B^T
        + mean with the unscaled kept basis, then ``apply_rope`` from ``rope_from``. For
        tests and the decode benchmark only."""
        L, Tq, H, D = shape
        c = torch.from_numpy(np.ascontiguousarray(sym, np.uint8)).to(torch.float32)
        c = c - torch.tensor(offs, dtype=torch.float32)[:, None, None]
        if P.get("shrink") is not None:
            c = c - torch.sign(c) * P["shrink"][kv]
        x = torch.bmm(c * P["step"][kv], P["basis_t"][kv]) + P["mean"][kv]
        x = x.reshape(L, Tq, H, D)
        if rope_from is not None:
            x = apply_rope(x, torch.arange(rope_from, rope_from + Tq), theta)
        return x


# -------------------------------------------------------------------------- calibrations as bytes
# (issue 25.5: an entry's calibration travels with it through the KV store; the store
# keeps the artifact under cal/<hash>, a reader that lacks it fetches it once)
def has_calibration(h: str) -> bool:
    """True when calibration ``h`` is registered in this process or its artifact is in the
    cache folder (``default_calibration_dir()/<h>.safetensors``; verified when loaded)."""
    if not isinstance(h, str) or not _HASH_RE.match(h):
        return False
    with _LOCK:
        if h in _CALIBRATIONS:
            return True
    return (default_calibration_dir() / f"{h}.safetensors").is_file()


def calibration_bytes(h: str) -> bytes:
    """The artifact file bytes (safetensors + JSON metadata, as ``KvtcCalibration.save``
    writes them) of calibration ``h`` (registered or in the cache folder). Raises
    CodecError when it is not available."""
    import tempfile

    cal = get_calibration(h)
    with tempfile.TemporaryDirectory(prefix="cgh-cal-") as d:
        return cal.save(Path(d) / f"{h}.safetensors").read_bytes()


def calibration_from_bytes(data: bytes, expected_hash: str, cache: bool = True
                           ) -> KvtcCalibration:
    """Read an artifact received as bytes (e.g. from the KV store), verify it
    (``load_calibration``: format, shapes, finiteness, content hash = recorded hash; no
    pickle) and that its hash is ``expected_hash``, register it and (cache=True) keep it
    in the cache folder so later processes find it. Raises CodecError."""
    import tempfile

    if not isinstance(expected_hash, str) or not _HASH_RE.match(expected_hash):
        raise CodecError(f"invalid KVTC calibration hash {expected_hash!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"calibration data must be bytes, got {type(data).__name__}")
    with tempfile.TemporaryDirectory(prefix="cgh-cal-") as d:
        p = Path(d) / f"{expected_hash}.safetensors"
        p.write_bytes(bytes(data))
        cal = load_calibration(p)
    if cal.hash != expected_hash:
        raise CodecError(f"received calibration has hash {cal.hash[:16]}..., expected "
                         f"{expected_hash[:16]}...")
    register_calibration(cal)
    if cache:
        try:
            folder = default_calibration_dir()
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / f"{cal.hash}.safetensors").is_file():
                cal.save(folder)
        except OSError:
            pass  # registered in this process; the next process fetches it again
    return cal
