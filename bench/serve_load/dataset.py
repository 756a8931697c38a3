"""The serve-load benchmark's requests: contexts from the project's prompt sources, which
of them are reused (their KV pre-filled in the store) and which are new, and the JSONL
file that vLLM's benchmark client reads (``--dataset-name custom``).

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7: requests whose long context was
seen before (its encoded KV cache is in the store) mixed with requests whose context is
new (prefilled from text).

Prompt sources (``kv_extraction_hf.prompts.build_prompt``): task ``auto`` takes the
CacheGen artifact's LongChat conversations (``../shared/data/cachegen-artifact/longchat.jsonl``,
middle-truncated to ``--context-tokens``) when that file is present, else the bundled
synthetic needle prompts that the main benchmark uses (offline everywhere).

Run: part of ``python -m bench.serve_load``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from cachegen_common.files import atomic_write_text

SHARED_LONGCHAT = Path(__file__).resolve().parents[3] / "shared" / "data" / "cachegen-artifact" / "longchat.jsonl"
# the question of the pre-fill request: another question than any benchmark request asks,
# so the stored entry shares only the context (the prefix) with the requests
PREFILL_QUESTION = "\n\nSummarize the text above in one sentence."


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run: the context it carries (index into the contexts), whether
    that context's KV is in the store (``reused``), the prompt text (context then the
    question: vLLM's client wraps it in the chat template) and its output tokens."""

    context: int
    reused: bool
    prompt: str
    output_tokens: int
    context_tokens: int = 0  # the context's size target (context_sizes), 0 when not given


def resolve_task(task: str, data_path: str | None) -> tuple[str, str | None]:
    """(task, data path) for ``build_prompt``: ``auto`` is ``longchat`` with the shared
    LongChat file when it exists (and no --data-path was given), else ``needle``."""
    if task != "auto":
        return task, data_path
    if data_path is None and SHARED_LONGCHAT.is_file():
        return "longchat", str(SHARED_LONGCHAT)
    return "needle", None


def context_sizes(count: int, n_reused: int, context_tokens: int,
                  new_context_tokens: Sequence[int] | None = None) -> list[int]:
    """The size target (tokens) of each of ``count`` contexts: the first ``n_reused`` (the
    reused ones, :func:`plan_requests`) ``context_tokens`` each; the new ones take
    ``new_context_tokens`` in turn (new context j: ``new_context_tokens[j % len]``), or
    ``context_tokens`` when it is None or empty. A length mix lets a short new context's
    prefill meet a TTFT SLO that a long one cannot. Raises ValueError on a count below 0,
    n_reused outside [0, count] or a size < 1."""
    if count < 0 or not 0 <= n_reused <= count:
        raise ValueError(f"need 0 <= reused ({n_reused}) <= contexts ({count})")
    new = list(new_context_tokens or [context_tokens])
    if min([context_tokens] + new) < 1:
        raise ValueError("context sizes must be >= 1 token")
    return [int(context_tokens) if i < n_reused else int(new[(i - n_reused) % len(new)])
            for i in range(count)]


def build_contexts(tokenizer, task: str, count: int, context_tokens: int | Sequence[int], seed: int = 0,
                   data_path: str | None = None, max_prompt_tokens: int | None = None) -> list:
    """``count`` distinct prompts (kv_extraction_hf Prompt: ``context_text``,
    ``question_text``, token ids) of ``task``, contexts of at most ``context_tokens``
    tokens (one size for all, or one per context: :func:`context_sizes`). Raises
    kv_extraction_hf.errors.ExtractionError (unknown task, unreadable data, a size too
    small), ValueError when two contexts come out identical (a data file with fewer rows
    than ``count``) or when a list of sizes is not ``count`` long."""
    from kv_extraction_hf.prompts import build_prompt

    sizes = [context_tokens] * count if isinstance(context_tokens, int) else list(context_tokens)
    if len(sizes) != count:
        raise ValueError(f"{len(sizes)} context sizes for {count} contexts")
    kw: dict[str, Any] = {"data_path": data_path} if data_path else {}
    if max_prompt_tokens:
        kw["max_prompt_tokens"] = max_prompt_tokens
    out = [build_prompt(task, tokenizer, sizes[i], seed=seed, index=i, **kw) for i in range(count)]
    if len({p.context_text for p in out}) != len(out):
        raise ValueError(f"task {task} gave fewer than {count} distinct contexts (--contexts)")
    return out


def plan_requests(prompts: Sequence, num_requests: int, reused_fraction: float,
                  output_tokens: tuple[int, int], seed: int = 0,
                  sizes: Sequence[int] | None = None) -> list[PlannedRequest]:
    """The requests of one run, in arrival order.

    The first ``round(len(prompts) * reused_fraction)`` contexts are the reused ones (their
    KV is pre-filled), the others new. Request i carries context ``i % len(prompts)``
    (shuffled once with ``seed``; every context appears before any repeats) with its own
    question, and asks for a uniform number of output tokens in ``output_tokens``
    (inclusive); ``sizes``: each context's size target (:func:`context_sizes`), copied into
    the requests (default 0). Raises ValueError for an empty plan, bad bounds or sizes not
    one per prompt."""
    lo, hi = output_tokens
    if num_requests < 1 or not prompts:
        raise ValueError("a run needs at least one request and one context")
    if not 1 <= lo <= hi:
        raise ValueError(f"output tokens must satisfy 1 <= min <= max, got {lo}..{hi}")
    if not 0.0 <= reused_fraction <= 1.0:
        raise ValueError(f"reused fraction must be in [0, 1], got {reused_fraction}")
    if sizes is not None and len(sizes) != len(prompts):
        raise ValueError(f"{len(sizes)} context sizes for {len(prompts)} contexts")
    n_reused = reused_count(len(prompts), reused_fraction)
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    out = []
    for i in range(num_requests):
        c = order[i % len(order)]
        p = prompts[c]
        out.append(PlannedRequest(c, c < n_reused, p.context_text + p.question_text,
                                  rng.randint(lo, hi), 0 if sizes is None else int(sizes[c])))
    return out


def reused_count(num_contexts: int, reused_fraction: float) -> int:
    """How many of ``num_contexts`` contexts are reused (pre-filled): the fraction,
    rounded half up."""
    return int(num_contexts * reused_fraction + 0.5)


def prefill_prompt(prompt) -> str:
    """The user message of the pre-fill (save) request of a reused context: the context
    then :data:`PREFILL_QUESTION` (not any benchmark question)."""
    return prompt.context_text + PREFILL_QUESTION


def write_dataset(path: Path | str, requests: Sequence[PlannedRequest]) -> Path:
    """Write ``requests`` as vLLM's custom dataset (``vllm.benchmarks.datasets.CustomDataset``):
    one JSON object per line, ``{"prompt": text, "output_tokens": n}`` (read with
    ``--custom-output-len -1``), in order (read with ``--disable-shuffle``). Atomic; returns
    the path. Raises ValueError for an empty list, OSError when the file cannot be written."""
    if not requests:
        raise ValueError("no requests to write")
    lines = [json.dumps({"prompt": r.prompt, "output_tokens": int(r.output_tokens)}, ensure_ascii=False)
             for r in requests]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return Path(path)
