"""Dataset loaders: LongBench TriviaQA / NarrativeQA and WikiText-2 (through HF
``datasets``), and a user's own JSONL (:func:`load_user_data`: the CacheGen artifact's
LongChat rows, LongBench rows, or any JSONL with a field mapping).

The datasets CacheGen evaluates on (Liu et al., SIGCOMM 2024, section 7.1). Each loader
takes a local file (the dataset's own format: LongBench ``{name}.jsonl`` rows with fields
input, context, answers, length, dataset, language, all_classes, _id; WikiText-2 parquet
with a ``text`` column, or the raw ``wiki.test.raw`` text) or, with none given, the hub
(``THUDM/LongBench``, ``Salesforce/wikitext``). The hub is only tried when it is reachable
(or ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` asks for the local datasets cache); every
failure is one ExtractionError line. Tested on the small files in tests/fixtures/.

Run: ``python -m kv_extraction_hf --task triviaqa --data-path triviaqa.jsonl --out DIR``;
``python -m kv_extraction_hf --task longchat --data-path longchat.jsonl --out DIR``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from cachegen_common.bounded_json import parse as parse_bounded_json
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.textcheck import check_text
from kv_extraction_hf.wikitext import WIKITEXT_HUB, offline_requested  # defined there (no cycle)

LONGBENCH_HUB = "THUDM/LongBench"
LONGBENCH_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
LONGBENCH_TASKS = ("triviaqa", "narrativeqa")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:240] + ("..." if len(text) > 240 else "")


def _load_hub(name: str, *args, **kwargs):
    """``datasets.load_dataset`` from the hub, failing fast with one line when unreachable."""
    from kv_extraction_hf.model import hub_reachable

    if not offline_requested() and not hub_reachable():
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
        for f in ("context", "input"):
            if isinstance(row[f], str):
                check_text(row[f], f"{where} row {i} field {f!r}")
        for j, a in enumerate(row["answers"]):
            check_text(str(a), f"{where} row {i} field 'answers' answer {j}")
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
    return check_text(text, where)


# ---------------------------------------------------------------------------------------
# a user's own JSONL data: the CacheGen artifact's LongChat format, LongBench rows, or any
# JSONL with a field mapping (``--data-path`` with ``--task longchat|longbench|jsonl``)

USER_DATA_TASKS = ("longchat", "longbench", "jsonl")
# One row of a user's JSONL file: a long context is a few MB of text; a line over 256 MiB
# or nested deeper than 32 levels is not a dataset row (refused before it is parsed).
MAX_ROW_BYTES = 256 << 20
DATA_ROLES = ("context", "question", "answers")
LONGCHAT_FIELDS = ("test_id", "prompt", "label")
LONGCHAT_QUESTION_MARKER = "Now the record ends."
"""LongEval's topic-retrieval prompts (LongChat, Li et al. 2023) end the conversation
record with this sentence; what follows is the question."""


@dataclasses.dataclass(frozen=True)
class DataRecord:
    """One row of a user's dataset, normalised: ``context`` (the reusable part), the
    ``question`` asked after it, accepted ``answers`` (first = the gold answer), the
    row's ``row_id`` (``test_id`` / ``_id`` / line number)."""

    row_id: str
    context: str
    question: str
    answers: tuple[str, ...]


def parse_data_map(spec: str | None) -> dict[str, str]:
    """``"context=doc,question=q,answers=gold"`` -> ``{"context": "doc", ...}``.

    Raises:
        ExtractionError: a malformed entry or a role other than context/question/answers.
    """
    out: dict[str, str] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        role, sep, field = part.partition("=")
        role, field = role.strip(), field.strip()
        if not sep or not field:
            raise ExtractionError(f"--data-map entry {part.strip()!r} is not ROLE=FIELD "
                                  f"(roles: {', '.join(DATA_ROLES)})")
        if role not in DATA_ROLES:
            raise ExtractionError(f"--data-map role {role!r} is unknown (roles: {', '.join(DATA_ROLES)})")
        out[role] = field
    return out


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a JSONL file, one per non-empty line.

    Raises:
        ExtractionError: missing file, invalid JSON (with its line number), a line that is
            not an object, or no rows.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ExtractionError(f"data file not found: {p}")
    rows = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ExtractionError(f"cannot read {p}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = parse_bounded_json(line, what=f"{p} line {n}", max_bytes=MAX_ROW_BYTES, expect=dict,
                                 error=ExtractionError)
        rows.append(row)
    if not rows:
        raise ExtractionError(f"{p} holds no rows")
    return rows


def _field(row: dict, name: str, where: str, n: int) -> object:
    if name not in row:
        raise ExtractionError(f"{where} row {n} has no field {name!r} (fields: {', '.join(sorted(row))})")
    return row[name]


