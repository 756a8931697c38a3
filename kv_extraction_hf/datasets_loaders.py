"""Dataset loaders (through HF ``datasets``): LongBench TriviaQA / NarrativeQA and WikiText-2.

The datasets CacheGen evaluates on (Liu et al., SIGCOMM 2024, section 7.1). Each loader
takes a local file (the dataset's own format: LongBench ``{name}.jsonl`` rows with fields
input, context, answers, length, dataset, language, all_classes, _id; WikiText-2 parquet
with a ``text`` column, or the raw ``wiki.test.raw`` text) or, with none given, the hub
(``THUDM/LongBench``, ``Salesforce/wikitext``). The hub is only tried when it is reachable
(or ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` asks for the local datasets cache); every
failure is one ExtractionError line. Tested on the small files in tests/fixtures/.

Run: ``python -m kv_extraction_hf --task triviaqa --data-path triviaqa.jsonl --out DIR``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from kv_extraction_hf.errors import ExtractionError

LONGBENCH_HUB = "THUDM/LongBench"
LONGBENCH_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
LONGBENCH_TASKS = ("triviaqa", "narrativeqa")
WIKITEXT_HUB = ("Salesforce/wikitext", "wikitext-2-raw-v1")


def _offline_requested() -> bool:
    return any(os.environ.get(v, "").lower() in {"1", "true", "yes", "on"}
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:240] + ("..." if len(text) > 240 else "")


def _load_hub(name: str, *args, **kwargs):
    """``datasets.load_dataset`` from the hub, failing fast with one line when unreachable."""
    from kv_extraction_hf.model import hub_reachable

    if not _offline_requested() and not hub_reachable():
        raise ExtractionError(f"dataset '{name}' not available: the hub is unreachable "
                              "(pass a local file with --data-path)")
    import datasets

    try:
        return datasets.load_dataset(name, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ExtractionError(f"dataset '{name}' could not be loaded: {_one_line(exc)}") from exc


def _load_local(builder: str, path: Path, split: str = "train"):
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=str(path), split=split)
    except Exception as exc:  # noqa: BLE001
        raise ExtractionError(f"could not read {path} as {builder}: {_one_line(exc)}") from exc


@functools.lru_cache(maxsize=8)
def load_longbench(name: str, source: str | None = None) -> list[dict]:
    """Rows of a LongBench dataset (``triviaqa`` or ``narrativeqa``) as dicts.

    ``source``: a ``.jsonl`` file, a folder holding ``{name}.jsonl``, or None for the hub
    (``THUDM/LongBench``, config ``name``, split ``test``). Raises ExtractionError for an
    unknown name, a missing/unreadable file, rows lacking LongBench fields, or no hub.
    """
    if name not in LONGBENCH_TASKS:
        raise ExtractionError(f"unknown LongBench dataset '{name}' (available: {', '.join(LONGBENCH_TASKS)})")
    if source is None:
        ds = _load_hub(LONGBENCH_HUB, name, split="test")
        where = f"{LONGBENCH_HUB}/{name}"
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            path = path / f"{name}.jsonl"
        if not path.is_file():
            raise ExtractionError(f"LongBench file not found: {path}")
        ds = _load_local("json", path)
        where = str(path)
    missing = [f for f in ("input", "context", "answers") if f not in ds.column_names]
    if missing:
        raise ExtractionError(f"{where} lacks LongBench field(s) {missing} (has {ds.column_names})")
    rows = [dict(r) for r in ds]
    for i, row in enumerate(rows):
        if not isinstance(row["answers"], list) or not isinstance(row["context"], str):
            raise ExtractionError(f"{where} row {i}: 'answers' must be a list and 'context' a string")
    return rows


@functools.lru_cache(maxsize=4)
def load_wikitext2(source: str | None = None, split: str = "test") -> str:
    """The WikiText-2 (raw) ``split`` as one string, lines joined by newlines.

    ``source``: a ``.parquet`` file (the hub's layout: a ``text`` column of lines), a raw
    text file (``wiki.test.raw``), or None for the hub (``Salesforce/wikitext``,
    ``wikitext-2-raw-v1``). Raises ExtractionError when it cannot be read.
    """
    if source is None:
        ds = _load_hub(WIKITEXT_HUB[0], WIKITEXT_HUB[1], split=split)
        where = "/".join(WIKITEXT_HUB)
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ExtractionError(f"WikiText-2 file not found: {path}")
        builder = "parquet" if path.suffix == ".parquet" else "text"
        ds = _load_local(builder, path)
        where = str(path)
    if "text" not in ds.column_names:
        raise ExtractionError(f"{where} has no 'text' column (has {ds.column_names})")
    text = "\n".join(line.rstrip("\n") for line in ds["text"])
    if not text.strip():
        raise ExtractionError(f"{where} holds no text")
    return text
