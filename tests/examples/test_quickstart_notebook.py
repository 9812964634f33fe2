"""`examples/quickstart.ipynb` runs end to end on the CPU and does what its text says.

The notebook is executed with `nbclient` in a fresh IPython kernel of this interpreter (a
kernel spec written to a temporary directory, so no `python3` kernel registered elsewhere on
the machine can stand in), with the repository root as working directory and on PYTHONPATH, so
the kernel imports this checkout. The executed copy goes to a temporary directory; the
committed notebook keeps its outputs cleared.

The kernel does not get the 8 simulated devices `tests/conftest.py` asks for: the flag is
removed from its XLA_FLAGS, so it sees one CPU device, as on a Colab or Kaggle CPU runtime.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"
KERNEL_NAME = "jaxinfer-quickstart-test"
CELL_TIMEOUT_S = 600  # per cell; the whole notebook takes about 100 s on 2 CPU cores
DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")
TEXT = r"""('.+'|".+")"""  # a non-empty string as repr() prints it


def _kernel_manager(kernels: Path) -> AsyncKernelManager:
    """A kernel manager that starts `ipykernel` on exactly this interpreter."""
    spec = kernels / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxinfer test kernel", "language": "python"}))
    return AsyncKernelManager(kernel_name=KERNEL_NAME,
                              kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def _kernel_environment(ipython_directory: Path) -> dict[str, str]:
    """This process's environment, one CPU device, this checkout first on the import path."""
    env = dict(os.environ)
    flags = DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env["JAX_PLATFORMS"] = "cpu"
    env["IPYTHONDIR"] = str(ipython_directory)  # IPython's history database, not in $HOME
    return env


def _stdout(notebook: nbformat.NotebookNode) -> str:
    """Everything the code cells wrote to stdout and stderr, in order."""
    return "".join(output.get("text", "") for cell in notebook.cells
                   if cell.cell_type == "code" for output in cell.get("outputs", [])
                   if output.get("output_type") == "stream")


def _find(pattern: str, text: str, flags: int = 0) -> re.Match:
    match = re.search(pattern, text, re.MULTILINE | flags)
    assert match, f"no line matching {pattern!r} in the notebook's output:\n{text}"
    return match


def test_quickstart_notebook_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # connection files
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:  # the committed notebook carries no results
        assert cell.cell_type != "code" or (not cell.outputs and cell.execution_count is None)

    client = NotebookClient(notebook, km=_kernel_manager(tmp_path / "kernels"),
                            timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(REPO)}})
    started = time.perf_counter()
    # Raises CellExecutionError, with the cell and its traceback, if a cell fails.
    client.execute(env=_kernel_environment(tmp_path / "ipython"))
    seconds = time.perf_counter() - started
    nbformat.write(notebook, tmp_path / "quickstart.executed.ipynb")
    print(f"quickstart.ipynb ran in {seconds:.0f} s")
    check_outputs(_stdout(notebook))


def check_outputs(text: str) -> None:
    """Asserts that the executed notebook printed what each step promises."""
    # Install: found this checkout, installed nothing; platform: one CPU device, no sharding.
    assert "jaxinfer is already installed; nothing to do" in text
    assert f"jaxinfer from {REPO / 'jaxinfer'}\n" in text
    assert _find(r"^backend cpu: 1 x ", text)
    assert "tensor_parallel_size=1, data_parallel_size=1" in text

    # Generation: a batch of three greedy completions, with text.
    for prompt in ("The list type is", "A dictionary maps", "To open a file, use the"):
        assert _find(rf"^'{re.escape(prompt)}' -> {TEXT} \((length|stop)\)$", text)
    assert len(re.findall(rf"^sample [01]: {TEXT}$", text, re.MULTILINE)) == 2
    streamed = _find(r"^The for statement(.*?)\n\[(\d+) tokens, finished=True\]$", text,
                     re.DOTALL)
    assert streamed.group(1).strip() and int(streamed.group(2)) > 0
    assert _find(rf"^prompt: 'user: What does the list type do\?\\nassistant:'\nreply:  {TEXT}$",
                 text)

    # Quantization: int8 weights take about a quarter of float32's and barely move perplexity.
    ppl = {label: (float(value), float(mib)) for label, value, mib in re.findall(
        r"^ *(float32|int8): perplexity +([\d.]+) over \d+ tokens, block weights +([\d.]+) "
        r"MiB$", text, re.MULTILINE)}
    assert set(ppl) == {"float32", "int8"}, text
    (float_ppl, float_mib), (int8_ppl, int8_mib) = ppl["float32"], ppl["int8"]
    assert math.isfinite(float_ppl) and 1 < float_ppl < 1000
    assert abs(int8_ppl / float_ppl - 1) < 0.05
    assert 0.2 < int8_mib / float_mib < 0.3
    assert len(re.findall(rf"^  int8:    {TEXT}$", text, re.MULTILINE)) == 3

    # Distillation: the loss fell, the run reports a finite perplexity, the student generates.
    losses = _find(r"^loss: step 1 ([\d.]+) -> step 40 ([\d.]+)$", text)
    assert float(losses.group(2)) < float(losses.group(1))
    assert math.isfinite(float(_find(r"validation perplexity ([\d.]+)", text).group(1)))
    teacher, student = (float(_find(rf"^{label}: perplexity ([\d.]+) on the validation "
                                    r"docstrings$", text).group(1))
                        for label in ("teacher", "student"))
    assert 1 < teacher < student  # 40 steps do not catch up with the teacher
    assert _find(rf"^student: 'The list type is' -> {TEXT}$", text)

    # Serving: the same greedy completion over HTTP and gRPC, then a clean stop.
    http = _find(rf"^HTTP /v1/completions -> {TEXT} \{{", text).group(1)
    grpc = _find(rf"^gRPC Generate -> {TEXT} \['length'\]$", text).group(1)
    assert http == grpc
    assert _find(rf"^openai chat\.completions -> {TEXT}$", text)
    assert _find(rf"^server stopped; engine still usable: {TEXT}$", text)
