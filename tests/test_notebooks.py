"""Every notebook runs top to bottom without an error, the way a reader runs it.

Each notebook executes in a fresh `python3` kernel (ipykernel from this same environment) with
the repository root as its working directory, so `import partNN_...` works as it does for a
reader who starts Jupyter at the root."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


def test_notebooks_are_saved_without_outputs():
    """Outputs are produced by running; the repository keeps notebooks small and diffable."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]
        assert not dirty, f"{path.name}: cells {dirty} were saved with outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, capsys):
    nb = nbformat.read(path, as_version=4)
    # `kernel_name="python3"` starts ipykernel from this interpreter even when no kernelspec has
    # been installed (jupyter_client falls back to the native kernel of the running Python).
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed after {time.perf_counter() - start:.1f} s:\n{e}")
    wall = time.perf_counter() - start
    with capsys.disabled():  # show the wall time even when pytest captures output
        print(f"\n{path.name}: ran in {wall:.1f} s", flush=True)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
