"""The notebooks in notebooks/: committed without outputs, and each runs top to bottom on a
kernel of this environment (8 simulated CPU devices, inherited from conftest's settings)."""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: what each notebook must show a person: MIME types among its outputs, texts in its outputs
SHOWS = {
    "quickstart": ({"text/html", "image/png"},
                   ["hapsynth-report", "hapsynth-cluster", "hapsynth-plan",
                    "parameters after 3 steps equal jax.jit's"]),
    "clusters": ({"text/html", "image/png"}, ["hapsynth-cluster", "h100x8-t4x16", "of limit"]),
    "measure": ({"text/html", "image/png"}, ["this-machine", "measured", "predict"]),
}


def test_every_notebook_is_known_and_committed_without_outputs():
    assert {p.stem for p in NOTEBOOKS} == set(SHOWS)
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (
                    f"{path.name} has outputs: run `make strip-notebooks` before committing")
        assert "widgets" not in nb.metadata, f"{path.name} keeps widget state"


#: the measuring notebook times real runs (a minute on 2 cores), the clusters one plans
#: several presets (~20 s): they run with the slow set
HEAVY = {"measure", "clusters"}


@pytest.mark.notebook
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in HEAVY
                                  else p for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_and_shows_what_it_promises(path, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    mimes, texts = set(), []
    for cell in nb.cells:
        for out in cell.get("outputs", ()):
            assert out.output_type != "error", f"{path.name}: {out.get('ename')}: {out.get('evalue')}"
            data = out.get("data", {})
            mimes.update(data)
            texts += [out.get("text", ""), data.get("text/html", ""), data.get("text/plain", "")]
    want_mimes, want_texts = SHOWS[path.stem]
    assert want_mimes <= mimes, f"{path.name} shows {sorted(mimes)}"
    shown = "\n".join(texts)
    for text in want_texts:
        assert text in shown, f"{path.name} does not show {text!r}"
