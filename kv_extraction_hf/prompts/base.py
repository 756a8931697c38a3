"""The shared pieces of every prompt generator: the task names, the :class:`Prompt` record and
the tokenizing / fitting helpers (seeded RNG, chat-template split, fit pieces to a token
budget, assemble the record).

Separate from :mod:`kv_extraction_hf.prompts` (the dispatcher) and the task modules so that
each task family (:mod:`.prompts_synthetic`, :mod:`.prompts_topics`, :mod:`.prompts_datasets`,
:mod:`.prompts_user_data`) imports these without importing the others.
"""

from __future__ import annotations

import dataclasses
import random

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.textcheck import check_text

CONTINUATION_TOKENS = 256
SYNTHETIC_TASKS = ("needle", "longchat_lines", "topic_retrieval", "pydoc_ppl")
DATASET_TASKS = ("triviaqa", "narrativeqa", "wikitext2")
USER_DATA_TASKS = ("longchat", "longbench", "jsonl")  # read only the user's --data-path file
TASKS = SYNTHETIC_TASKS + DATASET_TASKS + USER_DATA_TASKS
DATA_PATH_TASKS = DATASET_TASKS + USER_DATA_TASKS  # the tasks --data-path is used by

_CTX = "@@CACHEGEN_CONTEXT@@"
_QUESTION = "@@CACHEGEN_QUESTION@@"


@dataclasses.dataclass
class Prompt:
    """One benchmark request.

    ``context_ids`` (the reusable part whose KV is extracted) then ``question_ids`` form
    the full prompt; ``answer`` is the gold answer (``answers`` all accepted ones);
    ``metric`` names the :mod:`evaluation` metric that scores it (``retrieval_accuracy``,
    ``qa_f1`` or ``perplexity``); ``max_new_tokens`` the generation budget;
    ``continuation_ids`` the held-out tokens for perplexity tasks (empty otherwise);
    ``meta`` task details (needle depth, number of lines/topics, dataset row id).
    """

    name: str
    task: str
    context_text: str
    question_text: str
    answer: str
    context_ids: list[int]
    question_ids: list[int]
    max_new_tokens: int
    metric: str = "retrieval_accuracy"
    answers: list[str] = dataclasses.field(default_factory=list)
    continuation_ids: list[int] = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def input_ids(self) -> list[int]:
        """The full prompt: ``context_ids + question_ids``."""
        return self.context_ids + self.question_ids


def seeded_rng(task: str, seed: int, index: int) -> random.Random:
    """The generator of prompt ``index`` of ``task`` for ``seed``."""
    # str seeds are hashed with sha512 by random.seed: stable across runs and PYTHONHASHSEED
    return random.Random(f"{task}:{seed}:{index}")


def encode(tokenizer, text: str, special: bool = False) -> list[int]:
    """Token ids of ``text`` (``special``: with BOS). Raises ExtractionError for invalid text."""
    # the backstop of every data path: a lone surrogate or NUL is one ExtractionError line,
    # not the tokenizer's TypeError; the loaders check first, naming the row
    return list(tokenizer.encode(check_text(text, "prompt text"), add_special_tokens=special))


def wrap_chat(tokenizer, context_body: str, question_body: str) -> tuple[str, str, bool]:
    """Split the chat-formatted prompt into (context part, question part, plain).

    With a chat template: one user message holding context then question; the header
    before the context goes with the context, the assistant header with the question.
    Without one: plain text, the tokenizer's special tokens (BOS) on the context part.
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _CTX + _QUESTION}], tokenize=False, add_generation_prompt=True)
        if rendered.count(_CTX) == 1 and rendered.count(_QUESTION) == 1:
            prefix, rest = rendered.split(_CTX)
            mid, suffix = rest.split(_QUESTION)
            return prefix + context_body + mid, question_body + suffix, False
    return context_body, question_body + "\n", True


def context_part_ids(tokenizer, context_part: str, plain: bool) -> list[int]:
    """Token ids of a context part (with BOS when ``plain``, i.e. no chat template)."""
    return encode(tokenizer, context_part, special=plain)


def fit_pieces(tokenizer, build, pieces: list[str], budget: int, what: str,
               skip: bool = False) -> tuple[list[int], str, list[int]]:
    """Choose pieces, in order, so that the context built from them has at most ``budget``
    tokens: a prefix of ``pieces``, or with ``skip`` also later pieces past one that does
    not fit (to fill the budget closely). ``build(chosen indices) -> (context_part,
    plain)``. Returns (chosen indices, context_part, context ids)."""
    counts = [len(encode(tokenizer, " " + p)) for p in pieces]
    part, plain = build([])
    base = len(context_part_ids(tokenizer, part, plain))
    if base > budget:
        raise ExtractionError(f"context_tokens={budget} is too small for the {what} prompt (needs > {base})")
    chosen, total = [], base
    for i, count in enumerate(counts):
        if total + count <= budget:
            chosen.append(i)
            total += count
        elif not skip or budget - total < 4:
            break
    while True:
        part, plain = build(chosen)
        ids = context_part_ids(tokenizer, part, plain)
        if len(ids) <= budget or not chosen:
            return chosen, part, ids
        chosen.pop()


def finish_prompt(task, tokenizer, context_tokens, seed, index, context_body, context_part, context_ids,
                  question_body, answer, max_new_tokens, **extra) -> Prompt:
    """The :class:`Prompt` of a fitted context and its question (``extra``: Prompt fields)."""
    _, question_part, _ = wrap_chat(tokenizer, "", question_body)
    return Prompt(
        name=f"{task}-{context_tokens}t-s{seed}-i{index}", task=task, context_text=context_body,
        question_text=question_body, answer=answer, answers=extra.pop("answers", [answer]),
        context_ids=context_ids, question_ids=encode(tokenizer, question_part),
        max_new_tokens=max_new_tokens, **extra)

