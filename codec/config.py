"""Codec configuration: per-layer bin schedules for keys and values, chunking, quantizer variant.

Uses the layer-wise schedules of CacheGen (Liu et al., SIGCOMM 2024, section 5.2) as LMCache
and the CacheGen artifact define them, derived for ANY layer count, plus the harness's own
measured schedules (docs/codec.md).

Presets::

    CodecConfig.for_model(num_layers=30)                           # harness default (level 1)
    CodecConfig.for_model(30, level=0, variant="reference")        # LMCache default schedule
    CodecConfig.from_yaml("configs/codec.yaml", num_layers=30)

The schedules themselves (``QuantizationSpec``, ``reference_schedule`` of the reference
variant's levels 0-3, ``harness_schedule``, ``HARNESS_LEVELS``) are codec/schedules.py's.

The ``variant`` selects the quantizer: ``"reference"`` is LMCache's (one scale per
(layer, token) over all channels, scales stored in the model's dtype) with the levels
above; ``"harness"`` is this project's measured improvement: one quantization step per
(layer, KV head) over the chunk ("chunk_head"), the first ``sink_tokens`` tokens stored
exactly, uniform bins per level 0-5 (``HARNESS_LEVELS``; docs/codec.md has the
measurements behind every choice).

``python -m bench.schedules 30`` prints the schedules of every level for 30 layers.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "QuantizationSpec",
    "CodecConfig",
    "HARNESS_DEFAULT_LEVEL",
    "REFERENCE_DEFAULT_LEVEL",
    "SCALE_GROUPS",
    "SCALE_FORMATS",
]

# Block sizes of the engines the chunks are fed to: vLLM CPU uses 128-token KV blocks,
# GPU vLLM 16. Chunks must be a multiple of the smaller one; use 128 multiples for vLLM CPU.
MIN_BLOCK_TOKENS = 16
DEFAULT_CHUNK_TOKENS = 1024  # 1K tokens per independently decodable chunk
# one scale per (layer, token) | per (layer, token, KV head) | per (layer, KV head) over the chunk
SCALE_GROUPS = ("token", "head", "chunk_head")
SCALE_FORMATS = ("dtype", "log8")    # scale stored in the model dtype | log-quantized uint8
VARIANTS = ("reference", "harness")

# The level schedules live in codec.schedules (import them from there).
from .schedules import (HARNESS_DEFAULT_LEVEL, HARNESS_SINK_TOKENS,  # noqa: E402
                        REFERENCE_DEFAULT_LEVEL, QuantizationSpec, harness_schedule,
                        reference_schedule)


@dataclass(frozen=True)
class CodecConfig:
    """Everything the ``cachegen`` quantizer and coder need, besides the KV itself.

    Fields:
      num_layers: model depth L (>= 1).
      key_specs / value_specs: contiguous QuantizationSpec ranges covering [0, L) exactly.
      level: schedule name (int) recorded in headers and results; None for custom schedules.
      chunk_tokens: tokens per independently decodable chunk (multiple of 16, the GPU
        vLLM block size; use a multiple of 128 for vLLM CPU).
      scale_group: "token" = one scale per (layer, token) over all H*D channels (LMCache);
        "head" = one scale per (layer, token, KV head) over D channels; "chunk_head" = one
        scale per (layer, KV head) over the chunk's (non-sink) tokens: a uniform
        quantization step, which entropy coding turns into the best rate for the error.
      scale_format: "dtype" = scales stored in the model's dtype (exact: the max of dtype
        values); "log8" = uint8 code c, scale = ldexp(MANT[c % 8], e0 + c // 8), rounded UP.
      sink_tokens: the first ``sink_tokens`` tokens of a context (chunk starting at token 0)
        are stored exactly in the model dtype (attention sinks carry outliers).
      channels_per_stream / tokens_per_stream: rANS stream layout (docs/bitstream.md sec. 3).
    Raises ValueError on inconsistent values.
    """

    num_layers: int
    key_specs: tuple[QuantizationSpec, ...]
    value_specs: tuple[QuantizationSpec, ...]
    level: Optional[int] = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    scale_group: str = "token"
    scale_format: str = "dtype"
    sink_tokens: int = 0
    channels_per_stream: int = 16  # docs/bitstream.md 4.3: 16 channels x T tokens per stream
    tokens_per_stream: Optional[int] = None
    variant: str = "custom"

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) \
                or self.num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {self.num_layers!r}")
        # accept lists / dicts (from YAML or JSON) and normalise to tuples of specs
        object.__setattr__(self, "key_specs", _coerce_specs(self.key_specs, "key_specs"))
        object.__setattr__(self, "value_specs", _coerce_specs(self.value_specs, "value_specs"))
        for name in ("key_specs", "value_specs"):
            specs = getattr(self, name)
            if not specs:
                raise ValueError(f"{name} is empty")
            pos = 0
            for s in specs:
                if s.start_layer != pos:
                    raise ValueError(
                        f"{name} must be contiguous from layer 0: expected a spec starting at "
                        f"{pos}, got [{s.start_layer}, {s.end_layer})")
                pos = s.end_layer
            if pos != self.num_layers:
                raise ValueError(f"{name} cover layers [0, {pos}) but the model has "
                                 f"{self.num_layers} layers")
        if self.level is not None and (isinstance(self.level, bool)
                                       or not isinstance(self.level, int)):
            raise ValueError(f"level must be an int or None, got {self.level!r}")
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) \
                or self.chunk_tokens < MIN_BLOCK_TOKENS or self.chunk_tokens % MIN_BLOCK_TOKENS:
            raise ValueError(f"chunk_tokens must be a positive multiple of {MIN_BLOCK_TOKENS} "
                             f"(the GPU vLLM KV block size), got {self.chunk_tokens!r}")
        _choice(self.scale_group, SCALE_GROUPS, "scale_group")
        _choice(self.scale_format, SCALE_FORMATS, "scale_format")
        _choice(self.variant, VARIANTS + ("custom",), "variant")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) \
                or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if isinstance(self.channels_per_stream, bool) or not isinstance(
                self.channels_per_stream, int) or self.channels_per_stream < 1:
            raise ValueError(f"channels_per_stream must be an int >= 1, "
                             f"got {self.channels_per_stream!r}")
        if self.tokens_per_stream is not None and (
                isinstance(self.tokens_per_stream, bool)
                or not isinstance(self.tokens_per_stream, int) or self.tokens_per_stream < 1):
            raise ValueError(f"tokens_per_stream must be None or an int >= 1, "
                             f"got {self.tokens_per_stream!r}")

    # ---- derived -----------------------------------------------------------------------
    @property
    def key_bins(self) -> list[int]:
        """Bins per layer for keys, length num_layers."""
        return _per_layer(self.key_specs, self.num_layers)

    @property
    def value_bins(self) -> list[int]:
        """Bins per layer for values, length num_layers."""
        return _per_layer(self.value_specs, self.num_layers)

    # ---- presets -----------------------------------------------------------------------
    @classmethod
    def for_model(cls, num_layers: int, level: Optional[int] = None,
                  variant: str = "harness", **overrides: Any) -> "CodecConfig":
        """Preset for a model of ``num_layers`` layers.

        ``level`` None -> the variant's default (harness: HARNESS_DEFAULT_LEVEL = 1;
        reference: 0). ``variant="reference"``: LMCache's quantizer and the LMCache
        (level 0) / artifact (1-3) schedules; ``variant="harness"``: this project's
        quantizer and levels 0-5 (``HARNESS_LEVELS``). ``overrides`` replace any other
        field.
        Raises ValueError for unknown levels/variants or bad overrides.
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if variant == "reference":
            level = REFERENCE_DEFAULT_LEVEL if level is None else level
            ks, vs = reference_schedule(num_layers, level)
            base: dict[str, Any] = dict(scale_group="token", scale_format="dtype",
                                        sink_tokens=0)
        elif variant == "harness":
            level = HARNESS_DEFAULT_LEVEL if level is None else level
            ks, vs = harness_schedule(num_layers, level)
            base = dict(scale_group="chunk_head", scale_format="dtype",
                        sink_tokens=HARNESS_SINK_TOKENS)
        else:
            raise ValueError(f"unknown variant {variant!r}; variants are {list(VARIANTS)}")
        base.update(overrides)
        return cls(num_layers=num_layers, key_specs=ks, value_specs=vs, level=level,
                   variant=variant, **base)

    @classmethod
    def lmcache(cls, num_layers: int, **overrides: Any) -> "CodecConfig":
        """LMCache's default schedule and quantizer (level 0, reference variant)."""
        return cls.for_model(num_layers, 0, variant="reference", **overrides)

    @classmethod
    def uniform(cls, num_layers: int, key_bins: int, value_bins: int,
                **overrides: Any) -> "CodecConfig":
        """Same bins on every layer (custom schedule, level None unless overridden)."""
        return cls(num_layers=num_layers,
                   key_specs=(QuantizationSpec(0, num_layers, key_bins),),
                   value_specs=(QuantizationSpec(0, num_layers, value_bins),), **overrides)

    # ---- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict; ``CodecConfig.from_dict(c.to_dict()) == c``."""
        d = dataclasses.asdict(self)
        d["key_specs"] = [[s.start_layer, s.end_layer, s.bins] for s in self.key_specs]
        d["value_specs"] = [[s.start_layer, s.end_layer, s.bins] for s in self.value_specs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CodecConfig":
        """Inverse of ``to_dict``; unknown keys raise ValueError listing the valid ones."""
        if not isinstance(d, dict):
            raise ValueError(f"codec config must be a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown codec config keys {sorted(unknown)}; "
                             f"valid keys are {sorted(names)}")
        try:
            return cls(**d)
        except TypeError as e:  # missing required fields
            raise ValueError(f"bad codec config: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, num_layers: int, level: Optional[int] = None
                  ) -> "CodecConfig":
        """Load ``configs/codec*.yaml``.

        The YAML has ``variant`` and ``level`` (a preset, scaled to ``num_layers``) and
        optional field overrides (``chunk_tokens``, ``sink_tokens``, ...); or explicit
        ``key_specs``/``value_specs`` as ``[[start, end, bins], ...]`` or the keyword
        ``all`` bins: ``key_bins: 16``. ``level`` given here overrides the file's.
        Raises ValueError on a bad file.
        """
        import yaml  # PyYAML; imported lazily so the codec imports without it

        try:
            doc = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read codec config {path}: {e}") from None
        if doc is not None and not isinstance(doc, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        doc = dict(doc or {})
        doc.pop("codec", None)
        names = {f.name for f in dataclasses.fields(cls)} | {"variant", "level", "key_bins",
                                                            "value_bins"}
        unknown = set(doc) - names
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}; valid keys are "
                             f"{sorted(names - {'num_layers'})}")  # the codec name is the API's business
        variant = doc.pop("variant", "harness")
        file_level = doc.pop("level", None)
        lvl = file_level if level is None else level
        key_bins, value_bins = doc.pop("key_bins", None), doc.pop("value_bins", None)
        if key_bins is not None or value_bins is not None:
            if key_bins is None or value_bins is None:
                raise ValueError(f"{path}: give both key_bins and value_bins")
            return cls.uniform(num_layers, int(key_bins), int(value_bins),
                               level=lvl, **doc)
        if "key_specs" in doc or "value_specs" in doc:
            return cls(num_layers=num_layers, level=lvl, **doc)
        return cls.for_model(num_layers, lvl, variant=variant, **doc)

    def replace(self, **changes: Any) -> "CodecConfig":
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line: schedule and variant, e.g. for tables."""
        f = lambda specs: "/".join(f"{s.bins}@{s.start_layer}" for s in specs)
        return (f"level={self.level} variant={self.variant} K={f(self.key_specs)} "
                f"V={f(self.value_specs)} scales={self.scale_group}/{self.scale_format} "
                f"sinks={self.sink_tokens}")


def _choice(v: Any, options: tuple, name: str) -> None:
    if v not in options:
        raise ValueError(f"{name} must be one of {list(options)}, got {v!r}")


def _coerce_specs(specs: Any, name: str) -> tuple[QuantizationSpec, ...]:
    out = []
    if isinstance(specs, QuantizationSpec):
        specs = (specs,)
    if not isinstance(specs, (list, tuple)):
        raise ValueError(f"{name} must be a sequence of QuantizationSpec, got {specs!r}")
    for s in specs:
        if isinstance(s, QuantizationSpec):
            out.append(s)
        elif isinstance(s, dict):
            out.append(QuantizationSpec(**s))
        elif isinstance(s, (list, tuple)) and len(s) == 3:
            out.append(QuantizationSpec(*s))
        else:
            raise ValueError(f"{name}: cannot read spec {s!r} (want [start, end, bins])")
    return tuple(out)


def _per_layer(specs: tuple[QuantizationSpec, ...], num_layers: int) -> list[int]:
    bins = [0] * num_layers
    for s in specs:
        for layer in range(s.start_layer, s.end_layer):
            bins[layer] = s.bins
    return bins
