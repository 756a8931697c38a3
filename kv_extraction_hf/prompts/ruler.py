"""RULER's needle-in-a-haystack kinds as contexts that carry several questions: the answer
suite of ``python -m bench.answer_suite``.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv:2404.06654, section 3.1 and ``scripts/data/synthetic/niah.py``) hides
"One of the special magic numbers for {key} is: {value}." needles (7-digit values) in a
haystack and asks for a key's value(s). The kinds here:

- ``single``: one needle at the cell's depth, one question (RULER's niah_single).
- ``multikey``: four needles of distinct keys at four depths; each key is asked in turn, the
  other three are its distractors (RULER's niah_multikey; asked together: niah_multiquery).
- ``multivalue``: two keys of three values each, every value at its own depth; the question
  asks for all values of a key (RULER's niah_multivalue), scored by
  ``evaluation.all_values_match``.

All questions of a context share its prefill (``context_ids``); each question's depth is that
of its needle (for multivalue, of the key's first value). The haystack is natural English:
sentences of WikiText-2 (``haystack`` text, e.g. the test split read from the data flag) or,
offline by default, of the Python reference prose every CPython ships
(:func:`kv_extraction_hf.natural_text.natural_sentences`). Each context (cell) takes its
haystack from its own seeded position, in blocks of 4 sentences in a seeded order, and draws
its own keys and values, so contexts do not share a prefix past the chat header (checked per
run by ``bench.answer_suite``): no prefix cache can serve one from another.
Pure function of (tokenizer, kind, context_tokens, seed, index, haystack).
"""

from __future__ import annotations

import dataclasses
import re

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.natural_text import natural_sentences
from kv_extraction_hf.prompts.base import encode, fit_pieces, seeded_rng, wrap_chat

KINDS = ("single", "multikey", "multivalue")
# RULER's depths grid: 10%..90% of the haystack
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
# generation budget (a stop at EOS ends an answer sooner): a 7-digit value is 7 tokens in
# digit-split tokenizers (Qwen2, Gemma); a model often opens with ":\n\n" or a numbered list, and
# a multi-value answer often lists the other key's values too (Qwen2.5-Coder-1.5B stated 5-6
# values as "1. 9451559\n2. ..." and was cut mid-value at 40 tokens), so multivalue gets RULER's
# own budget for its needle tasks (tokens_to_generate 128)
MAX_NEW_TOKENS = {"single": 32, "multikey": 32, "multivalue": 128}
_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "ivory", "jolly", "keen",
        "lunar", "mellow", "nimble", "olive", "proud", "quiet", "rusty", "silent", "tidy", "umber", "vivid",
        "windy", "young", "zesty")
_NOUN = ("falcon", "harbor", "lantern", "meadow", "orchid", "pepper", "quarry", "river", "saddle", "thistle",
         "velvet", "willow", "anchor", "beacon", "canyon", "dagger", "ember", "fjord", "glacier", "hermit",
         "island", "jigsaw", "kettle", "lagoon", "marble")
_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.\n")


@dataclasses.dataclass
class SuiteQuestion:
    """One question of a context: ``question_ids`` (appended to the context's ids; the chat
    template's assistant header and RULER's answer prefix included), the gold ``answers``
    (all must be stated), the ``key`` asked and the ``depth`` (0..1) of its needle."""

    question_ids: list[int]
    answers: list[str]
    key: str
    depth: float
    max_new_tokens: int


@dataclasses.dataclass
class SuiteContext:
    """One context of the answer suite and its questions. ``context_ids``: the reusable part
    (its KV is what the codecs compress), at most ``context_tokens`` tokens; ``meta``: the
    needles (key, value, depth) and the haystack's source and start sentence."""

    name: str
    kind: str
    context_ids: list[int]
    questions: list[SuiteQuestion]
    meta: dict


def haystack_sentences(text: str | None = None) -> tuple[str, ...]:
    """The haystack's sentences: those of ``text`` (e.g. WikiText-2 test; its ``= headings =``
    and blank lines dropped, `` @-@ `` joins undone) or, when None, the offline natural
    sentences. Raises ExtractionError when the text has fewer than 50 sentences."""
    if text is None:
        return natural_sentences()
    out = []
    for line in text.split("\n"):
        line = line.strip()
        if not line or line.startswith("="):
            continue
        line = line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
        out.extend(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", line) if len(s) > 20)
    if len(out) < 50:
        raise ExtractionError(f"the haystack text has {len(out)} sentences (need at least 50)")
    return tuple(out)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _plan(kind: str, rng, cell_depth: float) -> list[tuple[str, list[str], list[float]]]:
    """[(key, values, depths of its values)] of a context of ``kind``."""
    keys = [f"{a}-{n}" for a, n in zip(rng.sample(_ADJ, 4), rng.sample(_NOUN, 4))]
    vals = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), 6)]
    if kind == "single":
        return [(keys[0], [vals[0]], [cell_depth])]
    depths = list(DEPTHS)
    start = DEPTHS.index(cell_depth)
    rot = depths[start:] + depths[:start]          # the cell's depth first, then the others in turn
    if kind == "multikey":
        return [(keys[i], [vals[i]], [rot[i]]) for i in range(4)]
    if kind == "multivalue":
        spread = rot + rot[:1]
        return [(keys[0], vals[0:3], [spread[0], spread[2], spread[4]]),
                (keys[1], vals[3:6], [spread[1], spread[3], min(0.95, spread[5] + 0.05)])]
    raise ExtractionError(f"unknown answer-suite kind '{kind}' (kinds: {', '.join(KINDS)})")


