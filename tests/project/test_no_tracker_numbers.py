"""No tracker numbers in library code, tests and reference docs.

A comment, docstring or reference page says what a thing does and why; "issue 27.3",
"round 6" or "(#12)" tell a newcomer nothing (the tracker is not part of the repository).
Checked: every tracked Python file and shell script, the CI entry point (.ci/run), the
reference docs (docs/*.md; dated research notes under docs/notes/ keep their history),
README.md, CONTRIBUTING.md and benchmarks/README.md. Allowed: public upstream references ("vLLM #56311", "LMCache
#4972 / #4744"), named by their project within the same phrase, and data keys such as
"round3" (a tuning set's recorded name, no separator).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "CONTRIBUTING.md", "benchmarks/README.md")
# "issue 27", "Issue 14.7", "issues 12 and 13", "round 6", "round-6", "rounds 3-5", "issue #38";
# not "adaptation-rounds-3-6.md" (a notes file's name) nor "round3" (a data key).
# The number may follow on the next line (a wrapped comment or docstring: "Issue\n# 8").
TRACKER = re.compile(r"(?<![\w/-])(issues?|rounds?)(?:[ -]|[ \t]*\n[ \t#*>-]*)#?\d", re.IGNORECASE)
HASH_NUMBER = re.compile(r"(?<![\w&/])#\d+\b")
# Public projects whose issue / pull-request numbers the code cites as the kind of a fault.
EXTERNAL = re.compile(r"(vllm|lmcache|sglang|redis|safetensors|microcore|transformers|torch|triton|numba|"
                      r"kvpress|llama|huggingface|cpython|python|numpy|pytest|hypothesis|github)", re.IGNORECASE)


def _files() -> list[Path]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.py", "*.sh", ".ci/run", "docs/*.md", *DOCS],
                            capture_output=True, text=True, timeout=60)
    if listed.returncode == 0 and listed.stdout.strip():
        names = listed.stdout.split()
    else:   # not a git checkout: the same set from the folder
        names = [str(p.relative_to(ROOT)) for p in (*ROOT.rglob("*.py"), *ROOT.rglob("*.sh"))
                 if ".venv" not in p.parts] + [".ci/run"] + \
            [str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")] + list(DOCS)
    out = []
    for name in names:
        p = Path(name)
        if p.parts[:2] == ("docs", "notes") or (p.parts[0] == "docs" and len(p.parts) > 2 and p.suffix == ".md"):
            continue
        if (ROOT / p).is_file() and p != Path(__file__).resolve().relative_to(ROOT):   # this file's examples
            out.append(p)
    return out


def tracker_mentions(text: str) -> list[str]:
    """The tracker mentions of ``text``: each as "line N: excerpt"."""
    hits = [m.start() for m in TRACKER.finditer(text)]
    hits += [m.start() for m in HASH_NUMBER.finditer(text)
             if not EXTERNAL.search(text[max(0, m.start() - 60):m.start()])]   # the name may end the line before
    return [f"line {text.count(chr(10), 0, i) + 1}: {' '.join(text[max(0, i - 30):i + 30].split())}"
            for i in sorted(hits)]


def test_the_pattern_finds_tracker_mentions_and_spares_upstream_references():
    for bad in ("split out (issue 27)", "Issue 14.7: payload", "the round-6 tiers", "rounds 3-5 chose",
                "see issue #38", "fixed in (#12)", "issues 12 and 13", "# round 4: the floor",
                "the store server. Issue\n8; see docs/redis.md", "# as in round\n# 6"):
        assert tracker_mentions(bad), bad
    for ok in ("kind of vLLM #56311", "LMCache #4972 / #4744", "TUNING['round3']",
               "notes/2026-11-30-adaptation-rounds-3-6.md", "the issue is the scale", "rounding 0.5",
               "color: #fff", "&#39;", "safetensors #202", "(kind of LMCache\n#4827: keys ...)"):
        assert not tracker_mentions(ok), ok


def test_no_tracker_numbers_in_code_tests_and_reference_docs():
    bad = []
    for rel in _files():
        for hit in tracker_mentions((ROOT / rel).read_text(encoding="utf-8", errors="replace")):
            bad.append(f"{rel} {hit}")
    assert not bad, f"{len(bad)} tracker mentions (say what the thing does and why instead):\n" + "\n".join(bad[:80])
