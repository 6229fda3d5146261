"""labkit.crossmodel.shm and the producer: the /dev/shm layout, and every way a file must be refused.

Files go to a tmp folder (the layout is the same on /dev/shm; `LABKIT_XFER_SHM` moves the root)."""

import struct

import pytest
import torch

from labkit.crossmodel import shm


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    """A KV key of this test's own (the user's real one, ~/.config/labkit/crossmodel.key, is left alone)."""
    monkeypatch.setenv("LABKIT_XFER_KEY", str(tmp_path / "keys" / "xfer.key"))


def _kv(L=3, H=2, T=10, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)) for _ in range(L)]


def test_roundtrip_and_layout(tmp_path):
    ids = list(range(100, 111))          # 11-token prompt, 10 covered
    kv = _kv()
    path = shm.path_for(ids, tmp_path)
    shm.write(path, kv, ids[:10], "fp123", "tiny", dtype=torch.bfloat16)
    assert not path.with_name(path.name + ".tmp").exists()
    hdr = shm.validate(path, ids, "fp123", 3, 2, 4, torch.bfloat16)
    assert (hdr.num_tokens, hdr.complete, hdr.dtype) == (10, 1, torch.bfloat16)
    assert path.stat().st_size == 4096 + 3 * 2 * 10 * 2 * 4 * 2
    raw = path.read_bytes()
    assert raw[:8] == b"LKXFERKV" and struct.unpack_from("<I", raw, 12)[0] == 1
    f = shm.KVFile(path, hdr)
    k, v = f.layer(2)
    assert k.shape == (10, 2, 4)
    assert torch.equal(k, kv[2][0][0].transpose(0, 1).to(torch.bfloat16))
    assert torch.equal(v, kv[2][1][0].transpose(0, 1).to(torch.bfloat16))
    f.close()


@pytest.mark.parametrize("case", ["magic", "incomplete", "truncated", "model", "shape", "tokens", "length", "version"])
def test_bad_files_are_refused_with_one_line(tmp_path, case):
    ids = list(range(11))
    path = shm.path_for(ids, tmp_path)
    if case == "incomplete":  # a producer that died after one layer
        shm.write(path, _kv(), ids[:10], "fp", crash_after_layers=1)
    else:
        shm.write(path, _kv(), ids[:10], "fp")
    want = {"fp": "fp", "L": 3, "ids": ids}
    if case == "magic":
        b = bytearray(path.read_bytes()); b[0:8] = b"GARBAGE!"; path.write_bytes(bytes(b))
    elif case == "version":
        b = bytearray(path.read_bytes()); b[8:12] = struct.pack("<I", 9); path.write_bytes(bytes(b))
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    elif case == "model":
        want["fp"] = "other-model"
    elif case == "shape":
        want["L"] = 30
    elif case == "tokens":
        want["ids"] = [0, 1, 2, 99] + ids[4:]
    elif case == "length":
        want["ids"] = ids[:5]
    with pytest.raises(shm.ShmError) as e:
        shm.validate(path, want["ids"], want["fp"], want["L"], 2, 4)
    msg = str(e.value)
    assert "\n" not in msg and msg
    expect = {"magic": "bad magic", "incomplete": "incomplete", "truncated": "size", "model": "made for model",
              "shape": "shape", "tokens": "token hash", "length": "covers 10 tokens", "version": "version"}[case]
    assert expect in msg


def test_too_small_shm_is_refused_before_writing(tmp_path):
    with pytest.raises(shm.ShmError, match="MiB free"):
        shm.check_space(tmp_path, 1 << 60)
    assert list(tmp_path.iterdir()) == []


