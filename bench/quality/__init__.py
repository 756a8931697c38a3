"""Quality of the codecs against the lossless KV: ``python -m bench.quality``.

The command's modules:
- ``bench.quality.cli``: the command: flags, the run in order, quality.json, --choose-default;
- ``bench.quality.config``: defaults and the input error (QualityError);
- ``bench.quality.text``: text fidelity on WikiText-2 windows: KL, top-1 agreement, perplexity change;
- ``bench.quality.default_level``: the --choose-default rule (the smallest cachegen level no worse than LMCache's schedule);
- ``bench.quality.targets``: --targets: operating points fitted on calibration text, measured on held-out text;
- ``bench.quality.per_layer_bits``: --targets ... --per-layer-bits: per-layer K/V bins from measured sensitivity against the uniform points at matched bytes;
- ``bench.quality.tasks``: task answers of each codec and level against the lossless answers;
- ``bench.quality.report``: the console tables.

This package's face: the names below are importable from ``bench.quality``.
"""
from bench.quality.config import ANSWER_PATHS, QualityError, TASK_LENGTHS, TOPIC_LENGTHS
from bench.quality.tasks import agreement_split, run_tasks, task_requests, task_rows
from bench.quality.cli import main, quick_hybrid_context
from bench.quality.default_level import choose_default_level
from bench.quality.text import parse_codec_spec, reference_scores, run_text_quality, window_scores

__all__ = [
    "ANSWER_PATHS", "QualityError", "TASK_LENGTHS", "TOPIC_LENGTHS", "agreement_split",
    "choose_default_level", "main", "parse_codec_spec", "quick_hybrid_context",
    "reference_scores", "run_tasks", "run_text_quality", "task_requests", "task_rows",
    "window_scores",
]
