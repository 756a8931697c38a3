"""Prompts from loaded text and rows: perplexity prompts from natural text (``pydoc_ppl``,
``wikitext2``) and the LongBench QA prompts (``triviaqa``, ``narrativeqa``; LongBench's
own templates, Bai et al. 2023, config/dataset2prompt.json) with LongBench's middle
truncation (shared by the user-data prompts). The data comes in as arguments
(:mod:`kv_extraction_hf.datasets_loaders` loads it); these functions only tokenize and cut.
"""

from __future__ import annotations

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts.base import (
    CONTINUATION_TOKENS,
    Prompt,
    context_part_ids,
    encode,
    finish_prompt,
    seeded_rng,
    wrap_chat,
)

MIN_DOC_TOKENS = 16  # fewer context tokens than this left after the template: refuse, nothing to test


def text_ppl_prompt(tokenizer, text_or_paragraphs, context_tokens: int, seed: int, index: int,
                    task: str) -> Prompt:
    """Perplexity prompt from natural text: ``context_tokens`` tokens from a seeded start,
    and the next :data:`CONTINUATION_TOKENS` tokens as ``continuation_ids``. Plain text (no
    chat template); the context and continuation are cut from one tokenization."""
    rng = seeded_rng(task, seed, index)
    paras = list(text_or_paragraphs)
    if not paras:
        raise ExtractionError(f"no text for task {task}")
    need = context_tokens + CONTINUATION_TOKENS
    start = rng.randrange(len(paras))
    chosen, size = [], 0
    for i in range(len(paras)):
        para = paras[(start + i) % len(paras)]
        chosen.append(para)
        size += len(para) // 6 + 1
        if size >= need:
            ids = encode(tokenizer, "\n".join(chosen), special=True)
            if len(ids) >= need:
                break
    ids = encode(tokenizer, "\n".join(chosen), special=True)
    if len(ids) < need:
        raise ExtractionError(f"the {task} text has {len(ids)} tokens, fewer than the {need} "
                              f"asked for (context {context_tokens} + continuation {CONTINUATION_TOKENS})")
    context_ids, cont = ids[:context_tokens], ids[context_tokens:need]
    return Prompt(name=f"{task}-{context_tokens}t-s{seed}-i{index}", task=task,
                  context_text=tokenizer.decode(context_ids), question_text="", answer="", answers=[],
                  context_ids=context_ids, question_ids=[], max_new_tokens=0, metric="perplexity",
                  continuation_ids=cont, meta={"start_paragraph": start})


LONGBENCH_PROMPTS = {
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output "
                 "any other words. The following are some examples.\n\n{context}\n\n", "{input}", 32),
    "narrativeqa": ("You are given a story, which can be either a novel or a movie script, and a question. "
                    "Answer the question asconcisely as you can, using a single phrase if possible. Do not "
                    "provide any explanation.\n\nStory: {context}\n\n",
                    "Now, answer the question based on the story asconcisely as you can, using a single phrase "
                    "if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:", 128),
}


def longbench_prompt(tokenizer, task: str, rows, context_tokens: int, seed: int, index: int) -> Prompt:
    """A LongBench QA prompt (LongBench's own templates and max_new_tokens), the context
    truncated in the middle (LongBench's rule) so that the context part fits
    ``context_tokens``. The row is ``rows[perm[index % len(rows)]]`` for a seeded
    permutation. Scored by :func:`evaluation.qa_f1` against all ``answers``."""
    if not rows:
        raise ExtractionError(f"dataset for {task} is empty")
    order = list(range(len(rows)))
    seeded_rng(task, seed, 0).shuffle(order)
    row = rows[order[index % len(rows)]]
    ctx_tmpl, q_tmpl, max_new = LONGBENCH_PROMPTS[task]
    doc_ids = encode(tokenizer, row["context"])
    empty_part, plain = wrap_chat(tokenizer, ctx_tmpl.format(context=""), "")[::2]
    room = context_tokens - len(context_part_ids(tokenizer, empty_part, plain)) - 2
    body, part, ids, room = cut_middle(
        tokenizer, ctx_tmpl, doc_ids, room, context_tokens, whole=row["context"],
        too_small=lambda: ExtractionError(f"context_tokens={context_tokens} is too small for the {task} prompt"))
    answers = [str(a) for a in row["answers"]]
    return finish_prompt(task, tokenizer, context_tokens, seed, index, body, part, ids,
                         q_tmpl.format(input=row["input"]), answers[0] if answers else "", max_new,
                         answers=answers, metric="qa_f1",
                         meta={"row_id": str(row.get("_id", "")), "truncated": len(doc_ids) > room})


def cut_middle(tokenizer, ctx_tmpl: str, doc_ids: list[int], room: int, budget: int, too_small,
               whole: str | None = None) -> tuple[str, str, list[int], int]:
    """Fit a document into ``ctx_tmpl`` so that the context part has at most ``budget`` tokens.

    The document (token ids ``doc_ids``) keeps its first and last halves of ``room`` tokens
    (LongBench's middle truncation; ``whole``, the untouched text, when it has at most
    ``room`` tokens); ``room`` shrinks by the excess until the context fits. Returns (body,
    context part, context ids, final room). Raises ``too_small()`` (an ExtractionError) once
    ``room`` is below :data:`MIN_DOC_TOKENS`.
    """
    while True:
        if room < MIN_DOC_TOKENS:
            raise too_small()
        if whole is not None and len(doc_ids) <= room:
            doc = whole
        else:
            half = room // 2  # LongBench: keep the first and the last half
            doc = tokenizer.decode(doc_ids[:half]) + tokenizer.decode(doc_ids[len(doc_ids) - (room - half):])
        body = ctx_tmpl.format(context=doc)
        part, plain = wrap_chat(tokenizer, body, "")[::2]
        ids = context_part_ids(tokenizer, part, plain)
        if len(ids) <= budget:
            return body, part, ids, room
        room -= len(ids) - budget + 2
