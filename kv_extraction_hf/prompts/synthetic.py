"""The synthetic retrieval tasks: ``needle`` (a passcode hidden in natural filler,
needle-in-a-haystack) and ``longchat_lines`` (LongEval "lines" retrieval). Pure functions
of (tokenizer, context_tokens, seed, index); scored by the last number of the answer.
"""

from __future__ import annotations

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.natural_text import filler_sentences
from kv_extraction_hf.prompts.base import Prompt, finish_prompt, fit_pieces, seeded_rng, wrap_chat

NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def needle_prompt(tokenizer, context_tokens: int, seed: int = 0, index: int = 0) -> Prompt:
    """A 5-digit passcode sentence at depth ``NEEDLE_DEPTHS[(seed + index) % 5]`` of natural
    filler; asks for the passcode. Scored by :func:`evaluation.retrieval_accuracy` (last
    number in the answer); 40 new tokens (the answer opens with a sentence)."""
    rng = seeded_rng("needle", seed, index)
    code = str(rng.randint(10000, 99999))
    depth = NEEDLE_DEPTHS[(seed + index) % len(NEEDLE_DEPTHS)]
    needle = f"The secret passcode is {code}."
    filler = filler_sentences(rng, 4 * context_tokens // 10 + 50)
    intro = "Read the following text. It contains a secret passcode that you must remember.\n\n"

    def body(chosen):
        sents = [filler[i] for i in chosen]
        sents.insert(round(depth * len(sents)), needle)
        return intro + " ".join(sents)

    chosen, part, ids = fit_pieces(tokenizer, lambda c: wrap_chat(tokenizer, body(c), "")[::2], filler,
                                   context_tokens, "needle", skip=True)
    question = "\n\nWhat is the secret passcode in the text above? Answer with the number."
    return finish_prompt("needle", tokenizer, context_tokens, seed, index, body(chosen), part, ids,
                         question, code, 40, meta={"depth": depth, "filler_sentences": len(chosen)})


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
    rng = seeded_rng("longchat_lines", seed, index)
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

    chosen, part, ids = fit_pieces(tokenizer, lambda c: wrap_chat(tokenizer, body(c), "")[::2], lines,
                                   context_tokens, "longchat_lines")
    n = len(chosen)
    if n < 2:
        raise ExtractionError(f"context_tokens={context_tokens} holds fewer than 2 lines for longchat_lines")
    target = rng.randrange(n)
    question = (f"\n\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {names[target]}? "
                "I need the number.")
    return finish_prompt("longchat_lines", tokenizer, context_tokens, seed, index, body(chosen), part, ids,
                         question, str(values[target]), 40, meta={"num_lines": n, "target_line": names[target],
                                                       "index_style": index_style})
