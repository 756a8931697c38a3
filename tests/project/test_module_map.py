"""docs/modules.md (the module map a newcomer reads) is what scripts/module_map.py writes
from the modules' docstrings, no module is over 600 lines outside tests/ (a reason to look,
not a reason to cut: modules are cut by idea, see test_house_rules.py), and every module has
a docstring.

Run: .venv/bin/python -m pytest tests/project/test_module_map.py -q
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import module_map  # noqa: E402


def test_module_map_is_current():
    proc = subprocess.run([sys.executable, "scripts/module_map.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_module_sizes_and_docstrings():
    mods = module_map.modules()
    sizes = {p.relative_to(ROOT).as_posix(): module_map.lines(p) for p in mods}
    assert len(sizes) > 100
    assert [m for m, n in sizes.items() if n > 600] == []
    missing = [p.relative_to(ROOT).as_posix() for p in mods
               if not module_map.summary(p) and module_map.lines(p) > 5]
    assert missing == [], f"modules without a docstring: {missing}"


def test_summary_takes_the_first_sentence(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""One room, e.g. the rANS coder. More text.\n\nA second paragraph."""\nx = 1\n')
    assert module_map.summary(p) == "One room, e.g. the rANS coder."
    p.write_text("x = 1\n")
    assert module_map.summary(p) == ""
