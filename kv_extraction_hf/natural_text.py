"""Natural English text that exists on every CPython install (``pydoc_data.topics``): the
paragraphs and sentences behind the needle filler, the ``pydoc_ppl`` perplexity task and the
calibration text's held-out check. Separate because it is a text source, not a prompt.
"""

from __future__ import annotations

import functools
import random
import re


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


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    """``count`` consecutive natural sentences from a random start (wrapping around)."""
    sents = natural_sentences()
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(count)]
