"""Prompts from the user's own JSONL file (tasks ``longchat``, ``longbench``, ``jsonl``;
rows loaded by :func:`kv_extraction_hf.datasets_loaders.load_user_data`), and the checks of
the data flags (``--data-path``, ``--data-map``) against the tasks that read them.
"""

from __future__ import annotations

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts.base import (
    DATA_PATH_TASKS,
    USER_DATA_TASKS,
    Prompt,
    context_part_ids,
    encode,
    finish_prompt,
    wrap_chat,
)
from kv_extraction_hf.prompts.datasets import cut_middle

USER_DATA_TEMPLATES = {
    # LongChat topic retrieval: the row's own conversation and question, no extra words
    "longchat": ("{context}", "{input}", 32, "retrieval_accuracy"),
    # LongBench's generic single-document QA template (config/dataset2prompt.json, multifieldqa_en)
    "longbench": ("Read the following text and answer briefly.\n\n{context}\n\n",
                  "Now, answer the following question based on the above text, only give me the "
                  "answer and do not output any other words.\n\nQuestion: {input}\nAnswer:", 64, "qa_f1"),
}
USER_DATA_TEMPLATES["jsonl"] = USER_DATA_TEMPLATES["longbench"]


def check_data_flags(tasks, data_path=None, data_map=None) -> None:
    """Refuse a data flag no task uses and a user-data task without its flags.

    ``--data-path`` is used by :data:`DATA_PATH_TASKS` only (every task given must read
    it); ``data_map`` (``--data-map`` / ``--data-field-*``) by ``jsonl`` and ``longbench``;
    ``longchat``/``longbench``/``jsonl`` need ``--data-path``. Raises ExtractionError.
    """
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    if data_path:
        unused = [t for t in tasks if t not in DATA_PATH_TASKS]
        if unused:
            raise ExtractionError(f"--data-path is not used by task(s) {', '.join(unused)} (it is read by "
                                  f"{', '.join(DATA_PATH_TASKS)})")
    if data_map:
        unused = [t for t in tasks if t not in ("jsonl", "longbench")]
        if unused:
            raise ExtractionError(f"--data-map / --data-field-* are not used by task(s) {', '.join(unused)} "
                                  "(they map the fields of --tasks jsonl or longbench)")
    for t in tasks:
        if t in USER_DATA_TASKS and not data_path:
            raise ExtractionError(f"task {t} reads your own JSONL file: pass --data-path FILE")


def context_budget(context_tokens: int, question_tokens: int, max_new_tokens: int,
                   max_prompt_tokens: int | None) -> int:
    """Tokens the context part may take: ``context_tokens``, and no more than the model's
    context minus the question and the generation budget."""
    if max_prompt_tokens is None:
        return context_tokens
    return min(context_tokens, max_prompt_tokens - question_tokens - max_new_tokens)


def user_data_prompt(tokenizer, task: str, records, context_tokens: int, index: int,
                     max_prompt_tokens: int | None = None, truncate: bool = True) -> Prompt:
    """Prompt of row ``index % len(records)`` (file order) of the user's data.

    The context part holds at most :func:`context_budget` tokens; a longer context is
    truncated in the middle (its first and last halves kept, LongBench's rule) and
    ``meta["truncated_from_tokens"]`` records its full length (None when it fit), or,
    with ``truncate`` False, refused naming the limit. Scored by
    :func:`evaluation.retrieval_accuracy` (longchat: the first label) or
    :func:`evaluation.qa_f1` (longbench, jsonl: all answers).

    Raises:
        ExtractionError: no rows, a budget too small, or an over-long context with
            ``truncate`` False.
    """
    if not records:
        raise ExtractionError(f"the data of task {task} has no rows")
    rec = records[index % len(records)]
    ctx_tmpl, q_tmpl, max_new, metric = USER_DATA_TEMPLATES[task]
    question_body = q_tmpl.format(input=rec.question)
    _, question_part, _ = wrap_chat(tokenizer, "", question_body)
    budget = context_budget(context_tokens, len(encode(tokenizer, question_part)), max_new,
                            max_prompt_tokens)
    doc_ids = encode(tokenizer, rec.context)
    body = ctx_tmpl.format(context=rec.context)
    part, plain = wrap_chat(tokenizer, body, "")[::2]
    ids = context_part_ids(tokenizer, part, plain)
    truncated_from = None
    if len(ids) > budget:
        limit = (f"{budget} tokens (--context-tokens {context_tokens}"
                 + (f"; the model's context {max_prompt_tokens} minus the question and "
                    f"{max_new} generated tokens" if max_prompt_tokens is not None else "") + ")")
        if not truncate:
            raise ExtractionError(f"row {rec.row_id} of task {task}: the context has {len(ids)} tokens, more "
                                  f"than the {limit}; allow middle truncation or raise --context-tokens")
        truncated_from = len(ids)
        room = len(doc_ids) - (len(ids) - budget) - 2
        body, part, ids, _ = cut_middle(
            tokenizer, ctx_tmpl, doc_ids, room, budget,
            too_small=lambda: ExtractionError(f"row {rec.row_id} of task {task}: a context of at most {limit} "
                                              "leaves no room for the document after the prompt template"))
    answers = list(rec.answers)
    return finish_prompt(task, tokenizer, context_tokens, 0, index, body, part, ids, question_body,
                         answers[0], max_new, answers=answers, metric=metric,
                         meta={"row_id": rec.row_id, "truncated_from_tokens": truncated_from})
