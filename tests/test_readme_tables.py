"""The README's measured tables are what the committed run folders say (regenerate with
`python -m labkit.report.readme_tables --write`)."""
from labkit.report.readme_tables import blocks, rewrite
from labkit.results import REPO


def test_readme_blocks_match_the_committed_runs():
    text = (REPO / "README.md").read_text()
    assert rewrite(text, blocks()) == text, "README tables differ from the runs: regenerate them"


def test_rewrite_replaces_only_between_markers():
    t = "a\n<!-- BEGIN generated:x -->\nold\n<!-- END generated:x -->\nb\n"
    assert rewrite(t, {"x": "new"}) == "a\n<!-- BEGIN generated:x -->\nnew\n<!-- END generated:x -->\nb\n"