def _answers(value: object, where: str, n: int, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (check_text(value, f"{where} row {n} field {name!r}"),)
    if isinstance(value, (list, tuple)) and value and all(isinstance(a, (str, int, float)) for a in value):
        return tuple(check_text(str(a), f"{where} row {n} field {name!r} answer {i}")
                     for i, a in enumerate(value))
    raise ExtractionError(f"{where} row {n}: field {name!r} must be a string or a non-empty list of strings")


def _text(value: object, where: str, n: int, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ExtractionError(f"{where} row {n}: field {name!r} must be a non-empty string")
    return check_text(value, f"{where} row {n} field {name!r}")


def split_longchat_prompt(prompt: str) -> tuple[str, str]:
    """(context, question) of a LongChat prompt holding the whole conversation and then the
    question: split after :data:`LONGCHAT_QUESTION_MARKER` when present, else before the
    last line. Raises ExtractionError when neither gives a non-empty question."""
    idx = prompt.rfind(LONGCHAT_QUESTION_MARKER)
    if idx >= 0:
        cut = idx + len(LONGCHAT_QUESTION_MARKER)
        context, question = prompt[:cut], prompt[cut:].strip()
    else:
        context, _, question = prompt.rstrip().rpartition("\n")
        question = question.strip()
    if not context.strip() or not question:
        raise ExtractionError("cannot split the LongChat prompt into conversation and question "
                              f"(no {LONGCHAT_QUESTION_MARKER!r} and no final question line)")
    return context, question


@functools.lru_cache(maxsize=8)
def _load_user_data_cached(task: str, path: str, mapping: tuple[tuple[str, str], ...]) -> tuple[DataRecord, ...]:
    rows = read_jsonl(path)
    where = str(Path(path).expanduser())
    out = []
    fields = dict(mapping)
    for n, row in enumerate(rows, 1):
        if task == "longchat":
            for f in LONGCHAT_FIELDS:
                _field(row, f, where, n)
            context, question = split_longchat_prompt(_text(row["prompt"], where, n, "prompt"))
            out.append(DataRecord(str(row["test_id"]), context, question,
                                  _answers(row["label"], where, n, "label")))
        else:
            ctx = _text(_field(row, fields["context"], where, n), where, n, fields["context"])
            q = _text(_field(row, fields["question"], where, n), where, n, fields["question"])
            ans = _answers(_field(row, fields["answers"], where, n), where, n, fields["answers"])
            out.append(DataRecord(str(row.get("_id", row.get("id", n))), ctx, q, ans))
    return tuple(out)


def load_user_data(task: str, path: str | os.PathLike | None,
                   data_map: dict[str, str] | None = None) -> list[DataRecord]:
    """Rows of a user's JSONL file for ``task``, normalised to :class:`DataRecord`.

    - ``longchat``: the CacheGen artifact's LongChat rows ``{"test_id", "prompt" (the whole
      conversation then the question), "label" (topics; the first is the answer)}``;
    - ``longbench``: LongBench rows ``{"context", "input", "answers", "_id"?}``;
    - ``jsonl``: any rows; ``data_map`` names the fields of the three roles
      ``context``, ``question``, ``answers`` (all three required).

    This is the loader every entry point calls (``python -m kv_extraction_hf``,
    ``run_benchmarks.py``, the quality benchmark) for ``--data-path``.

    Raises:
        ExtractionError: unknown task, no ``path``, a missing/unreadable file, a row
            lacking a field (named, with the row number and the fields it has), a field
            of the wrong type, or an incomplete ``data_map``.
    """
    if task not in USER_DATA_TASKS:
        raise ExtractionError(f"task {task!r} does not read user data (those that do: {', '.join(USER_DATA_TASKS)})")
    if not path:
        raise ExtractionError(f"task {task} needs --data-path FILE (a JSONL file)")
    data_map = dict(data_map or {})
    if task == "longchat":
        if data_map:
            raise ExtractionError("task longchat has fixed fields (test_id, prompt, label); "
                                  "--data-map / --data-field-* are not used by it")
    elif task == "longbench":
        data_map = {"context": "context", "question": "input", "answers": "answers", **data_map}
    else:
        missing = [r for r in DATA_ROLES if r not in data_map]
        if missing:
            raise ExtractionError(f"task jsonl needs the field of {', '.join(missing)}: pass "
                                  "--data-map context=FIELD,question=FIELD,answers=FIELD "
                                  "(or --data-field-context/--data-field-question/--data-field-answers)")
    return list(_load_user_data_cached(task, os.fspath(path), tuple(sorted(data_map.items()))))

