"""The default KVTC calibration text: English prose every set-up machine has offline.

KVTC learns its bases on calibration text (arXiv 2511.01815, section 3.1). The default
calibration (``kv_extraction_hf.calibrate.default_calibration``) must be fittable on a
fresh, offline machine with nothing beside the clone: no hub, no
``../shared``, no corpus committed to the project. The text used is the **docstrings of
a fixed list of pure-Python standard-library modules** (``STDLIB_MODULES``, shipped with
every CPython the harness supports), in a fixed order:

- per module: the module docstring, then each public class / function defined in that
  module (``obj.__module__`` is the module; sorted by name), then each class's public
  methods defined in the class body (sorted by name); ``__doc__`` as written (never
  inherited), ``inspect.cleandoc``-ed;
- code is stripped: a paragraph (blank-line separated) that holds a doctest (``>>>``),
  an indented line (a code example or a list of arguments), ``::``, or that does not end
  like a sentence (``.``) is dropped; short paragraphs (< 80 characters) too;
- each remaining paragraph is split into sentences with the same rule as
  ``kv_extraction_hf.natural_text.natural_sentences``; every sentence that also occurs in
  ``natural_sentences()`` (the ``pydoc_data.topics`` prose that the main job's needle
  filler and its ``pydoc_ppl`` perplexity pass evaluate on) is dropped, as is a sentence
  seen before, so the calibration text shares no sentence with the evaluated text by
  construction (tests/extraction/test_calibration_text.py checks it);
- paragraphs are joined with blank lines.

Why this text: it is real, human-written English prose (not generated filler), it is on
every machine the interpreter runs on, it needs no download and no licence beyond
CPython's (PSF), and it is disjoint from the text the main job measures on (pydoc
topics) and from WikiText-2 test (``bench.quality``). Its bytes depend on the Python
minor version (docstrings change between releases): ``calibration_text()`` returns the
exact text with its sha256 and the Python version, and every calibration record names
them (the default calibration's cache key includes the sha256, so a different text is a
different default).

Run: ``python -m kv_extraction_hf.calibration_text`` prints the record (sha256,
characters, sentences, Python version); ``--tokens`` adds the default model's token count.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import json
import re
import sys

__all__ = ["STDLIB_MODULES", "SOURCE", "calibration_text", "calibration_record", "main"]

SOURCE = "python-stdlib-docstrings"
# pure-Python stdlib modules with prose docstrings, present in every CPython 3.10-3.12
# build (no optional C extensions, no deprecated-and-removed modules); the order is fixed
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "concurrent.futures._base", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "email.message", "email.utils", "enum", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip",
    "heapq", "hmac", "html.parser", "http.client", "http.cookiejar", "http.server",
    "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder", "locale",
    "logging", "logging.handlers", "mailbox", "mimetypes", "netrc", "numbers",
    "optparse", "os", "pathlib", "pdb", "pkgutil", "platform", "poplib", "pprint",
    "queue", "random", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib",
    "socket", "socketserver", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "wsgiref.handlers", "zipfile",
)
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")   # prompts.natural_sentences'


def _docstrings(modname: str) -> list[str]:
    """The docstrings of ``modname`` in the documented order (missing module: none)."""
    try:
        mod = importlib.import_module(modname)
    except ImportError:
        return []
    docs = [mod.__doc__]
    for name in sorted(vars(mod)):
        obj = vars(mod)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != modname:
            continue
        if inspect.isclass(obj):
            docs.append(obj.__dict__.get("__doc__"))
            for mname in sorted(obj.__dict__):
                m = obj.__dict__[mname]
                if mname.startswith("_"):
                    continue
                f = getattr(m, "__func__", m)               # staticmethod / classmethod
                if isinstance(m, property):
                    f = m.fget
                if inspect.isfunction(f):
                    docs.append(f.__doc__)
        elif inspect.isfunction(obj):
            docs.append(obj.__doc__)
    return [inspect.cleandoc(d) for d in docs if isinstance(d, str) and d.strip()]


def _prose_paragraphs(doc: str) -> list[str]:
    """The prose paragraphs of one cleaned docstring, each on one line (code dropped)."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines or any(ln.startswith((" ", "\t")) or ln.lstrip().startswith(">>>")
                            for ln in lines):
            continue
        text = " ".join(ln.strip() for ln in lines)
        if len(text) < 80 or not text.endswith(".") or "::" in text or "`" in text \
                or re.fullmatch(r".*[*=\-^~#+]{3,}.*", text):
            continue
        out.append(text)
    return out


@functools.lru_cache(maxsize=1)
def _build() -> tuple[str, int, int]:
    from kv_extraction_hf.natural_text import natural_sentences

    taken = set(natural_sentences())
    seen: set[str] = set()
    paras, n_sent, n_dropped = [], 0, 0
    for modname in STDLIB_MODULES:
        for doc in _docstrings(modname):
            for para in _prose_paragraphs(doc):
                keep = []
                for s in _SENTENCE_SPLIT.split(para):
                    if s in taken:
                        n_dropped += 1
                    elif s not in seen:
                        seen.add(s)
                        keep.append(s)
                if keep:
                    n_sent += len(keep)
                    paras.append(" ".join(keep))
    return "\n\n".join(paras) + "\n", n_sent, n_dropped


def calibration_text() -> tuple[str, dict]:
    """(text, record) of the default calibration text (module docstring). ``record``:
    source, description, sha256 (hex, of the UTF-8 text), chars, sentences,
    dropped_overlap (sentences dropped because ``pydoc_data.topics`` has them), python
    (major.minor) and modules (how many of ``STDLIB_MODULES``). Deterministic for a given
    Python build."""
    text, n_sent, n_drop = _build()
    rec = {"source": SOURCE,
           "description": (f"English prose of the docstrings of {len(STDLIB_MODULES)} "
                           f"pure-Python standard-library modules of Python "
                           f"{sys.version_info[0]}.{sys.version_info[1]} "
                           f"(kv_extraction_hf.calibration_text.STDLIB_MODULES; code and "
                           f"doctests stripped; sentences of pydoc_data.topics dropped)"),
           "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "chars": len(text),
           "sentences": n_sent, "dropped_overlap": n_drop,
           "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
           "modules": len(STDLIB_MODULES)}
    return text, rec


def calibration_record() -> dict:
    """``calibration_text()[1]``."""
    return calibration_text()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kv_extraction_hf.calibration_text",
                                 description="Print the default KVTC calibration text's "
                                             "record (source, sha256, size).")
    ap.add_argument("--tokens", action="store_true", help="also count the default model's "
                    "tokens (loads its tokenizer)")
    ap.add_argument("--print", dest="show", action="store_true", help="print the text itself")
    args = ap.parse_args(argv)
    text, rec = calibration_text()
    if args.show:
        sys.stdout.write(text)
        return 0
    if args.tokens:
        from transformers import AutoTokenizer

        from kv_extraction_hf.errors import ExtractionError
        from kv_extraction_hf.model import default_model_dir

        try:
            tok = AutoTokenizer.from_pretrained(default_model_dir(log=lambda m: None))
        except (ExtractionError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rec["tokens"] = len(tok(text, add_special_tokens=False)["input_ids"])
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
