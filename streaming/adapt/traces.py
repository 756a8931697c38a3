"""Bandwidth traces for the adaptation experiments (CacheGen section 5 / 7.4).

A trace is a list of Mbit/s values, one per context chunk. Sources:
* constant(mbps, n) and step(values_mbps, chunks_per_step, n);
* artifact_generator(n, count, seed): fresh traces from the artifact's own generator (i.i.d.
  uniform 0.1-10 Gbit/s per chunk, scaled like the recorded ones) - a held-out evaluation set;
* the CacheGen artifact's traces, carried in this repository (streaming/adapt/traces_data/, copied
  from the public artifact github.com/UChi-JCL/CacheGen test_data/; source and license in
  its README): one JSON object {"bw": [Gbit/s per chunk]} per line, scaled by `scale`
  (default 1/10: the artifact's 0.1-10 Gbit/s become 10-1000 Mbit/s for this machine's
  links - results must say so; the scale is returned with the trace). The 10 recorded
  traces are bw_traces_gbps.jsonl, the generated ones generated_trace_gbps.jsonl.
apply_trace(link, trace) returns a hook for stream_load(before_chunk=...): it changes the
shaper's rate just before chunk k is requested, i.e. during the transfer of the context.
Not runnable by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from cachegen_common.bounded_json import parse as parse_bounded_json

ARTIFACT_DIR = Path(__file__).resolve().parent / "traces_data"
RECORDED_FILE = "bw_traces_gbps.jsonl"
GENERATED_FILE = "generated_trace_gbps.jsonl"
DEFAULT_SCALE = 0.1  # artifact Gbit/s * 1000 * 0.1 -> Mbit/s on this machine
MIN_MBPS = 1.0


@dataclass(frozen=True)
class Trace:
    name: str
    mbps: tuple[float, ...]
    source: str = "synthetic"
    scale: float = 1.0  # factor applied to the source values (after Gbit/s -> Mbit/s)

    def at(self, k: int) -> float:
        """Rate for chunk k (the last value repeats past the end)."""
        return self.mbps[min(k, len(self.mbps) - 1)]

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "scale": self.scale, "mbps": list(self.mbps)}


def artifact_recorded(scale: float = DEFAULT_SCALE) -> list[Trace]:
    """The artifact's 10 recorded traces (Mbit/s after scale)."""
    return load_artifact_traces(ARTIFACT_DIR / RECORDED_FILE, scale)


def artifact_generated(scale: float = DEFAULT_SCALE) -> list[Trace]:
    """The artifact's generated traces (Mbit/s after scale)."""
    return load_artifact_traces(ARTIFACT_DIR / GENERATED_FILE, scale)


def constant(mbps: float, n: int) -> Trace:
    return Trace(f"constant-{mbps:g}", tuple([float(mbps)] * n))


def step(values_mbps: Sequence[float], chunks_per_step: int, n: int | None = None) -> Trace:
    """E.g. step([500, 50, 500], 3) -> 3 chunks at 500, 3 at 50, 3 at 500."""
    if chunks_per_step < 1 or not values_mbps:
        raise ValueError("step needs values and chunks_per_step >= 1")
    out = [float(v) for v in values_mbps for _ in range(chunks_per_step)]
    if n is not None:
        out = (out + [out[-1]] * n)[:n]
    return Trace("step-" + "-".join(f"{v:g}" for v in values_mbps), tuple(out))


# A trace line is {"bw": [Gbit/s per chunk]}: a few bytes per chunk; 16 MiB is millions of
# chunks, and a line over it (or nested deeper than that list) is not a trace.
MAX_LINE_BYTES = 16 << 20


def load_artifact_traces(path: str | Path | None = None, scale: float = DEFAULT_SCALE) -> list[Trace]:
    """Traces from an artifact jsonl (Gbit/s per chunk) -> Mbit/s * scale, floored at 1 Mbit/s.
    Default: every *.jsonl in ARTIFACT_DIR. Raises ValueError on a malformed line."""
    paths = [Path(path)] if path else sorted(ARTIFACT_DIR.glob("*.jsonl"))
    if not paths:
        raise ValueError(f"no trace files found ({path or ARTIFACT_DIR})")
    traces = []
    for p in paths:
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                bw = parse_bounded_json(line, what="trace line", max_bytes=MAX_LINE_BYTES, max_depth=2,
                                        expect=dict)["bw"]
                vals = tuple(max(MIN_MBPS, float(g) * 1000.0 * scale) for g in bw)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{p}:{i + 1}: not a {{'bw': [...]}} trace line: {e}") from None
            if not vals:
                raise ValueError(f"{p}:{i + 1}: empty trace")
            traces.append(Trace(f"{p.stem}-{i}", vals, _source_name(p), scale))
    return traces


