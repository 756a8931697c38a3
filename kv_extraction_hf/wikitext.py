"""WikiText-2 for the quality benchmark: find the corpus, record where it came from, cut windows.

WikiText-2 (Merity et al., 2016, "Pointer Sentinel Mixture Models"; CC BY-SA 3.0) is the
perplexity corpus of CacheGen's evaluation (Liu et al., SIGCOMM 2024, section 7.1). The
test split is for evaluation only; anything fitted to data (bin schedules, transform
bases, calibration) must use the validation split.

Where the text comes from, in this order (:func:`load_wikitext2_split`):

1. ``data_path`` (``--data-path DIR``): a folder holding the split as ``test.txt`` /
   ``valid.txt`` (the tokenized layout of pytorch/examples ``word_language_model``),
   ``wiki.test.tokens`` / ``wiki.valid.tokens`` or ``wiki.test.raw`` / ``wiki.valid.raw``
   (the original archives), or one such file directly;
2. the Hugging Face hub through ``datasets`` (``Salesforce/wikitext``,
   ``wikitext-2-raw-v1``) when the hub answers within a few seconds (never tried under
   ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1`` unless the local datasets cache has it);
3. a ``data/wikitext-2`` folder in a ``shared`` folder beside the repository, when present.

None of them: one ExtractionError line naming all three. The corpus is never copied into
the repository; results record the source and the sha256 of the bytes read.

Run: ``python -m kv_extraction_hf.wikitext [--data-path DIR] [--split test]`` prints the
source, sha256, characters and (with ``--tokens``) the default model's token count.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import sys
from pathlib import Path

from cachegen_common import flags
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.textcheck import check_text

SPLITS = ("test", "valid")
WIKITEXT_HUB = ("Salesforce/wikitext", "wikitext-2-raw-v1")


def offline_requested() -> bool:
    """HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set to a true value."""
    return any(os.environ.get(v, "").lower() in {"1", "true", "yes", "on"}
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))

_FILE_NAMES = {
    "test": ("test.txt", "wiki.test.tokens", "wiki.test.raw"),
    "valid": ("valid.txt", "wiki.valid.tokens", "wiki.valid.raw"),
}
_HUB_SPLIT = {"test": "test", "valid": "validation"}


@dataclasses.dataclass(frozen=True)
class WikiText:
    """One WikiText-2 split as read: ``text`` (str), ``split`` ("test" | "valid"),
    ``source`` ("data-path" | "hub" | "shared-fallback"), ``location`` (file path or hub
    id), ``sha256`` (hex, of the file's bytes; for the hub, of the UTF-8 joined text)."""

    text: str
    split: str
    source: str
    location: str
    sha256: str

    def record(self) -> dict:
        """The provenance fields for a results file (everything but the text)."""
        return {"split": self.split, "source": self.source, "location": self.location,
                "sha256": self.sha256, "chars": len(self.text)}


def shared_fallback_dir() -> Path:
    """``<parent of the repository>/shared/data/wikitext-2`` (may not exist)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def _check_split(split: str) -> str:
    split = {"validation": "valid", "val": "valid"}.get(split, split)
    if split not in SPLITS:
        raise ExtractionError(f"unknown WikiText-2 split '{split}' (available: {', '.join(SPLITS)})")
    return split


def _find_file(folder: Path, split: str) -> Path | None:
    for name in _FILE_NAMES[split]:
        if (folder / name).is_file():
            return folder / name
    return None


def _read_file(path: Path, split: str, source: str) -> WikiText:
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ExtractionError(f"cannot read WikiText-2 file {path}: {exc}") from exc
    if not text.strip():
        raise ExtractionError(f"WikiText-2 file {path} holds no text")
    check_text(text, f"WikiText-2 file {path}")
    return WikiText(text, split, source, str(path), hashlib.sha256(raw).hexdigest())


def _from_data_path(data_path: str | os.PathLike, split: str) -> WikiText:
    path = Path(data_path).expanduser()
    if path.is_file():
        return _read_file(path, split, "data-path")
    if path.is_dir():
        found = _find_file(path, split)
        if found is None:
            raise ExtractionError(f"--data-path {path} holds none of {', '.join(_FILE_NAMES[split])}")
        return _read_file(found, split, "data-path")
    raise ExtractionError(f"--data-path {path} does not exist")


def _from_hub(split: str) -> WikiText | None:
    """The split from the hub through ``datasets``, or None when it cannot be had (fast)."""
    from kv_extraction_hf.model import hub_reachable

    offline = offline_requested()
    if not offline and not hub_reachable(timeout=3.0):
        return None
    try:
        import datasets
    except ImportError:
        return None
    try:
        if offline:  # only the local datasets cache: never block on the network
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        ds = datasets.load_dataset(WIKITEXT_HUB[0], WIKITEXT_HUB[1], split=_HUB_SPLIT[split])
        text = "\n".join(line.rstrip("\n") for line in ds["text"])
    except Exception:  # noqa: BLE001 - any hub/cache failure means "not available here"
        return None
    if not text.strip():
        return None
    check_text(text, "/".join(WIKITEXT_HUB) + f":{_HUB_SPLIT[split]}")
    return WikiText(text, split, "hub", "/".join(WIKITEXT_HUB) + f":{_HUB_SPLIT[split]}",
                    hashlib.sha256(text.encode("utf-8")).hexdigest())


def load_wikitext2_split(split: str = "test", data_path: str | os.PathLike | None = None,
                         use_hub: bool = True, fallback_dir: str | os.PathLike | None = None) -> WikiText:
    """Find and read one WikiText-2 split (see the module docstring for the order).

    ``split``: "test" (evaluation) or "valid"/"validation" (fitting). ``data_path``: a
    folder or file given by the user; when given, it is the only source tried (a bad one
    is an error, not a silent fallback). ``use_hub``: try the hub (False in tests).
    ``fallback_dir``: the discovered local folder (default :func:`shared_fallback_dir`).
    Returns a :class:`WikiText`. Raises ExtractionError (one line) for an unknown split,
    an unreadable/empty file, or when no source has the split.
    """
    split = _check_split(split)
    if data_path is not None:
        return _from_data_path(data_path, split)
    if use_hub:
        got = _from_hub(split)
        if got is not None:
            return got
    folder = Path(fallback_dir) if fallback_dir is not None else shared_fallback_dir()
    found = _find_file(folder, split) if folder.is_dir() else None
    if found is not None:
        return _read_file(found, split, "shared-fallback")
    raise ExtractionError(
        f"WikiText-2 {split} split not found: pass --data-path DIR (a folder with "
        f"{' or '.join(_FILE_NAMES[split])}), or make the hub reachable for datasets "
        f"('{'/'.join(('Salesforce/wikitext', 'wikitext-2-raw-v1'))}'), or place the files in {folder}")


def token_windows(num_tokens: int, window: int, count: int, seed: int = 0) -> list[int]:
    """Start offsets of ``count`` non-overlapping windows of ``window`` tokens in a stream
    of ``num_tokens`` tokens: the stream is cut into ``num_tokens // window`` slots and
    ``count`` of them are drawn with ``random.Random(seed)``; returned sorted. Raises
    ExtractionError when fewer than ``count`` slots exist or an argument is not positive."""
    if window <= 0 or count <= 0:
        raise ExtractionError(f"window ({window}) and count ({count}) must be positive")
    slots = num_tokens // window
    if slots < count:
        raise ExtractionError(f"the text holds {num_tokens} tokens: only {slots} non-overlapping windows "
                              f"of {window} tokens, {count} requested")
    picked = random.Random(seed).sample(range(slots), count)
    return sorted(s * window for s in picked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_extraction_hf.wikitext", description=__doc__.split("\n")[0])
    flags.add_data_path(parser, help="folder (or file) holding the WikiText-2 split")
    parser.add_argument("--split", default="test", help="test (evaluation) or valid (fitting)")
    parser.add_argument("--no-hub", action="store_true", help="do not try the hub")
    parser.add_argument("--tokens", action="store_true", help="also count the default model's tokens")
    args = parser.parse_args(argv)
    try:
        wt = load_wikitext2_split(args.split, args.data_path, use_hub=not args.no_hub)
    except ExtractionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rec = wt.record()
    if args.tokens:
        from kv_extraction_hf.model import load_model

        rec["tokens"] = len(load_model(log=lambda m: None).tokenizer(wt.text)["input_ids"])
    for key, val in rec.items():
        print(f"{key}: {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
