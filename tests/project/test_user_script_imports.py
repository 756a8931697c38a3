"""A user's script kept in its own folder, beside files with the most common module names
(common.py, utils.py, config.py, helpers.py, ...), imports the harness's entry modules with
PYTHONPATH at the repository (a module whose optional dependency, e.g. lmcache, is not
installed is left out): no top-level name of the project is one that a user's file
beside a script shadows (Python puts the script's folder first on sys.path), and no
project module imports such a name.

The entry modules are found from the source (every module with a ``__main__`` block, the
two top-level scripts), so a command added later is covered without a change here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cachegen_common", "codec", "streaming", "kv_extraction_hf", "evaluation", "harness", "bench",
            "third_party", "visualize")
# Names a user's folder is likely to hold, each a file that would be imported instead of a
# project module of that name.
USER_FILES = ("common", "utils", "config", "helpers", "util", "settings", "constants", "data", "model",
              "models", "metrics", "run", "test", "main")


def _entry_modules() -> list[str]:
    found = ["run_benchmarks", "visualize_results"]
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if 'if __name__ == "__main__"' in text:
                mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found.append(mod.removesuffix(".__main__") if path.name == "__main__.py" else mod)
    return found


SCRIPT = """
import importlib, json, sys
entries = json.loads(sys.argv[1])
failed, optional = {}, {}
for mod in entries:
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as e:   # an optional dependency (lmcache, ...) absent from this venv
        top = (e.name or "").split(".")[0]
        (optional if top not in PROJECT and top not in USER_FILES else failed)[mod] = f"{type(e).__name__}: {e}"
    except Exception as e:  # a user's file shadowing a project module surfaces here
        failed[mod] = f"{type(e).__name__}: {e}"
# the user's own files are theirs: nothing of the harness imported them ...
shadowed = sorted(n for n in USER_FILES if n in sys.modules)
# ... and the script still imports them
import common, utils, config, helpers
print(json.dumps({"failed": failed, "optional": optional, "shadowed": shadowed,
                  "user": [m.ORIGIN for m in (common, utils, config, helpers)]}))
"""


def test_a_users_script_beside_common_py_imports_the_harness(tmp_path):
    user = tmp_path / "my_project"
    user.mkdir()
    for name in USER_FILES:
        (user / f"{name}.py").write_text(f'ORIGIN = "user"\nfiles = config = None  # the user\'s {name}.py\n')
    project = sorted({m.split(".")[0] for m in _entry_modules()} | set(PACKAGES))
    (user / "script.py").write_text(f"USER_FILES = {USER_FILES!r}\nPROJECT = {project!r}\n" + SCRIPT)
    entries = _entry_modules()
    assert {"run_benchmarks", "visualize_results", "kv_extraction_hf", "streaming.store"} <= set(entries)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cp = subprocess.run([sys.executable, str(user / "script.py"), json.dumps(entries)], cwd=user, env=env,
                        capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    out = json.loads(cp.stdout.strip().splitlines()[-1])
    assert out["failed"] == {}, out["failed"]
    assert out["shadowed"] == [], f"the harness imported the user's {out['shadowed']}"
    assert out["user"] == ["user"] * 4


def test_no_top_level_project_name_is_a_common_file_name():
    tops = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert not tops & set(USER_FILES), tops & set(USER_FILES)
    assert "cachegen_common" in tops and "common" not in tops
