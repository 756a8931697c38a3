"""One check that a piece of user text is text a tokenizer can take (kind of
ai-microcore #74): JSON allows escapes of lone UTF-16 surrogates (``"\\ud800"``) that give
a Python ``str`` no UTF-8 encoder or tokenizer accepts (HF tokenizers fail deep inside
with ``TypeError: TextEncodeInput must be Union[...]``), and a NUL character marks binary
data, not text. Every data path (``--data-path`` JSONL rows, LongBench files, WikiText
files and the hub split, the calibration ``--data-path`` text) and the prompt builder's
tokenizer calls run it, so bad text is one ExtractionError line (exit 2 in the CLIs).
Library module, no command.
"""

from __future__ import annotations

from kv_extraction_hf.errors import ExtractionError


def check_text(text: str, where: str) -> str:
    """Return ``text`` unchanged if it is valid Unicode text, else raise.

    text: any ``str``. where: what it is, for the message (e.g. "data.jsonl row 3 field
    'context'"). Raises ExtractionError (one line, naming ``where``, the character and
    its position) for a lone surrogate (U+D800..U+DFFF: not encodable as UTF-8) or a NUL
    character (U+0000); also for a non-``str``.
    """
    if not isinstance(text, str):
        raise ExtractionError(f"{where}: expected text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        ch = text[exc.start]
        raise ExtractionError(
            f"{where}: not valid Unicode text: lone surrogate U+{ord(ch):04X} at character "
            f"{exc.start} (a JSON \\u{ord(ch):04x} escape without its pair?)") from None
    nul = text.find("\x00")
    if nul >= 0:
        raise ExtractionError(f"{where}: not text: NUL character (U+0000) at character {nul}")
    return text
