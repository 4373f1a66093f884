"""The notebooks: committed with the outputs of a run (tables, plots, no errors), importing nothing of
workflows but the notebook API (workflows.workflow); and each runs top to bottom in a real Jupyter
kernel of this environment (nbclient + ipykernel), shrunk (WORKFLOWS_NOTEBOOK_TINY=1, overrides),
with its bucket, summaries and shard cache in a temp dir, joined to the session's Ray cluster: the
served model answers over HTTP."""

import ast
import asyncio
import json
import os
import sys

import pytest

from tests.conftest import ROOT, shutdown_serve
from tests.helpers import free_port

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
DIGITS_NOTEBOOK = ROOT / "notebooks" / "digits.ipynb"


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    return str(output.get("data", {}).get("text/plain", ""))


def _code(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _imports(source: str) -> set[str]:
    """The modules a code cell imports (IPython's %magics and !commands aside)."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    found = set()
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names if node.module == "workflows"}
    return found


@pytest.mark.parametrize("path", [NOTEBOOK, DIGITS_NOTEBOOK], ids=lambda p: p.name)
def test_committed_notebook_has_its_outputs(path):
    """A notebook is committed as run: every code cell executed, no error, at least one table and one
    image (PNG)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = _code(nb)
    assert code and all(c.execution_count is not None for c in code), "a code cell was not run"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("<table" in str(o.get("data", {}).get("text/html", "")) for o in outputs), "no table"
    assert any("image/png" in o.get("data", {}) for o in outputs), "no image"


@pytest.mark.parametrize("path", [NOTEBOOK, DIGITS_NOTEBOOK], ids=lambda p: p.name)
def test_notebook_imports_only_the_public_api(path):
    """Of workflows, a notebook imports the notebook API (workflows.workflow) only."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    ours = {m for c in _code(nb) for m in _imports(c.source) if m.split(".")[0] == "workflows"}
    assert ours == {"workflows.workflow"}, ours


def test_imports_of_a_cell_are_seen():
    assert _imports("%matplotlib inline\nimport os\nfrom workflows import registry\n"
                    "from workflows.pipeline.stages import stage_train") == \
        {"os", "workflows", "workflows.registry", "workflows.pipeline.stages"}


PYTHON_CHECK = 'import sys\nprint("python:", sys.executable)'


def run_notebook(path, tmp_path, ray_join, overrides: list[str], **env_extra: str) -> list:
    """`path` executed top to bottom in a real kernel of this interpreter, its bucket, summaries and
    shard cache under `tmp_path`, joined to the session's cluster, with `overrides`
    (WORKFLOWS_NOTEBOOK_SET) after the temp dirs and a free serve port. A first cell, added here and
    not committed, prints the kernel's interpreter, which must be this one. Returns the notebook's
    own code cells, none with an error."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    # A kernelspec of our own that runs this interpreter: a `python3` kernelspec elsewhere on the
    # machine (user or system Jupyter dirs) could point at another Python.
    spec_dir = tmp_path / "kernels" / "workflows-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "workflows (test)", "language": "python",
    }))
    km = AsyncKernelManager(kernel_name="workflows-test",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PYTHON_CHECK))
    client = NotebookClient(nb, km=km, timeout=900, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    # The kernel joins the session's cluster (it needs no fresh one), with the state API pointed at
    # that cluster's dashboard, so that Ray's helpers in it (Train's placement-group cleaner) find it
    # beside other clusters on the machine.
    sets = [f"storage.embedded.data_dir={tmp_path}/s3", f"output_dir={tmp_path}/runs",
            f"cache.dir={tmp_path}/cache", f"serve.port={free_port()}", *ray_join.overrides, *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MPLBACKEND")}
    # (no MPLBACKEND: the kernel's own inline backend, not one set for this shell)
    env.update(ray_join.env, WORKFLOWS_NOTEBOOK_SET="\n".join(sets), RAY_TRAIN_V2_ENABLED="1", **env_extra)
    shutdown_serve()  # the notebook deploys on the session's cluster: no Serve left there by another test
    try:
        client.execute(env=env)  # raises CellExecutionError, naming the cell, if a cell fails
    finally:
        nbformat.write(nb, tmp_path / f"{path.stem}.executed.ipynb")  # for a look after a failure
        if km.has_kernel:  # nbclient leaves a kernel manager it was given running
            asyncio.run(km.shutdown_kernel(now=True))
        shutdown_serve()  # the last cell does, unless a cell before it failed

    check, *code = _code(nb)
    assert f"python: {sys.executable}" in "".join(_text(o) for o in check.outputs)
    for cell in code:
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source
    return code


@pytest.mark.integration
def test_quickstart_notebook_runs_top_to_bottom(tmp_path, ray_join):
    code = run_notebook(NOTEBOOK, tmp_path, ray_join, [
        # smaller than the notebook's own tiny sizes: the cells, tables and plots are the same with
        # one trial of one epoch (no trial checkpoint) and one training epoch (tuning and training
        # themselves are tested in test_tune, test_train, test_jobs and on the shared pipeline run)
        "tune.num_samples=1", "tune.max_epochs=1", "tune.checkpoint=false", "train.epochs=1",
    ], WORKFLOWS_NOTEBOOK_TINY="1")
    texts = ["".join(_text(o) for o in c.outputs) for c in code]
    http = next(t for c, t in zip(code, texts) if "endpoint.predict(" in c.source)
    # the cell prints the response as indented JSON (Ray's worker logs may share the stream)
    body, _ = json.JSONDecoder().raw_decode(http[http.index('{\n  "predictions"'):])
    preds = body["predictions"]
    assert len(preds) == 4 and all(p["label"] in p["probabilities"] for p in preds)
    assert body["model"] == "notebook" and body["version"] == 1
    # the Serve metrics of those requests, scraped from the node (docs/OBSERVABILITY.md)
    scraped = next(t for c, t in zip(code, texts) if "wf.metrics(" in c.source)
    assert "ray_workflows_serve_requests_total" in scraped and "ray_workflows_serve_batch_size_bucket" in scraped
    plots = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(plots) >= 3  # tuning curves, training curves, the confusion matrix
    runs = tmp_path / "runs" / "notebook"
    assert all((runs / f"{s}.json").exists() for s in ("preprocess", "tune", "train"))


@pytest.mark.integration
def test_digits_notebook_runs_top_to_bottom(tmp_path, ray_join):
    """notebooks/digits.ipynb in a real kernel: one short epoch on one worker, its PNG answered."""
    code = run_notebook(DIGITS_NOTEBOOK, tmp_path, ray_join, [
        "train.epochs=1", "train.num_workers=1", "preprocess.concurrency=1", "tracking.enabled=false"])
    texts = ["".join(_text(o) for o in c.outputs) for c in code]
    grid = next(c for c in code if "wf.rows(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in grid.outputs)  # the image grid
    evaluated = next(t for c, t in zip(code, texts) if "wf.evaluate(" in c.source)
    assert "accuracy" in evaluated and "weighted F1" in evaluated
    served = next(t for c, t in zip(code, texts) if "wf.serve(" in c.source)
    assert "200 " in served and "(the scan is a 7)" in served, served
