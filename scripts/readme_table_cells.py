"""Markers, loaders and cell formatting shared by the README table generator
(``scripts/readme_tables.py``): block markers, :class:`ReadmeTableError`,
:func:`load_results` / :func:`load_optional` and the number formats of the cells."""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the project's packages
    sys.path.insert(0, str(ROOT))

from codec import level_table  # noqa: E402  (torch-free)
from evaluation.summary import summarize  # noqa: E402
from visualize.loading import read_json_doc  # noqa: E402  (stdlib only)


START = "<!-- results-table:start -->"
END = "<!-- results-table:end -->"
QUALITY_START = "<!-- quality-table:start -->"
QUALITY_END = "<!-- quality-table:end -->"
ADAPT_START = "<!-- adaptation-table:start -->"
ADAPT_END = "<!-- adaptation-table:end -->"
HEADLINE_START = "<!-- headline-table:start -->"
HEADLINE_END = "<!-- headline-table:end -->"
# The headline rows: (mode, level); None = the codec's default level.
HEADLINE_ROWS = (("text", None), ("quant8", None), ("cachegen", "default"), ("kvtc", "default"))
QUALITY_ABSENT = "Not yet measured: run `python -m bench.quality` (writes `benchmarks/quality.json`).\n"
ADAPT_ABSENT = "Not yet measured: run `python -m bench.adapt` (writes `benchmarks/adaptation.json`).\n"
# Row order of the table; modes not listed follow in name order.
MODE_ORDER = level_table.MODE_ORDER
# Published figures quoted beside ours (CacheGen, Liu et al., SIGCOMM 2024, arXiv:2310.07240).
PAPER_TTFT_VS_QUANT8 = "1.67-1.81x"
PAPER_TTFT_VS_TEXT = "3.1-4.7x"


class ReadmeTableError(ValueError):
    """Unreadable results file, or README without the markers."""



def isa_note(env: dict) -> str:
    """" (oneDNN: <matmul kernel>)" from ``environment.numerics`` (what set the numerics of
    the run: AMX, AVX-512 or AVX2 kernels), "" for files without it."""
    impl = (env.get("numerics") or {}).get("onednn_matmul_impl")
    return f" (oneDNN bf16 matmul `{impl}`)" if impl else ""

def load_results(path: Path) -> dict[str, Any]:
    """The results document. Raises ReadmeTableError when unreadable or without runs."""
    return read_json_doc(path, "results", "runs", error=ReadmeTableError)


def load_optional(path: Path, what: str, key: str = "rows") -> dict[str, Any] | None:
    """A quality.json / adaptation.json document, or None when the file does not exist.
    Raises ReadmeTableError when it exists but is unreadable or has no ``key`` list."""
    path = Path(path)
    if not path.exists():
        return None
    return read_json_doc(path, what, key, error=ReadmeTableError)


def doc_sections(doc: dict[str, Any], *keys: str) -> list[Any]:
    """``doc[key] or {}`` for each of ``keys`` (the object sections of a result file), then
    its ``wall_s`` (None when absent)."""
    return [doc.get(k) or {} for k in keys] + [doc.get("wall_s")]


def summaries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The file's summaries, else summarize(runs) (the figures' rule)."""
    rows = doc.get("summaries")
    if isinstance(rows, list) and rows:
        return rows
    return summarize(doc["runs"], doc.get("failures"), (doc.get("config") or {}).get("bandwidth_mbps"))


def mode_key(mode: str, level: Any) -> tuple:
    idx = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
    return (idx, mode, -1 if level is None else level)


def mode_default_level(mode: str, doc: dict | None = None) -> Any:
    """The default level of ``mode`` in a run: the level of its default operating point
    when results.json ``doc`` records one (``operating_points`` with role "default": the
    model's ``lmcache`` point, what level=None means), else the codec's default level (None
    when unknown or the codec has no levels)."""
    ops = (doc or {}).get("operating_points") or {}
    if ops.get("role") == "default":
        for p in ops.get("points") or []:
            if p.get("codec") == mode:
                return p.get("level")
    try:
        return level_table.default_level(mode)
    except Exception:  # noqa: BLE001 - not a codec (text, adaptive) or codec unavailable
        return None


def fmt_or(v: Any, fmt: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, fmt)


def fmt_mb(v: float) -> str:
    return "0" if v == 0 else f"{v / 1e6:.1f} MB"


def one_or_range(vals: list[float], fmt) -> str:
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} - {fmt(hi)}"


def fmt_ppl(v: float) -> str:
    return f"{v:+.2f}%" if v != 0 else "0.00%"


def fmt_kl(v: float) -> str:
    return "0" if v == 0 else f"{v:.2g}"


def fmt_ratio(v: float) -> str:
    return f"{v:.2f}x"


def fmt_g(v: Any) -> str:
    """3 significant digits; exact 0 as "0"."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "0" if v == 0 else f"{v:.3g}"


def fmt_ci(v: Any, ci: Any, fmt) -> str:
    """``value [lo, hi]``; the bare value when the CI is missing."""
    if v is None:
        return "-"
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci):
        return f"{fmt(v)} [{fmt(ci[0])}, {fmt(ci[1])}]"
    return f"{fmt(v)} [no CI]"


def quality_rows(qdoc: dict[str, Any] | None) -> dict[tuple, dict[str, Any]]:
    """quality.json rows keyed by (codec, level)."""
    if not qdoc:
        return {}
    return {(r.get("codec"), r.get("level")): r for r in qdoc.get("rows") or [] if isinstance(r, dict)}


def quality_kl_cell(q: dict[str, Any] | None) -> str:
    if not q or q.get("kl") is None:
        return "-"
    return f"{fmt_ci(q['kl'], q.get('kl_ci'), fmt_g)} (n={q.get('n_windows', '?')})"