def suite_context(tokenizer, kind: str, context_tokens: int, seed: int = 0, index: int = 0,
                  haystack: tuple[str, ...] | None = None, haystack_name: str = "offline",
                  redraw: int = 0) -> SuiteContext:
    """Context ``index`` of ``kind`` at ``context_tokens`` tokens and its questions.

    The cell's depth is ``DEPTHS[index % 5]``; needles are placed at their depths of the fitted
    haystack (sentences from a seeded start, wrapping). ``haystack``: :func:`haystack_sentences`
    (None = offline). With a chat template the context part holds the template's header and
    the user message's context; each question part holds RULER's question, the assistant
    header and RULER's answer prefix. Raises ExtractionError for an unknown kind or a budget
    too small for the needles. ``redraw`` > 0: another draw of the same cell (see
    :func:`suite_contexts`)."""
    if kind not in KINDS:
        raise ExtractionError(f"unknown answer-suite kind '{kind}' (kinds: {', '.join(KINDS)})")
    sents = haystack if haystack is not None else haystack_sentences()
    rng = seeded_rng(f"ruler-{kind}-{context_tokens}" + (f"-r{redraw}" if redraw else ""), seed, index)
    plan = _plan(kind, rng, DEPTHS[index % len(DEPTHS)])
    start = rng.randrange(len(sents))
    count = 4 * context_tokens // 10 + 60
    run = [sents[(start + i) % len(sents)] for i in range(count + 4)]
    # blocks of 4 consecutive sentences in a seeded order: two cells that draw nearby starts still
    # begin (and go on) differently
    blocks = [run[i:i + 4] for i in range(0, count, 4)]
    rng.shuffle(blocks)
    filler = [x for b in blocks for x in b][:count]
    placed = sorted((d, _needle(key, v)) for key, values, depths in plan for v, d in zip(values, depths))

    def body(chosen):
        parts = [filler[i] for i in chosen]
        # depth d: before the first sentence boundary at which d of the haystack's characters lie
        # before it (RULER places by tokens; characters track them closely, sentence counts do not)
        ends = [0]
        for p in parts:
            ends.append(ends[-1] + len(p) + 1)
        at = [min(range(len(ends)), key=lambda i: abs(ends[i] - d * ends[-1])) for d, _ in placed]
        for j, ((_, text), i) in enumerate(zip(placed, at)):   # ascending depths: earlier inserts shift later ones
            parts.insert(i + j, text)
        return _HEAD + " ".join(parts)

    chosen, part, ids = fit_pieces(tokenizer, lambda c: wrap_chat(tokenizer, body(c), "")[::2], filler,
                                   context_tokens, f"answer-suite {kind}", skip=True)
    if len(chosen) < 5:
        raise ExtractionError(f"context_tokens={context_tokens} leaves fewer than 5 haystack sentences for "
                              f"the answer-suite {kind} context")
    questions = []
    for key, values, depths in plan:
        if len(values) == 1:
            q = f"\nWhat is the special magic number for {key} mentioned in the provided text?"
            prefix = f"The special magic number for {key} mentioned in the provided text is"
        else:
            q = f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
            prefix = f"The special magic numbers for {key} mentioned in the provided text are"
        _, qpart, _ = wrap_chat(tokenizer, "", q)
        questions.append(SuiteQuestion(question_ids=encode(tokenizer, qpart + prefix), answers=list(values),
                                       key=key, depth=depths[0], max_new_tokens=MAX_NEW_TOKENS[kind]))
    meta = {"needles": [{"key": key, "value": v, "depth": d} for key, values, depths in plan
                        for v, d in zip(values, depths)],
            "haystack": haystack_name, "haystack_start": start, "haystack_sentences": len(chosen),
            "redraw": redraw}
    return SuiteContext(name=f"ruler-{kind}-{context_tokens}t-s{seed}-i{index}", kind=kind, context_ids=ids,
                        questions=questions, meta=meta)


# haystack tokens after the header that must differ between any two contexts of a run
DISTINCT_PREFIX_TOKENS = 32


def suite_contexts(tokenizer, cells, seed: int = 0, haystack: tuple[str, ...] | None = None,
                   haystack_name: str = "offline", max_redraws: int = 20):
    """The contexts of ``cells`` ((kind, context_tokens, index) each), in order, each with
    a haystack whose first :data:`DISTINCT_PREFIX_TOKENS` tokens after the shared header
    differ from every earlier context's: a cell whose draw collides is drawn again
    (``redraw`` 1, 2, ..., recorded in its meta). Deterministic. A generator of
    :class:`SuiteContext`. Raises ExtractionError as :func:`suite_context`, or when
    ``max_redraws`` draws all collide."""
    head = len(encode(tokenizer, wrap_chat(tokenizer, _HEAD, "")[0], special=False))
    seen: set[tuple[int, ...]] = set()
    for kind, length, index in cells:
        for redraw in range(max_redraws + 1):
            c = suite_context(tokenizer, kind, length, seed, index, haystack, haystack_name, redraw)
            key = tuple(c.context_ids[head - 4:head + DISTINCT_PREFIX_TOKENS])
            if key not in seen:
                seen.add(key)
                break
        else:
            raise ExtractionError(f"{max_redraws} draws of the answer-suite cell ({kind}, {length}, {index}) all "
                                  "begin like an earlier context (the haystack is too small for the run)")
        yield c
