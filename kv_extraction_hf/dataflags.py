"""The user-data flags, one definition for every entry point.

``--data-path FILE`` (with ``--task longchat|longbench|jsonl``, or the local file of
triviaqa/narrativeqa/wikitext2), ``--data-map context=F,question=F,answers=F`` /
``--data-field-{context,question,answers} F`` (generic JSONL), ``--no-truncate``
(refuse an over-long context instead of middle truncation). Used by
``python -m kv_extraction_hf``, ``run_benchmarks.py`` and the quality benchmark; the rows
are read by :func:`kv_extraction_hf.datasets_loaders.load_user_data`. docs/tasks.md
describes the formats.
"""
from __future__ import annotations

import argparse

from cachegen_common import flags
from kv_extraction_hf.datasets_loaders import parse_data_map
from kv_extraction_hf.errors import ExtractionError

DATA_FLAG_DESTS = ("data_map", "data_field_context", "data_field_question", "data_field_answers")
"""argparse destinations of the mapping flags (combined by :func:`data_map_from_args`)."""


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    """The user-data flags shared by every entry point (this CLI, run_benchmarks.py, the
    quality benchmark): ``--data-path`` (``cachegen_common.flags.add_data_path``; old ``--data``),
    ``--data-map``, ``--data-field-*``, ``--no-truncate``."""
    flags.add_data_path(parser, help="your own data: a JSONL file for --task longchat (the CacheGen artifact's "
                             "LongChat rows: test_id, prompt, label), longbench (context, input, answers) "
                             "or jsonl (any fields, see --data-map); also the local file of "
                             "triviaqa/narrativeqa/wikitext2")
    parser.add_argument("--data-map", default=None, metavar="context=F,question=F,answers=F",
                        help="--tasks jsonl: which field holds the context, the question and the answers")
    for role in ("context", "question", "answers"):
        parser.add_argument(f"--data-field-{role}", default=None, metavar="FIELD",
                            help=f"--tasks jsonl: the field holding the {role} (same as --data-map {role}=FIELD)")
    parser.add_argument("--no-truncate", dest="truncate", action="store_const", const=False, default=None,
                        help="refuse (naming the limit) a context longer than --context-tokens or the model's "
                             "context, instead of truncating it in the middle (LongBench's rule)")


def data_map_from_args(args) -> dict[str, str] | None:
    """The field mapping of ``--data-map`` and ``--data-field-*`` (None when neither is given).

    Raises:
        ExtractionError: a malformed ``--data-map`` or a role given twice differently.
    """
    mapping = parse_data_map(getattr(args, "data_map", None))
    for role in ("context", "question", "answers"):
        field = getattr(args, f"data_field_{role}", None)
        if field:
            if mapping.get(role, field) != field:
                raise ExtractionError(f"the {role} field is given twice ({mapping[role]!r} and {field!r})")
            mapping[role] = field
    return mapping or None