def test_producer_writes_what_the_mapped_cache_holds(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_xfer_mapper import _fit_tiny, _tiny_checkpoint
    from labkit.crossmodel.pair import plan_pair
    from labkit.crossmodel.producer import Producer
    from labkit.crossmodel.mapped_cache import mapped_kv

    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    pair = plan_pair(str(_tiny_checkpoint(tmp_path / "large")), "first:2")
    models, mp = _fit_tiny(pair, "h:-1", n_seq=8)
    prod = Producer(models, mp, tmp_path / "shm", dtype=torch.float32)
    ids = list(range(3, 40))
    info = prod.produce(ids)
    hdr = shm.validate(info["path"], ids, pair.large.fingerprint, 3, 2, 8)
    assert hdr.num_tokens == len(ids) - 1
    ref = mapped_kv(models, mp, torch.tensor(ids[:-1]).view(1, -1))
    f = shm.KVFile(info["path"], hdr)
    for i in range(3):
        assert torch.equal(f.layer(i)[0], ref[i][0][0].transpose(0, 1))
    f.close()
    with pytest.raises(shm.ShmError, match="cover must be"):
        prod.produce(ids, cover=len(ids))


@pytest.mark.parametrize("layout", ["NB,H,BS,2D", "2,NB,H,BS,D", "NB,2,BS,H,D"])
def test_scatter_into_paged_cache_lands_in_the_request_blocks(tmp_path, layout):
    """What the connector does in vLLM's worker: file rows -> (block, offset) slots of the request's
    blocks, nothing else touched; read back through the same layout."""
    from labkit.crossmodel.paged import gather, scatter, split_kv

    L, H, T, D, BS, NB = 3, 2, 20, 4, 8, 6
    ids = list(range(T + 1))
    path = shm.path_for(ids, tmp_path)
    kv = _kv(L, H, T, D, seed=5)
    hdr = shm.write(path, kv, ids[:T], "fp", dtype=torch.float32)
    shape = {"NB,H,BS,2D": (NB, H, BS, 2 * D), "2,NB,H,BS,D": (2, NB, H, BS, D), "NB,2,BS,H,D": (NB, 2, BS, H, D)}[layout]
    caches = {f"model.layers.{i}.self_attn.attn": torch.full(shape, 7.0) for i in range(L)}
    assert split_kv(caches["model.layers.0.self_attn.attn"], H, D)[2] == layout
    blocks = [4, 1, 3]                    # 20 tokens over three non-contiguous blocks of 8
    f = shm.KVFile(path, hdr)
    scatter(f, caches, 8, 16, blocks, BS, H, D)      # tokens 0..7 already cached: load block 1 only
    f.close()
    for i in range(L):
        k, v = gather(caches[f"model.layers.{i}.self_attn.attn"], 8, 16, blocks, BS, H, D)
        assert torch.equal(k, kv[i][0][0].transpose(0, 1)[8:16]) and torch.equal(v, kv[i][1][0].transpose(0, 1)[8:16])
        k_other, _, _ = split_kv(caches[f"model.layers.{i}.self_attn.attn"], H, D)
        assert bool((k_other[[0, 2, 4, 5]] == 7.0).all()), "blocks of other requests must stay untouched"


def relocate_data(path, header_bytes: int) -> None:
    """Rewrite a valid file as if its header said `header_bytes` (data moved there, size made consistent):
    only the header_bytes check can tell."""
    raw = path.read_bytes()
    hdr = shm.read_header(path)
    data = raw[hdr.header_bytes:]
    head = bytearray(raw[:shm._FIXED])
    head[16:20] = struct.pack("<I", header_bytes)
    if header_bytes >= shm._FIXED:
        path.write_bytes(bytes(head).ljust(header_bytes, b"\0") + data)
    else:                                   # the fields stay at the front; data from header_bytes on
        path.write_bytes(bytes(head) + data[shm._FIXED - header_bytes:])
    assert path.stat().st_size == header_bytes + hdr.data_bytes


@pytest.mark.parametrize("header_bytes", [0, 64, 4095])
def test_wrong_header_bytes_refused_though_size_is_consistent(tmp_path, header_bytes):
    ids = list(range(11))
    path = shm.path_for(ids, tmp_path)
    shm.write(path, _kv(), ids[:10], "fp")
    relocate_data(path, header_bytes)
    with pytest.raises(shm.ShmError, match=f"header_bytes {header_bytes}") as e:
        shm.validate(path, ids, "fp", 3, 2, 4)
    assert "\n" not in str(e.value)


def overwrite_payload(path, value: float) -> None:
    """Every data element set to `value` under the file's untouched (valid) header."""
    hdr = shm.read_header(path)
    raw = bytearray(path.read_bytes())
    n = hdr.data_bytes // torch.tensor([], dtype=hdr.dtype).element_size()
    raw[hdr.header_bytes:] = torch.full((n,), value, dtype=hdr.dtype).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_corrupt_payload_under_a_valid_header_refused_by_checksum(tmp_path, value):
    ids = list(range(11))
    path = shm.path_for(ids, tmp_path)
    shm.write(path, _kv(), ids[:10], "fp", dtype=torch.float32)
    assert shm.validate(path, ids, "fp", 3, 2, 4, verify_payload=True).payload_crc32 != 0
    overwrite_payload(path, value)
    hdr = shm.validate(path, ids, "fp", 3, 2, 4)                    # the header alone cannot tell
    with pytest.raises(shm.ShmError, match="CRC-32"):
        shm.validate(path, ids, "fp", 3, 2, 4, verify_payload=True)
    f = shm.KVFile(path, hdr)                                         # nor can the worker's mapping
    assert not f.payload_ok()
    f.close()


@pytest.mark.parametrize("field,offset,value,msg", [
    ("complete", 12, 7, "complete flag 7"),
    ("pid", 36, 0, "empty field"),
    ("pid", 36, 0xFFFFFFFF, "above this system's pid_max"),
    ("layers", 24, 0, "empty field"),
    ("padding", 300, 1, "padding"),
])
def test_every_header_field_checked(tmp_path, field, offset, value, msg):
    ids = list(range(11))
    path = shm.path_for(ids, tmp_path)
    shm.write(path, _kv(), ids[:10], "fp")
    b = bytearray(path.read_bytes())
    b[offset:offset + 4] = struct.pack("<I", value)
    path.write_bytes(bytes(b))
    with pytest.raises(shm.ShmError, match=msg):
        shm.validate(path, ids, "fp", 3, 2, 4)


def test_created_in_the_future_refused(tmp_path):
    ids = list(range(11))
    path = shm.path_for(ids, tmp_path)
    shm.write(path, _kv(), ids[:10], "fp")
    b = bytearray(path.read_bytes())
    b[56:64] = struct.pack("<d", float("inf"))
    path.write_bytes(bytes(b))
    with pytest.raises(shm.ShmError, match="creation time"):
        shm.validate(path, ids, "fp", 3, 2, 4)
