"""Notebooks: committed executed, and every one runs top to bottom in quick mode.

The convention (notebooks/NN_<name>.ipynb, one per part):

* **Committed executed.** A reader sees the measured outputs and plots on the repository's web
  view, so a notebook is saved with its outputs, from a full run on the course machine, by
  `python -m shared.course notebooks NN` (or `make notebooks`): every code cell executed in order
  in one fresh kernel, no error outputs, and `metadata.course.executed == "full"`. Never edit
  outputs by hand; re-run the command.
* **Quick mode.** The first code cell reads the environment variable and shrinks its workloads:

      QUICK = os.environ.get("COURSE_QUICK") == "1"   # tests: smaller workloads, same cells
      N_REQUESTS = 8 if QUICK else 24

  Every cell still runs, and every assertion in it still holds (a notebook's checks are proofs,
  not decoration); only the sizes of what is measured change: fewer requests, shorter outputs,
  fewer repeats, fewer points on a curve. Prose that quotes numbers refers to the full run.
* The tests run each notebook in quick mode (COURSE_QUICK=1 in the kernel's environment) in a
  fresh `python3` kernel whose working directory is the repository root, and never write it. Run
  alone, two go side by side (COURSE_NOTEBOOK_WORKERS): a quick run is mostly one core's start-up
  and Python, so the fifteen take about 40% less wall time; a notebook asserts no timing, so
  sharing is safe. Under `make test` (two pytest-xdist workers) one at a time.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from shared import course  # noqa: E402

NOTEBOOKS = course.notebook_paths()
CELL_TIMEOUT_S = 300
IDS = [p.stem for p in NOTEBOOKS]
# Under pytest-xdist (`make test`) another worker already shares the cores, and one notebook kernel
# at a time keeps the suite's memory in bounds.
WORKERS = int(os.environ.get("COURSE_NOTEBOOK_WORKERS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_executed(path: Path):
    nb = nbformat.read(path, as_version=4)
    problems = course.execution_problems(nb)
    assert not problems, (f"{path.name} is not committed executed (run `python -m shared.course "
                          f"notebooks {path.name[:2]}`):\n  " + "\n  ".join(problems))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_reads_quick_mode(path: Path):
    nb = nbformat.read(path, as_version=4)
    first = next((c for c in nb.cells if c.cell_type == "code"), None)
    assert first is not None and course.QUICK_ENV in first.source, \
        f"{path.name}: the first code cell must read {course.QUICK_ENV} (see this file's docstring)"


def _run_quick(path: Path):
    start = time.perf_counter()
    try:
        return course.execute_notebook(path, quick=True, timeout=CELL_TIMEOUT_S)
    except nbclient.exceptions.CellExecutionError as e:
        raise AssertionError(f"{path.name} failed after {time.perf_counter() - start:.1f} s:\n{e}") from None


@pytest.fixture(scope="module")
def quick_runs(request):
    """The quick run of every notebook this session selected, started in order on WORKERS threads
    the first time a test asks; each test collects its own. Leaving the module waits for (or
    cancels) whatever still runs."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_notebook_runs_quick"]
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="notebook")
    runs: dict[Path, Future] = {path: pool.submit(_run_quick, path) for path in selected}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_quick(path: Path, quick_runs, capsys):
    nb, wall = quick_runs[path].result()
    with capsys.disabled():  # show the wall time even when pytest captures output
        print(f"\n{path.name}: ran in {wall:.1f} s (quick mode, {WORKERS} side by side)", flush=True)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
