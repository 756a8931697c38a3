"""Defaults and the input error of the quality benchmark (``python -m bench.quality``):
codec lists, task lengths, batch sizes, quick-mode sizes, the margin split.
Part of bench.quality (the command is bench.quality.cli)."""

from __future__ import annotations

from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "quality.json"
FAMILY_DEFAULT = "cachegen"
TASKS = ("needle", "topic_retrieval")
TASK_LENGTHS = (1024, 2048, 3072, 4096)      # needle context lengths (tokens)
# topic retrieval is at chance for the default 135M model at >= 1K tokens (docs/tasks.md):
# it runs at 512 tokens, where the model is above chance
TOPIC_LENGTHS = (512,)
TASK_MAX_NEW_TOKENS = 40
# the codecs/levels measured on tasks by default: the default cachegen level, LMCache's schedule, kvtc's
# TTFT level and its near-lossless one, quant8 and raw (the check: agreement must be 1). KIVI-2 left
# the default to keep the run within 20 min (its answers were the slowest: 54 of 60 diverge
# and continue token by token; agreement 0.45 [0.33, 0.58] then): a --task-codecs list naming it measures it
DEFAULT_TASK_CODECS = "cachegen:1;cachegen-ref:0;kvtc:4,5;quant8;raw"
# codecs whose continuation runs in one batched forward (inject.continuation_logits_batch);
# 7 splits the 21 default rows into 3 forwards (~1.5 GB of KV, logits and activations)
DEFAULT_BATCH = 7
# codecs encoded + decoded at once (threads): the encoders are partly serial numba/numpy
# code that releases the GIL, so two of them share both cores better; identical bytes either
# way (codec.threads: a kernel's parallel and serial builds give the same results)
DEFAULT_CODEC_WORKERS = 2
# --quick is a smoke run (every codec and level on 4 short windows, each task kind twice):
# 4 windows x (512 + 128) tokens and 4 task requests; too few samples to rank codecs
QUICK_CONTINUATION = 128
QUICK_TASK_REQUESTS = 4
# how task answers are computed (run_tasks answer_mode) and the paths each records
# agreement_split: requests whose lossless answer's smallest top-2 logit margin is >= this
# (logits) vs below; chosen on the committed seed-0 requests (it separates the near-lossless
# kvtc 5's agreement 0.975 vs 0.70 there), checked on seed-1 requests (docs/results-schema.md)
MARGIN_SPLIT = 0.1
ANSWER_PATHS = {"batched": ("batched", "fallback"), "teacher": ("teacher-forced", "continued", "fallback")}


class QualityError(ValueError):
    """Bad user input for the quality benchmark (one-line message)."""


