"""Prompts: offline, seeded, token-sized generators for the benchmark tasks.

Every prompt is split into a reusable CONTEXT (whose KV cache is what CacheGen stores and
streams) and a QUESTION appended after it. The two parts are tokenized separately and
concatenated (``context_ids + question_ids``), so the context KV is a prefix of the full
prompt's KV. With a chat template, the system/user header goes into the context part and
the question plus the assistant header into the question part.

Tasks (see docs/tasks.md for the default model's measured lossless scores):
- ``needle``: a passcode sentence hidden at a depth in natural English filler
  (needle-in-a-haystack; CacheGen section 7.1 and its LongChat follow-ups).
- ``longchat_lines``: LongEval "lines" retrieval (LongChat, Li et al. 2023): numbered
  lines each holding a REGISTER_CONTENT number; ask for one line's value.
- ``topic_retrieval``: CacheGen's LongChat task: a multi-topic conversation, then "what is
  the first topic we discussed?".
- ``pydoc_ppl``: natural English from ``pydoc_data.topics`` (shipped with every CPython);
  the context plus a held-out 256-token continuation for perplexity / KL.
- ``triviaqa``, ``narrativeqa`` (LongBench, Bai et al. 2023, its prompts) and ``wikitext2``
  (perplexity) through :mod:`kv_extraction_hf.datasets_loaders`: need the data (a local
  file via ``data_path`` or a reachable hub).
- ``longchat``, ``longbench``, ``jsonl``: the user's own JSONL file (``data_path``, the
  one ``--data-path`` flag of every entry point): the CacheGen artifact's LongChat rows,
  LongBench rows, or any rows with a ``data_map`` of fields. Contexts over the budget are
  truncated in the middle (LongBench's rule), recorded as ``truncated_from_tokens``, or
  refused with the limit named when ``truncate`` is False.

Each prompt is a pure function of (task, tokenizer, context_tokens, seed, index[, data]).
Run: ``python -m kv_extraction_hf --task needle --context-tokens 1024 --num-contexts 4 --out DIR``.
"""

from __future__ import annotations

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.natural_text import natural_paragraphs
from kv_extraction_hf.prompts.base import TASKS, USER_DATA_TASKS, Prompt
from kv_extraction_hf.prompts.datasets import longbench_prompt, text_ppl_prompt
from kv_extraction_hf.prompts.synthetic import longchat_lines_prompt, needle_prompt
from kv_extraction_hf.prompts.topics import topic_retrieval_prompt
from kv_extraction_hf.prompts.user_data import check_data_flags, user_data_prompt

__all__ = [
    "CONTINUATION_TOKENS", "DATA_PATH_TASKS", "DATASET_TASKS", "LONGBENCH_PROMPTS", "MIN_DOC_TOKENS",
    "NEEDLE_DEPTHS", "SYNTHETIC_TASKS", "TASKS", "TOPICS", "TOPIC_SENTENCES", "USER_DATA_TASKS",
    "USER_DATA_TEMPLATES", "Prompt", "build_prompt", "check_data_flags", "context_budget",
    "longbench_prompt", "longchat_lines_prompt", "natural_paragraphs", "natural_sentences",
    "needle_prompt", "text_ppl_prompt", "topic_retrieval_prompt", "user_data_prompt",
]


def build_prompt(task: str, tokenizer, context_tokens: int, seed: int = 0, index: int = 0,
                 data_path: str | None = None, data_map: dict | None = None, truncate: bool = True,
                 max_prompt_tokens: int | None = None) -> Prompt:
    """Build prompt number ``index`` of ``task`` for seed ``seed``, its context part at most
    ``context_tokens`` tokens (exactly that many for the perplexity tasks).

    ``task`` is one of :data:`TASKS`; dataset tasks read ``data_path`` (a local file) or the
    hub; user-data tasks (``longchat``, ``longbench``, ``jsonl``) read ``data_path`` with
    ``data_map`` (see :func:`user_data_prompt` for ``truncate`` and ``max_prompt_tokens``,
    the model's context in tokens). Deterministic: the same arguments give the same token
    ids. Raises ExtractionError for an unknown task, a data flag the task does not use, a
    size too small for the task, or data that cannot be loaded.
    """
    if task not in TASKS:
        raise ExtractionError(f"unknown task '{task}' (available: {', '.join(TASKS)})")
    if context_tokens <= 0:
        raise ExtractionError(f"context_tokens must be positive, got {context_tokens}")
    check_data_flags(task, data_path, data_map)
    if task == "needle":
        return needle_prompt(tokenizer, context_tokens, seed, index)
    if task == "longchat_lines":
        return longchat_lines_prompt(tokenizer, context_tokens, seed, index)
    if task == "topic_retrieval":
        return topic_retrieval_prompt(tokenizer, context_tokens, seed, index)
    if task == "pydoc_ppl":
        return text_ppl_prompt(tokenizer, natural_paragraphs(), context_tokens, seed, index, task)
    from kv_extraction_hf import datasets_loaders

    if task in USER_DATA_TASKS:
        return user_data_prompt(tokenizer, task, datasets_loaders.load_user_data(task, data_path, data_map),
                                context_tokens, index, max_prompt_tokens, truncate)
    if task == "wikitext2":
        text = datasets_loaders.load_wikitext2(data_path)
        paras = [p.strip() for p in text.split("\n") if p.strip()]
        return text_ppl_prompt(tokenizer, paras, context_tokens, seed, index, task)
    return longbench_prompt(tokenizer, task, datasets_loaders.load_longbench(task, data_path),
                            context_tokens, seed, index)
