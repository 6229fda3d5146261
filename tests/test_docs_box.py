"""The reference box (3x RTX 3090) as every doc predicts it: `labkit.docs.box` takes `labkit predict`'s path
from the published shape's run, so the docs' tables, the claims card and the command print one figure a point."""
import json

import pytest

from labkit.cli import main
from labkit.docs import box
from labkit.docs.readme_tables import producers


def test_the_docs_box_table_is_what_labkit_predict_prints(capsys):
    assert main(["predict", "--json", "--context", "64K,1M", "--concurrency", "1,4"]) == 0
    cli = json.loads(capsys.readouterr().out)
    ours = box.box_table(contexts=[65536, 1 << 20], concurrency=[1, 4])
    assert cli["shape"] == "qwen3.8-flash-next" and len(cli["prediction"]) == len(ours)
    for want, (_, got) in zip(cli["prediction"], ours.iterrows()):
        assert (want["strategy"], want["context_len"], want["concurrency"]) == (got["strategy"], got["context_len"],
                                                                              got["concurrency"])
        assert want["predicted_step_ms"] == pytest.approx(got["predicted_step_ms"])


def test_every_3090_table_shows_the_published_shape_and_labels_a_stand_in():
    made = producers()
    z = box.box_table(contexts=[1 << 20], concurrency=[1]).set_index("strategy").loc["zero_copy", "predicted_tok_s"]
    for name in ("predict-rtx3090", "predict-now-rtx3090"):
        text = made[name]()
        assert "from the published shape's run" in text and "qwen3.8-flash-next, w4a16 weights, on one H100" in text
        row = next(line for line in text.splitlines() if line.startswith("| zero_copy | 1 | 1M |"))
        assert f"| {z:.1f} |" in row, name
        assert "stand-in" in text.splitlines()[0] and "stand-in shape's prediction" in text, name


def test_the_reference_run_reads_as_the_published_shape():
    assert box.run_shape(box.reference_run()) == "qwen3.8-flash-next"
