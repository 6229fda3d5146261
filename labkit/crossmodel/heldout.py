"""Which text fits the mapper and which text scores it.

The corpora (`labkit.quality.corpora`) put every document in a calibration or an eval split by a hash of
its name. For the mapper that is not enough on its own: a play's parts (Henry VI parts 1-3) or a stdlib
package's modules land on both sides, and a play's first tokens are its title and cast list, the same form
in every play. So here:

- **calibration** (mapper fitting): `transfer.calibration_chunks` on the calibration split; λ is chosen on
  held-out calibration *documents* (`val_by="document"`), not on other chunks of the documents fitted on;
- **evaluation**: eval-split documents whose *family* (`family`: a play without its part number; a
  stdlib module's top-level package; a documentation topic's stem) has no document in the calibration split; `n` of them per corpus in
  an order drawn from `seed`, one window of `seq_len` tokens each at an offset drawn from the same seed
  (anywhere in the document, so not always the opening);
- `check_disjoint` refuses a draw that shares a document or a family with the calibration chunks, and
  `overlap` measures what is still shared (the share of a window's token 8-grams that occur in the
  calibration text: names, idioms, boilerplate).

`split_record` is what a run folder's manifest says about the split.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass
import hashlib

import numpy as np
import torch

from labkit.quality.corpora import documents, read_document

EVAL_SEED = 20261201     # the recorded default; a run's manifest records the seed it drew with
OVERLAP_K = 8            # n-gram length of `overlap`: long enough that shared 8-grams are shared text
RULE = ("calibration: the corpora's calibration split, lambda held out by whole documents; evaluation: eval-split "
        "documents whose family (a play's parts, a stdlib package) has no calibration document, one window per "
        "document at a seeded offset")


@dataclass(frozen=True)
class Seq:
    corpus: str
    document: str
    offset: int          # first token of the window in the tokenized document
    ids: object          # LongTensor [seq_len]


def as_seq(s) -> Seq:
    """A `Seq`, or a plain (corpus, document, ids) triple (a sequence with no recorded offset) as one."""
    return s if isinstance(s, Seq) else Seq(s[0], s[1], -1, s[2])


def family(corpus: str, name: str) -> str:
    """The unit a split must not cut: a play without its part number (`henry_vi_part_3_gut.txt` ->
    `henry_vi`), a stdlib module's top-level package (`email/mime/audio.py` -> `email`; a top-level module
    is its own family), a documentation topic's stem before the first hyphen (`typesseq-mutable` ->
    `typesseq`, `bltin-code-objects` -> `bltin`: the pages of one reference section)."""
    if corpus == "pydoc":
        return name.split("-", 1)[0]
    if corpus == "prose":
        stem = re.sub(r"_gut(_f)?\.txt$", "", name)
        return re.sub(r"_part_\d+$", "", stem)
    parts = name.split("/")
    return parts[0] if len(parts) > 1 else re.sub(r"\.py$", "", parts[0])


@functools.lru_cache(maxsize=None)
def calibration_families(corpus: str) -> frozenset[str]:
    """Families with a document in the corpus' calibration split (listing the stdlib is slow: once per process)."""
    return frozenset(family(corpus, n) for n, _ in documents(corpus, "calibration"))


def eval_documents(corpus: str):
    """(name, path) of the eval split without the families that have a calibration document, hash order."""
    banned = calibration_families(corpus)
    return [(n, p) for n, p in documents(corpus, "eval") if family(corpus, n) not in banned]


def _rng(seed: int, corpus: str) -> np.random.Generator:
    # one stream per corpus: adding a corpus does not move another corpus' draw
    return np.random.default_rng([int(seed), zlib.crc32(corpus.encode())])


