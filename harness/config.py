"""The benchmark's run configuration: YAML defaults (configs/benchmark.yaml) + CLI flags.

Every field maps one-to-one onto a ``run_benchmarks.py`` flag; flags override the YAML.
``--quick`` shrinks the run to a smoke test of a few minutes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codec import level_table as _level_table  # standard library only
from cachegen_common.config_file import ConfigFileError, load_config
from cachegen_common.flags import LINK_METHODS
from cachegen_common.units import check_bandwidth_mbps
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts.user_data import check_data_flags
from streaming.adapt.params import DEFAULT_PRESET, POLICY_PRESETS  # standard library only

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "benchmark.yaml"
ALL_MODES = ("text", "raw", "quant8", "kivi2", "kivi4", "fp8", "cachegen", "cachegen-adaptive",
             "kvtc")
ENGINES = ("vllm", "hf")
# --quick: sizes of a smoke run of a few minutes on 2 CPU cores
QUICK_CONTEXT_TOKENS = 1024  # about a second of HF prefill per context for the default model
QUICK_CHUNK_TOKENS = 256  # 4 chunks of a 1024-token context: the step trace changes rate mid-load
QUICK_PPL_CONTEXT_TOKENS = 512  # the perplexity pass encodes every variant once per context
# the codecs' default levels and level lists, from the torch-free codec.level_table (parsing
# flags must not load torch; tests/codec/test_codec_level_table.py checks the table against the codec)
QUICK_LEVELS = (_level_table.default_level("cachegen"),)
QUICK_KVTC_LEVELS = (_level_table.default_level("kvtc"),)
CACHEGEN_LEVELS = _level_table.levels("cachegen")
KVTC_LEVELS = _level_table.levels("kvtc")
DEFAULT_OUT = "benchmarks/results.json"
QUICK_OUT = "benchmarks/results-quick.json"  # --quick without --out: never the committed file


class ConfigError(ValueError):
    """An invalid benchmark configuration (bad YAML, unknown key, bad value)."""


@dataclass(frozen=True)
class RunConfig:
    """Resolved configuration of one benchmark run (see configs/benchmark.yaml for units)."""

    bandwidth_mbps: tuple[float, ...] = (100.0, 500.0, 1000.0)
    modes: tuple[str, ...] = ("text", "raw", "quant8", "kivi2", "cachegen", "cachegen-adaptive",
                              "kvtc")
    # the default run's levels, as configs/benchmark.yaml (tests/project/test_entry_flags.py checks
    # every field against the file); None = every level of the codec
    levels: tuple[int, ...] | None = (0, 1, 3, 5)
    kvtc_levels: tuple[int, ...] | None = (4,)
    # a quality target instead of levels (codec.operating_points: near-lossless, lmcache, kl:X):
    # cachegen and kvtc then run at the model's operating point (harness.targets); None = the levels,
    # cachegen's default level being the model's lmcache point (resolved and recorded)
    target: str | None = None
    engine: str = "vllm"
    # vLLM only: keep its hybrid KV cache manager on (third_party/vllm/hma_connector.py,
    # asynchronous loads); false = off, every layer keeps every token (kv_groups.py)
    vllm_hybrid_kv: bool = False
    # sliding-window storage of the store's entries (codec.window): "auto" = on for a model
    # with sliding-window layers (each keeps its last window + one block of tokens), with
    # vllm_hybrid_kv or without; "off" = every layer stores every token
    window_storage: str = "auto"
    model: str | None = None
    tasks: tuple[str, ...] = ("needle",)
    context_tokens: int = 4096
    num_contexts: int = 3
    repeats: int = 2
    slo_s: float = 1.0
    policy_preset: str = DEFAULT_PRESET  # the cachegen-adaptive row's PolicyParams preset
    chunk_tokens: int = 1024
    block_tokens: int = 128
    # true = load only whole KV blocks (the engine prefills the context's partial last block
    # with the question); false = load the whole context (the vLLM connector loads a partial
    # last block). vllm_hybrid_kv always loads whole blocks (CacheGenHMAConnector).
    whole_blocks: bool = False
    store: str | None = None
    link_method: str = "auto"
    quality: bool = True
    ppl_contexts: int = 2
    ppl_context_tokens: int = 2048
    traces: tuple[str, ...] = ("constant", "step", "artifact")
    seed: int = 0
    data_path: str | None = None
    data_map: dict[str, str] | None = None
    truncate: bool = True
    out: str = DEFAULT_OUT
    quick: bool = False

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise ConfigError(f"unknown mode(s) {bad}; available: {', '.join(ALL_MODES)}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; available: {', '.join(ENGINES)}")
        if not self.bandwidth_mbps:
            raise ConfigError("bandwidth_mbps must list at least one rate in Mbit/s")
        for b in self.bandwidth_mbps:
            try:
                check_bandwidth_mbps(b)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        for name in ("context_tokens", "num_contexts", "repeats", "chunk_tokens", "block_tokens",
                     "ppl_contexts", "ppl_context_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.chunk_tokens % self.block_tokens:
            raise ConfigError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of "
                              f"block_tokens ({self.block_tokens})")
        for name, known in (("levels", CACHEGEN_LEVELS), ("kvtc_levels", KVTC_LEVELS)):
            bad = [x for x in (getattr(self, name) or ()) if x not in known]
            if bad:
                raise ConfigError(f"unknown {name} {bad}; available: {', '.join(map(str, known))}")
        if self.target is not None:
            from codec.operating_points import parse_target  # standard library only

            try:
                parse_target(self.target)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.slo_s <= 0:
            raise ConfigError("slo_s must be > 0 seconds")
        if self.policy_preset not in POLICY_PRESETS:
            raise ConfigError(f"unknown policy_preset {self.policy_preset!r}; available: "
                              f"{', '.join(POLICY_PRESETS)}")
        if not isinstance(self.whole_blocks, bool):
            raise ConfigError(f"whole_blocks must be true or false, got {self.whole_blocks!r}")
        if not isinstance(self.vllm_hybrid_kv, bool):
            raise ConfigError(f"vllm_hybrid_kv must be true or false, got {self.vllm_hybrid_kv!r}")
        if self.vllm_hybrid_kv and self.engine != "vllm":
            raise ConfigError("vllm_hybrid_kv (--vllm-hybrid-kv) needs --engine vllm")
        if self.window_storage not in ("auto", "off"):
            raise ConfigError(f"window_storage must be auto or off, got {self.window_storage!r}")
        if self.link_method not in LINK_METHODS:
            raise ConfigError(f"link_method must be {', '.join(LINK_METHODS[:-1])} or {LINK_METHODS[-1]}")
        try:
            check_data_flags(self.tasks, self.data_path, self.data_map)
        except ExtractionError as exc:
            raise ConfigError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able snapshot (saved into results.json)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    def quick_variant(self) -> "RunConfig":
        """A smoke run: one short context, one repeat, at most two cachegen (and two kvtc)
        levels, one trace."""
        chunk = QUICK_CHUNK_TOKENS if QUICK_CHUNK_TOKENS % self.block_tokens == 0 else self.chunk_tokens
        return dataclasses.replace(
            self, context_tokens=min(self.context_tokens, QUICK_CONTEXT_TOKENS), num_contexts=1,
            repeats=1, levels=(self.levels or QUICK_LEVELS)[:2],
            kvtc_levels=(self.kvtc_levels or QUICK_KVTC_LEVELS)[:2], ppl_contexts=1,
            ppl_context_tokens=min(self.ppl_context_tokens, QUICK_PPL_CONTEXT_TOKENS),
            traces=("step",) if self.traces else (), quick=True,
            chunk_tokens=min(self.chunk_tokens, chunk),
            out=QUICK_OUT if self.out == DEFAULT_OUT else self.out)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a config file (YAML; TOML or JSON by suffix: ``cachegen_common.config_file.load_config``) into
    a dict; ConfigError on missing/malformed files or unknown keys."""
    try:
        data = load_config(path)
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config {path}: unknown key(s) {unknown}; known: {sorted(known)}")
    return data


def resolve(yaml_path: Path | None, overrides: dict[str, Any]) -> RunConfig:
    """Merge YAML defaults with CLI overrides (None = not given) into a validated RunConfig."""
    data = load_yaml(yaml_path or DEFAULT_CONFIG)
    if overrides.get("target") is not None and any(overrides.get(k) is not None for k in ("levels", "kvtc_levels")):
        raise ConfigError("--target picks the levels from the model's operating points: leave out "
                          "--levels / --kvtc-levels")
    data.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("bandwidth_mbps", "modes", "levels", "kvtc_levels", "tasks", "traces"):
        if data.get(key) is not None:
            data[key] = tuple(data[key])
    if data.get("bandwidth_mbps"):
        data["bandwidth_mbps"] = tuple(float(b) for b in data["bandwidth_mbps"])
    try:
        cfg = RunConfig(**data)
    except TypeError as exc:
        raise ConfigError(f"bad configuration: {exc}") from None
    return cfg.quick_variant() if cfg.quick else cfg
