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