def draw(tokenizer, corpora, seq_len: int, n: int, seed: int = EVAL_SEED, min_chars_per_token: float = 2.0) -> list[Seq]:
    """`n` windows of `seq_len` tokens per corpus from distinct evaluation documents, drawn by `seed`.
    Fewer eligible documents than `n` is an error, not a smaller sample."""
    if seq_len < 2 or n < 1:
        raise ValueError(f"need seq_len >= 2 and n >= 1, got seq_len={seq_len}, n={n}")
    out = []
    for corpus in corpora:
        docs = eval_documents(corpus)
        rng = _rng(seed, corpus)
        got = []
        for i in rng.permutation(len(docs)):
            name, path = docs[i]
            text = read_document(path, corpus)
            if len(text) < seq_len * min_chars_per_token:
                continue   # too short to hold seq_len tokens; skip without tokenizing
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) < seq_len:
                continue
            off = int(rng.integers(0, len(ids) - seq_len + 1))
            got.append(Seq(corpus, name, off, torch.tensor(ids[off: off + seq_len], dtype=torch.long)))
            if len(got) == n:
                break
        if len(got) < n:
            raise ValueError(f"corpus {corpus!r} has {len(got)} evaluation documents of {seq_len} tokens outside the "
                             f"calibration families, {n} asked for")
        out += got
    return out


def _calib_docs(calib) -> dict[str, set[str]]:
    """{corpus: document names} of calibration chunks named `corpus/document#j`."""
    out: dict[str, set[str]] = {}
    for _, cname, _ in calib:
        corpus, rest = cname.split("/", 1)
        out.setdefault(corpus, set()).add(rest.rsplit("#", 1)[0])
    return out


def check_disjoint(calib, seqs) -> None:
    """Raise ValueError (one line) if an evaluation window's document or family is among the calibration
    chunks' (`calib`: (split, 'corpus/document#j', ids) as `transfer.calibration_chunks` gives them)."""
    docs = _calib_docs(calib)
    for s in seqs:
        cal = docs.get(s.corpus, set())
        if s.document in cal:
            raise ValueError(f"evaluation document {s.corpus}/{s.document} is also calibration text")
        fam = family(s.corpus, s.document)
        if fam in {family(s.corpus, d) for d in cal}:
            raise ValueError(f"evaluation document {s.corpus}/{s.document} shares family {fam!r} with calibration text")


def overlap(calib, seqs, k: int = OVERLAP_K) -> list[float]:
    """Per evaluation window: the share of its token k-grams that occur anywhere in the same corpus'
    calibration chunks."""
    grams: dict[str, set] = {}
    for _, cname, ids in calib:
        t = [int(x) for x in ids]
        grams.setdefault(cname.split("/", 1)[0], set()).update(tuple(t[i: i + k]) for i in range(len(t) - k + 1))
    out = []
    for s in seqs:
        t = [int(x) for x in s.ids]
        g = [tuple(t[i: i + k]) for i in range(len(t) - k + 1)]
        cal = grams.get(s.corpus, set())
        out.append(sum(x in cal for x in g) / len(g) if g else 0.0)
    return out


def calib_sha(calib) -> dict:
    """The calibration text's identity as `transfer.fit_mapper` records it in a mapper file (16 hex digits of
    sha256 over chunk names and token ids, per split): a loaded mapper's own says whether it was fitted on
    this calibration text."""
    h = {"fit": hashlib.sha256(), "val": hashlib.sha256()}
    for split, name, ids in calib:
        h[split].update(name.encode() + ids.numpy().tobytes())
    return {"fit_sha256": h["fit"].hexdigest()[:16], "val_sha256": h["val"].hexdigest()[:16]}


def split_record(calib, seqs, seed: int, overlaps=None) -> dict:
    """The split as a manifest states it: rule, seed, calibration documents (fit / λ held-out) and the
    evaluation windows (document, offset) per corpus."""
    cal: dict = {}
    for split, cname, ids in calib:
        corpus, rest = cname.split("/", 1)
        c = cal.setdefault(corpus, {"fit": set(), "val": set(), "tokens": 0})
        c[split].add(rest.rsplit("#", 1)[0])
        c["tokens"] += int(len(ids))
    ev: dict = {}
    for i, s in enumerate(seqs):
        e = {"document": s.document, "offset": s.offset}
        if overlaps is not None:
            e["calib_overlap_8gram"] = round(float(overlaps[i]), 4)
        ev.setdefault(s.corpus, []).append(e)
    return {"rule": RULE, "eval_seed": int(seed), "overlap_k": OVERLAP_K,
            "calibration": {c: {"fit_documents": sorted(v["fit"]), "lambda_documents": sorted(v["val"]), "tokens": v["tokens"]}
                            for c, v in cal.items()},
            "excluded_families": {c: sorted(calibration_families(c)) for c in ev},
            "evaluation": {c: {"n": len(v), "windows": v} for c, v in ev.items()}}
