"""notebooks/explore_results.ipynb runs top to bottom (nbclient + ipykernel) on the small fixture.

Run: python -m pytest tests/project/test_visualize_notebook.py -q
"""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "explore_results.ipynb"
FIXTURE = ROOT / "tests" / "fixtures" / "results_small.json"


def _outputs(nb, output_type=None):
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if output_type is None or out.output_type == output_type:
                yield out


def test_notebook_is_committed_without_outputs(committed_file):
    # the committed copy: a user who runs the notebook and saves it leaves outputs in the
    # working tree, which is theirs to keep
    nb = nbformat.reads(committed_file("notebooks/explore_results.ipynb").decode("utf-8"), as_version=4)
    nbformat.validate(nb)
    assert list(_outputs(nb)) == []
    assert all(c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


def test_notebook_runs_on_fixture(monkeypatch):
    monkeypatch.setenv("CACHEGEN_RESULTS", str(FIXTURE))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # cwd = notebooks/, as Jupyter would start it; raises CellExecutionError on any failing cell
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    assert list(_outputs(nb, "error")) == []
    text = "".join(out.get("text", "") for out in _outputs(nb, "stream"))
    assert f"read {FIXTURE}: 48 runs, 24 summaries" in text
    assert "skipped" not in text and "warning" not in text
    html = "".join(out["data"].get("text/html", "") for out in _outputs(nb, "display_data"))
    assert "median TTFT (s)" in html  # the summary table
    for label in ("cachegen-l2", "cachegen-adaptive", "1000 Mbit/s", "SmolLM2-135M-Instruct"):
        assert label in html
    images = [out for out in _outputs(nb, "display_data") if "image/png" in out["data"]]
    assert len(images) == 2  # TTFT vs bandwidth, quality vs size
    assert [out["data"]["text/plain"] for out in images] == [
        "<Figure size 750x480 with 1 Axes>", "<Figure size 1480x440 with 3 Axes>"]
