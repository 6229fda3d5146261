"""The measured tables in README.md and docs/*.md are what the committed run folders say (regenerate with
`labkit docs --write`), and each block sits in the one file the generator names."""
from pathlib import Path

import pytest

from labkit.docs.readme_tables import BLOCK_FILES, RUNS, RUNS_FILE, blocks, by_file, markers, rewrite, write
from labkit.results import REPO


def _documents():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def generated():
    return blocks()


def test_every_block_regenerates_identically(generated):
    for rel, gen in by_file(generated).items():
        text = (REPO / rel).read_text()
        assert rewrite(text, gen, where=rel) == text, f"{rel}: tables differ from the runs: regenerate them"


def test_every_generated_block_sits_in_exactly_one_file_the_map_names(generated):
    assert set(generated) <= set(BLOCK_FILES), "a generated block has no file in BLOCK_FILES"
    held: dict[str, list[str]] = {}
    for p in _documents():
        for name in markers(p.read_text()):
            held.setdefault(name, []).append(str(p.relative_to(REPO)))
    for name in generated:
        assert held.get(name) == [BLOCK_FILES[name]], f"block {name} sits in {held.get(name)}, map says {BLOCK_FILES[name]}"
    stale = sorted(set(held) - set(generated))
    assert not stale, f"blocks no generator writes: {stale}"


def test_rewrite_replaces_only_between_markers():
    t = "a\n<!-- BEGIN generated:x -->\nold\n<!-- END generated:x -->\nb\n"
    assert rewrite(t, {"x": "new"}) == "a\n<!-- BEGIN generated:x -->\nnew\n<!-- END generated:x -->\nb\n"


def test_write_puts_each_block_in_its_own_file_and_refuses_a_missing_one(tmp_path, monkeypatch):
    import labkit.docs.readme_tables as rt
    (tmp_path / "docs").mkdir()
    a, b = tmp_path / "docs" / "a.md", tmp_path / "docs" / "b.md"
    a.write_text("<!-- BEGIN generated:x -->\n<!-- END generated:x -->\n")
    b.write_text("intro\n<!-- BEGIN generated:y -->\nold\n<!-- END generated:y -->\n")
    monkeypatch.setattr(rt, "BLOCK_FILES", {"x": "docs/a.md", "y": "docs/b.md"})
    write({"x": "X", "y": "Y"}, repo=tmp_path)
    assert a.read_text() == "<!-- BEGIN generated:x -->\nX\n<!-- END generated:x -->\n"
    assert b.read_text() == "intro\n<!-- BEGIN generated:y -->\nY\n<!-- END generated:y -->\n"
    # a block whose file lacks its markers: one clear error, and no file is written
    monkeypatch.setattr(rt, "BLOCK_FILES", {"x": "docs/a.md", "y": "docs/a.md"})
    with pytest.raises(ValueError, match="docs/a.md has no block generated:y"):
        write({"x": "X2", "y": "Y2"}, repo=tmp_path)
    assert a.read_text() == "<!-- BEGIN generated:x -->\nX\n<!-- END generated:x -->\n"
    with pytest.raises(ValueError, match="no file for generated block"):
        by_file({"z": "Z"})


def _run_paths(v):
    """Every results/ path in a docs/runs.toml value (a path, or lists of paths and labels)."""
    if isinstance(v, str):
        return [v] if v.startswith("results/") else []
    if isinstance(v, dict):           # per GPU: {h100 = RUN, h200 = RUN}
        v = list(v.values())
    return [p for x in v for p in _run_paths(x)]


def test_every_run_named_in_runs_toml_is_committed():
    named = [p for v in RUNS.values() for p in _run_paths(v)]
    assert len(named) > 40, "runs.toml lost its runs"
    # a run folder has its manifest; a named file (a check's JSON) is itself committed
    missing = [p for p in named if not ((REPO / p / "manifest.json").is_file()
                                        or (Path(p).suffix and (REPO / p).is_file()))]
    assert not missing, f"{RUNS_FILE.relative_to(REPO)} names runs that are not committed: {missing}"
