"""scripts/w4_sass.py's reading of a kernel listing: the K loop is the innermost backward-branch span that holds the
products, not the outer loop around it (whose count per weight byte would take in the epilogue), nor a short loop
elsewhere (a spin on an arrival counter)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import w4_sass  # noqa: E402


def _ins(addr: int, text: str) -> str:
    return f"        /*{addr:04x}*/                   {text} ;"


def test_the_loop_read_is_the_innermost_one_with_the_products():
    lines, a = [], 0

    def emit(text):
        nonlocal a
        lines.append(_ins(a, text))
        a += 16
    lines.append(".L_x_0:")                       # outer loop over a group's rows
    emit("MOV R1, R2")
    lines.append(".L_x_1:")                       # the K loop: 2 loads, 4 products
    for t in ("LDG.E.128 R4, desc[UR4][R2.64]", "LOP3.LUT R5, R4, 0xf, R9, 0xf8, !PT", "FADD R6, R5, -R7",
              "FFMA R8, R6, R3, R8", "FFMA R8, R6, R3, R8", "LDG.E R9, desc[UR4][R2.64]", "FFMA R8, R6, R3, R8",
              "FFMA R8, R6, R3, R8", "@P0 BRA `(.L_x_1)"):
        emit(t)
    emit("SHFL.BFLY PT, R3, R8, 0x1, 0x1f")      # the epilogue: outside the K loop
    emit("STG.E desc[UR4][R2.64], R8")
    emit("@P1 BRA `(.L_x_0)")
    lines.append(".L_x_2:")                       # a spin on a counter: a loop without products
    emit("LDG.E.STRONG.GPU R3, desc[UR4][R2.64]")
    emit("@P2 BRA `(.L_x_2)")
    body = w4_sass.loop_body(lines)
    assert len(body) == 9
    assert sum(" FFMA " in ln for ln in body) == 4
    assert not any("SHFL" in ln or "STG" in ln or "STRONG" in ln for ln in body)
    assert w4_sass.loop_body([_ins(0, "EXIT")]) == []


def test_the_stream_probe_reads_the_same_words_in_either_layout(tmp_path):
    """scripts/w4_stream_probe.py's kernel under the interpreter: the XOR of every word a launch reads is the XOR
    of the weight, in the engine's layout and in the tiled one (the tiled layout's blocks are the same words
    moved), at a split and without: a probe that skipped or repeated a tile would time other bytes."""
    import os
    import subprocess
    code = (
        "import sys, torch; sys.path.insert(0, 'scripts'); import w4_stream_probe as P\n"
        "from functools import reduce\n"
        "N, KW, BN, W = 32, 64, 16, 16\n"
        "w = torch.randint(-2**31, 2**31 - 1, (N * KW,), dtype=torch.int32)\n"
        "want = reduce(lambda a, b: a ^ b, w.tolist())\n"
        "tiled = w.view(N // BN, BN, KW // W, W).permute(0, 2, 1, 3).contiguous().view(-1)\n"
        "for layout, wt in (('rows', w), ('tiled', tiled)):\n"
        "    for split in (1, 3):\n"
        "        tiles = -(-(KW // W) // split); split = -(-(KW // W) // tiles)\n"
        "        o = torch.zeros((N // BN) * split, dtype=torch.int32)\n"
        "        P._stream[(N // BN, split)](wt, o, N, KW, tiles, BN=BN, W=W, TILED=layout == 'tiled', STAGES=1)\n"
        "        got = reduce(lambda a, b: a ^ b, o.tolist())\n"
        "        assert got == want, (layout, split, got, want)\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]
