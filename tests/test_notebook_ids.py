"""Every cell of every notebook carries an id in the file itself: nbformat warns
(MissingIDFieldWarning) on every `labkit run` that reads a notebook without them."""
import json
import warnings
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_cells_have_ids_and_reading_warns_nothing(name):
    raw = json.loads((NOTEBOOKS / name).read_text())
    ids = [c.get("id") for c in raw["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nbformat.read(NOTEBOOKS / name, as_version=4)