def _source_name(p: Path) -> str:
    """A trace file as results name it: relative to the repository for the carried artifact
    traces (streaming/adapt/traces_data/...), so result files hold no machine's paths; else as given."""
    try:
        return Path(p).resolve().relative_to(ARTIFACT_DIR.resolve().parents[2]).as_posix()
    except ValueError:
        return str(p)


@dataclass
class TraceHook:
    """Callable hook(k): sets link rate to trace.at(k) before chunk k; records what it set."""

    link: object
    trace: Trace
    applied: list[tuple[int, float]] = field(default_factory=list)

    def __call__(self, k: int) -> None:
        r = self.trace.at(k)
        if not self.applied or self.applied[-1][1] != r:
            self.link.set_rate(r)
        self.applied.append((k, r))


def apply_trace(link, trace: Trace) -> TraceHook:
    """Hook for stream_load(before_chunk=...) that drives `link` (a ShapedLink) by `trace`."""
    return TraceHook(link, trace)


def synthetic_uniform(n: int, count: int, seed: int = 0, lo_mbps: float = 10.0,
                      hi_mbps: float = 1000.0) -> list[Trace]:
    """`count` traces of n chunks, each chunk's rate drawn independently and uniformly from
    [lo_mbps, hi_mbps] (numpy default_rng(seed)). A tuning set for the adaptive policy that
    shares no values with the artifact's recorded traces (which stay the evaluation set); the
    range is this project's link range (10-1000 Mbit/s), not fitted to the recorded traces."""
    import numpy as np

    if n < 1 or count < 0 or not 0 < lo_mbps <= hi_mbps:
        raise ValueError("need n >= 1, count >= 0 and 0 < lo_mbps <= hi_mbps")
    rng = np.random.default_rng(seed)
    return [Trace(f"synthetic-uniform-{seed}-{i}", tuple(float(x) for x in rng.uniform(lo_mbps, hi_mbps, n)),
                  source=f"synthetic: iid uniform [{lo_mbps:g}, {hi_mbps:g}] Mbit/s per chunk, seed {seed}")
            for i in range(count)]


ARTIFACT_GBPS_RANGE = (0.1, 10.0)  # the artifact's traces: each chunk i.i.d. uniform in this range (Gbit/s)
GENERATOR_SEED = 15  # artifact_generator's default seed: used by no tuning set (those use 1, 2, 3)


def artifact_generator(n: int, count: int, seed: int = GENERATOR_SEED, scale: float = DEFAULT_SCALE,
                       lo_gbps: float = ARTIFACT_GBPS_RANGE[0], hi_gbps: float = ARTIFACT_GBPS_RANGE[1]) -> list[Trace]:
    """`count` traces of n chunks drawn the way the CacheGen artifact's recorded traces
    (github.com/UChi-JCL/CacheGen, test_data/) are described: each chunk's bandwidth i.i.d.
    uniform in 0.1-10 Gbit/s (their 100 recorded values fit it: Kolmogorov-Smirnov D = 0.055,
    p = 0.92; lag-1 autocorrelation -0.06), then scaled like the recorded ones: Gbit/s * 1000 * scale -> Mbit/s,
    floored at MIN_MBPS (default scale 1/10: 10-1000 Mbit/s). numpy default_rng(seed); the
    default seed (GENERATOR_SEED = 15) is used by no tuning set of the adaptive policy, so the
    set is a HELD-OUT evaluation set from the recorded traces' own generator (bench.adapt's
    trace_set "artifact-generator"). Names "artifact-generator-<seed>-<i>".
    Raises ValueError when n < 1, count < 0, scale <= 0 or not 0 < lo_gbps <= hi_gbps."""
    import numpy as np

    if n < 1 or count < 0 or scale <= 0 or not 0 < lo_gbps <= hi_gbps:
        raise ValueError("need n >= 1, count >= 0, scale > 0 and 0 < lo_gbps <= hi_gbps")
    rng = np.random.default_rng(seed)
    src = (f"artifact generator: iid uniform [{lo_gbps:g}, {hi_gbps:g}] Gbit/s per chunk (as the CacheGen "
           f"artifact's recorded traces are described), seed {seed}, x 1000 x scale -> Mbit/s")
    return [Trace(f"artifact-generator-{seed}-{i}",
                  tuple(max(MIN_MBPS, float(g) * 1000.0 * scale) for g in rng.uniform(lo_gbps, hi_gbps, n)),
                  source=src, scale=scale)
            for i in range(count)]
