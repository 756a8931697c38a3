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

import dataclasses
import functools
import random
import re

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.textcheck import check_text

CONTINUATION_TOKENS = 256
SYNTHETIC_TASKS = ("needle", "longchat_lines", "topic_retrieval", "pydoc_ppl")
DATASET_TASKS = ("triviaqa", "narrativeqa", "wikitext2")
USER_DATA_TASKS = ("longchat", "longbench", "jsonl")  # read only the user's --data-path file
TASKS = SYNTHETIC_TASKS + DATASET_TASKS + USER_DATA_TASKS
DATA_PATH_TASKS = DATASET_TASKS + USER_DATA_TASKS  # the tasks --data-path is used by
NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

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


# ---------------------------------------------------------------------------------------
# natural English text that exists on every CPython install


@functools.lru_cache(maxsize=1)
def natural_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs of the Python reference docs (``pydoc_data.topics``), code blocks,
    grammar rules and headings removed, each paragraph on one line, in a fixed order."""
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            lines = [line for line in block.split("\n") if line.strip()]
            if not lines or any(line.startswith((" ", "\t", ">>>")) for line in lines):
                continue
            if re.fullmatch(r"[*=\-^~#+]{3,}", lines[-1].strip()):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) >= 80 and text[-1] in ".:" and "::=" not in text:
                paras.append(text)
    return tuple(paras)


@functools.lru_cache(maxsize=1)
def natural_sentences() -> tuple[str, ...]:
    """Sentences of :func:`natural_paragraphs`, in order."""
    out = []
    for para in natural_paragraphs():
        out.extend(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", para) if len(s) > 20)
    return tuple(out)


def _rng(task: str, seed: int, index: int) -> random.Random:
    # str seeds are hashed with sha512 by random.seed: stable across runs and PYTHONHASHSEED
    return random.Random(f"{task}:{seed}:{index}")


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    # the backstop of every data path: a lone surrogate or NUL is one ExtractionError line,
    # not the tokenizer's TypeError (issue 26.7); the loaders check first, naming the row
    return list(tokenizer.encode(check_text(text, "prompt text"), add_special_tokens=special))


def _wrap(tokenizer, context_body: str, question_body: str) -> tuple[str, str, bool]:
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


def _context_ids(tokenizer, context_part: str, plain: bool) -> list[int]:
    return _encode(tokenizer, context_part, special=plain)


def _fit(tokenizer, build, pieces: list[str], budget: int, what: str,
         skip: bool = False) -> tuple[list[int], str, list[int]]:
    """Choose pieces, in order, so that the context built from them has at most ``budget``
    tokens: a prefix of ``pieces``, or with ``skip`` also later pieces past one that does
    not fit (to fill the budget closely). ``build(chosen indices) -> (context_part,
    plain)``. Returns (chosen indices, context_part, context ids)."""
    counts = [len(_encode(tokenizer, " " + p)) for p in pieces]
    part, plain = build([])
    base = len(_context_ids(tokenizer, part, plain))
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
        ids = _context_ids(tokenizer, part, plain)
        if len(ids) <= budget or not chosen:
            return chosen, part, ids
        chosen.pop()


def _filler(rng: random.Random, count: int) -> list[str]:
    """``count`` consecutive natural sentences from a random start (wrapping around)."""
    sents = natural_sentences()
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(count)]


def _finish(task, tokenizer, context_tokens, seed, index, context_body, context_part, context_ids,
            question_body, answer, max_new_tokens, **extra) -> Prompt:
    _, question_part, _ = _wrap(tokenizer, "", question_body)
    return Prompt(
        name=f"{task}-{context_tokens}t-s{seed}-i{index}", task=task, context_text=context_body,
        question_text=question_body, answer=answer, answers=extra.pop("answers", [answer]),
        context_ids=context_ids, question_ids=_encode(tokenizer, question_part),
        max_new_tokens=max_new_tokens, **extra)


# ---------------------------------------------------------------------------------------
# synthetic tasks


def needle_prompt(tokenizer, context_tokens: int, seed: int = 0, index: int = 0) -> Prompt:
    """A 5-digit passcode sentence at depth ``NEEDLE_DEPTHS[(seed + index) % 5]`` of natural
    filler; asks for the passcode. Scored by :func:`evaluation.retrieval_accuracy` (last
    number in the answer); 40 new tokens (the answer opens with a sentence)."""
    rng = _rng("needle", seed, index)
    code = str(rng.randint(10000, 99999))
    depth = NEEDLE_DEPTHS[(seed + index) % len(NEEDLE_DEPTHS)]
    needle = f"The secret passcode is {code}."
    filler = _filler(rng, 4 * context_tokens // 10 + 50)
    intro = "Read the following text. It contains a secret passcode that you must remember.\n\n"

    def body(chosen):
        sents = [filler[i] for i in chosen]
        sents.insert(round(depth * len(sents)), needle)
        return intro + " ".join(sents)

    chosen, part, ids = _fit(tokenizer, lambda c: _wrap(tokenizer, body(c), "")[::2], filler, context_tokens,
                             "needle", skip=True)
    question = "\n\nWhat is the secret passcode in the text above? Answer with the number."
    return _finish("needle", tokenizer, context_tokens, seed, index, body(chosen), part, ids, question, code,
                   40, meta={"depth": depth, "filler_sentences": len(chosen)})


_WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pepper", "violet", "castle",
    "rocket", "garden", "silver", "falcon", "harbor", "meadow", "lantern", "copper", "willow", "canyon",
    "breeze", "marble", "thunder", "orchid", "glacier", "comet", "saddle", "velvet", "island", "summit",
)


def longchat_lines_prompt(tokenizer, context_tokens: int, seed: int = 0, index: int = 0,
                          index_style: str = "int") -> Prompt:
    """LongEval "lines" retrieval (LongChat): as many lines "line {idx}: REGISTER_CONTENT is
    <{1..50000}>" as fit, then ask for one line's value (LongEval's prompt text). Index
    styles: ``int`` or ``words`` (LongEval's word pairs). Scored by the last integer."""
    rng = _rng("longchat_lines", seed, index)
    head = ("Below is a record of lines I want you to remember. Each line begins with 'line <line index>' "
            "and contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line "
            "index, memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you "
            "to retrieve the corresponding <REGISTER_CONTENT> of a certain line index. Now the record start:\n\n")
    max_lines = context_tokens // 8 + 2
    if index_style == "words":
        pairs = [f"{a}-{b}" for a in _WORDS for b in _WORDS if a != b]
        names = rng.sample(pairs, max_lines)
    else:
        names = [str(i) for i in rng.sample(range(1, 10 * max_lines + 1), max_lines)]
    values = [rng.randint(1, 50000) for _ in range(max_lines)]
    lines = [f"line {name}: REGISTER_CONTENT is <{val}>" for name, val in zip(names, values, strict=True)]

    def body(chosen):
        return head + "\n".join(lines[i] for i in chosen)

    chosen, part, ids = _fit(tokenizer, lambda c: _wrap(tokenizer, body(c), "")[::2], lines, context_tokens,
                        "longchat_lines")
    n = len(chosen)
    if n < 2:
        raise ExtractionError(f"context_tokens={context_tokens} holds fewer than 2 lines for longchat_lines")
    target = rng.randrange(n)
    question = (f"\n\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {names[target]}? "
                "I need the number.")
    return _finish("longchat_lines", tokenizer, context_tokens, seed, index, body(chosen), part, ids, question,
                   str(values[target]), 40, meta={"num_lines": n, "target_line": names[target],
                                                  "index_style": index_style})


TOPICS = (
    "jazz music", "mountain climbing", "electric cars", "ancient Egypt", "coffee brewing", "chess openings",
    "volcanoes", "beekeeping", "the Roman Empire", "solar panels", "origami", "deep sea fish", "football",
    "bread baking", "black holes", "knitting", "the Great Wall of China", "tropical rainforests",
    "photography", "the Olympic Games", "gardening", "submarines", "Japanese cuisine", "dinosaurs",
    "hot air balloons", "classical ballet", "wind turbines", "honey bees", "the Moon landing", "sailing",
    "vintage cars", "tea ceremonies", "the Amazon river", "skateboarding", "pottery", "polar bears",
    "video games", "the Eiffel Tower", "wine tasting", "yoga", "lighthouses", "birdwatching",
    "the Sahara desert", "comic books", "fireworks", "the piano", "coral reefs", "trains",
)


TOPIC_SENTENCES = (
    "{T} is a subject that many people find fascinating.",
    "There is a long history behind {t}, and it has changed a lot over the years.",
    "One of the most interesting things about {t} is how much there is to learn.",
    "People who enjoy {t} often spend years studying the details.",
    "If you are new to {t}, it helps to start with the basics.",
    "Experts in {t} often disagree about the best approach.",
    "Books, films and museums have all helped to make {t} more widely known.",
    "Some of the questions about {t} are still open today.",
    "A good way to understand {t} is to look at a few concrete examples.",
    "Many communities around the world have their own traditions connected with {t}.",
    "The vocabulary of {t} can be confusing at first, but it becomes familiar with practice.",
    "Patience matters a great deal when it comes to {t}.",
    "Teachers who explain {t} well usually start with a simple story.",
    "The future of {t} depends on the people who keep it alive.",
    "Whenever I think about {t}, I remember how much effort goes into it.",
    "It is easy to underestimate how much work {t} requires.",
    "Newcomers to {t} are often surprised by how welcoming the community is.",
    "There are many myths about {t}, and not all of them are true.",
    "The best resources on {t} are written by people with real experience.",
    "Over time, technology has changed the way people approach {t}.",
)


def topic_retrieval_prompt(tokenizer, context_tokens: int, seed: int = 0, index: int = 0,
                           turn_tokens: int | None = None) -> Prompt:
    """CacheGen's LongChat topic retrieval: a conversation over several topics, then "What is
    the first topic we discussed?". Each topic is a user turn naming it and an assistant
    reply of about ``turn_tokens`` tokens of sentences about it (shuffled templates; default
    ``context_tokens // 5``, so 4-5 topics at any size). Scored by substring match."""
    rng = _rng("topic_retrieval", seed, index)
    turn_tokens = turn_tokens or max(40, context_tokens // 5)
    topics = rng.sample(TOPICS, len(TOPICS))
    pieces, is_header = [], []
    for topic in topics:
        pieces.append(f"USER: I would like to discuss the topic of {topic}.\nASSISTANT: Sure, let us talk "
                      f"about {topic}.")
        is_header.append(True)
        size = 0
        while size < turn_tokens:  # a reply about the topic: shuffled template sentences
            for template in rng.sample(TOPIC_SENTENCES, len(TOPIC_SENTENCES)):
                sent = template.format(t=topic, T=topic[0].upper() + topic[1:])
                pieces.append(sent)
                is_header.append(False)
                size += len(sent) // 4
                if size >= turn_tokens:
                    break
    head = "Below is a record of our previous conversation on many different topics.\n\n"

    def body(chosen):
        if chosen and is_header[chosen[-1]]:
            chosen = chosen[:-1]  # no topic without a reply
        return head + "".join(("\n\n" if is_header[i] and i else " " if i else "") + pieces[i] for i in chosen)

    chosen, part, ids = _fit(tokenizer, lambda c: _wrap(tokenizer, body(c), "")[::2], pieces, context_tokens,
                             "topic_retrieval", skip=True)
    num_topics = sum(is_header[i] for i in chosen) - int(bool(chosen) and is_header[chosen[-1]])
    if num_topics < 1 or len(chosen) < 2:
        raise ExtractionError(f"context_tokens={context_tokens} holds no conversation turn for topic_retrieval")
    question = ("\n\nWhat is the first topic we discussed? Only give me the topic name. "
                "Do not summarize yourself.")
    return _finish("topic_retrieval", tokenizer, context_tokens, seed, index, body(chosen), part, ids, question,
                   topics[0], 40, meta={"num_topics": num_topics, "turn_tokens": turn_tokens})


def text_ppl_prompt(tokenizer, text_or_paragraphs, context_tokens: int, seed: int, index: int,
                    task: str) -> Prompt:
    """Perplexity prompt from natural text: ``context_tokens`` tokens from a seeded start,
    and the next :data:`CONTINUATION_TOKENS` tokens as ``continuation_ids``. Plain text (no
    chat template); the context and continuation are cut from one tokenization."""
    rng = _rng(task, seed, index)
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
            ids = _encode(tokenizer, "\n".join(chosen), special=True)
            if len(ids) >= need:
                break
    ids = _encode(tokenizer, "\n".join(chosen), special=True)
    if len(ids) < need:
        raise ExtractionError(f"the {task} text has {len(ids)} tokens, fewer than the {need} "
                              f"asked for (context {context_tokens} + continuation {CONTINUATION_TOKENS})")
    context_ids, cont = ids[:context_tokens], ids[context_tokens:need]
    return Prompt(name=f"{task}-{context_tokens}t-s{seed}-i{index}", task=task,
                  context_text=tokenizer.decode(context_ids), question_text="", answer="", answers=[],
                  context_ids=context_ids, question_ids=[], max_new_tokens=0, metric="perplexity",
                  continuation_ids=cont, meta={"start_paragraph": start})


# ---------------------------------------------------------------------------------------
# dataset tasks (LongBench prompts, Bai et al. 2023, config/dataset2prompt.json)

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
    _rng(task, seed, 0).shuffle(order)
    row = rows[order[index % len(rows)]]
    ctx_tmpl, q_tmpl, max_new = LONGBENCH_PROMPTS[task]
    doc_ids = _encode(tokenizer, row["context"])
    empty_part, plain = _wrap(tokenizer, ctx_tmpl.format(context=""), "")[::2]
    room = context_tokens - len(_context_ids(tokenizer, empty_part, plain)) - 2
    if room < 16:
        raise ExtractionError(f"context_tokens={context_tokens} is too small for the {task} prompt")
    while True:
        if len(doc_ids) > room:  # LongBench: keep the first and the last half
            half = room // 2
            doc = tokenizer.decode(doc_ids[:half]) + tokenizer.decode(doc_ids[len(doc_ids) - (room - half):])
        else:
            doc = row["context"]
        body = ctx_tmpl.format(context=doc)
        part, plain = _wrap(tokenizer, body, "")[::2]
        ids = _context_ids(tokenizer, part, plain)
        if len(ids) <= context_tokens:
            break
        room -= len(ids) - context_tokens + 2
        if room < 16:
            raise ExtractionError(f"context_tokens={context_tokens} is too small for the {task} prompt")
    answers = [str(a) for a in row["answers"]]
    return _finish(task, tokenizer, context_tokens, seed, index, body, part, ids,
                   q_tmpl.format(input=row["input"]), answers[0] if answers else "", max_new,
                   answers=answers, metric="qa_f1", meta={"row_id": str(row.get("_id", "")),
                                                          "truncated": len(doc_ids) > room})


# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# the user's own data (datasets_loaders.load_user_data)

USER_DATA_TEMPLATES = {
    # LongChat topic retrieval: the row's own conversation and question, no extra words
    "longchat": ("{context}", "{input}", 32, "retrieval_accuracy"),
    # LongBench's generic single-document QA template (config/dataset2prompt.json, multifieldqa_en)
    "longbench": ("Read the following text and answer briefly.\n\n{context}\n\n",
                  "Now, answer the following question based on the above text, only give me the "
                  "answer and do not output any other words.\n\nQuestion: {input}\nAnswer:", 64, "qa_f1"),
}
USER_DATA_TEMPLATES["jsonl"] = USER_DATA_TEMPLATES["longbench"]
MIN_DOC_TOKENS = 16  # fewer context tokens than this left after the template: refuse, nothing to test


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
                                  "(they map the fields of --task jsonl or longbench)")
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
    _, question_part, _ = _wrap(tokenizer, "", question_body)
    budget = context_budget(context_tokens, len(_encode(tokenizer, question_part)), max_new,
                            max_prompt_tokens)
    doc_ids = _encode(tokenizer, rec.context)
    body = ctx_tmpl.format(context=rec.context)
    part, plain = _wrap(tokenizer, body, "")[::2]
    ids = _context_ids(tokenizer, part, plain)
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
        while True:
            if room < MIN_DOC_TOKENS:
                raise ExtractionError(f"row {rec.row_id} of task {task}: a context of at most {limit} leaves "
                                      "no room for the document after the prompt template")
            half = room // 2  # LongBench: keep the first and the last half
            doc = tokenizer.decode(doc_ids[:half]) + tokenizer.decode(doc_ids[len(doc_ids) - (room - half):])
            body = ctx_tmpl.format(context=doc)
            part, plain = _wrap(tokenizer, body, "")[::2]
            ids = _context_ids(tokenizer, part, plain)
            if len(ids) <= budget:
                break
            room -= len(ids) - budget + 2
    answers = list(rec.answers)
    return _finish(task, tokenizer, context_tokens, 0, index, body, part, ids, question_body,
                   answers[0], max_new, answers=answers, metric=metric,
                   meta={"row_id": rec.row_id, "truncated_from_tokens": truncated_from})


# ---------------------------------------------------------------------------------------


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
