"""The `pydoc` corpus (Python's documentation topics, modern English prose) shared by the quality lab and the
cross-model lab: every topic in exactly one split, its text the interpreter's own, evaluation topics outside the
calibration's families, and both experiments accept the name."""
from __future__ import annotations

import pytest


def test_every_topic_in_one_split_with_its_own_text():
    from pydoc_data.topics import topics

    from labkit.quality.corpora import CORPORA, documents, read_document

    assert "pydoc" in CORPORA and CORPORA[:3] == ("code", "prose", "yaml")   # earlier corpora keep their draws
    ev, cal = documents("pydoc", "eval"), documents("pydoc", "calibration")
    names = [n for n, _ in ev] + [n for n, _ in cal]
    assert sorted(names) == sorted(topics) and len(set(names)) == len(names)
    assert 0 < len(cal) < len(ev)
    for name, path in ev[:5] + cal[:2]:
        assert read_document(path, "pydoc") == topics[name]


def test_evaluation_topics_share_no_reference_section_with_calibration():
    from labkit.crossmodel import heldout
    from labkit.quality.corpora import documents

    assert heldout.family("pydoc", "typesseq-mutable") == heldout.family("pydoc", "typesseq") == "typesseq"
    banned = {heldout.family("pydoc", n) for n, _ in documents("pydoc", "calibration")}
    kept = heldout.eval_documents("pydoc")
    assert kept and not {heldout.family("pydoc", n) for n, _ in kept} & banned
    assert len(kept) < len(documents("pydoc", "eval"))     # some evaluation topics sit in a calibration section


@pytest.mark.parametrize("name", ["quality", "crossmodel"])
def test_both_experiments_take_the_corpus_under_one_name(name):
    import importlib

    from labkit.params import resolve
    from labkit.quality.corpora import documents

    spec = importlib.import_module(f"labkit.experiments.{name}").SPEC
    assert resolve(spec, {"corpora": "prose,pydoc"}, name)["corpora"] == ["prose", "pydoc"]
    with pytest.raises(ValueError, match="choose from code, prose, yaml, pydoc"):
        documents("webtext")
