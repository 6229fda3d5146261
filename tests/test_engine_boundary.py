"""The engine's boundaries as declared, checked in the source (no torch work):

- what the model's decode step reads of a batch's state is `StepBuffers`, and the runner's `DecodeState`
  provides all of it;
- the lab's measuring code changes the cache's state only through the cache's own calls (`set_lengths`,
  `free_slot`, `aliased`, `fill_random_`), never by writing its tensors or page lists."""
import ast
from pathlib import Path

from labkit.engine.model.step_state import StepBuffers

REPO = Path(__file__).resolve().parents[1]
LABKIT = REPO / "labkit"
MEMBERS = set(StepBuffers.__annotations__) | {"mark"}
# the cache's state: a write to one of these, or to anything under them, or an in-place call on them, from outside
# the engine bypasses its calls (an object's own `self.<name>` is its own business)
CACHE_STATE = {"lens", "pages", "dn_state", "dn_conv", "pool"}
IN_PLACE = {"fill_", "copy_", "zero_", "normal_", "add_", "index_copy_", "scatter_"}


def _reads_of(tree: ast.AST, names: set[str]) -> set[str]:
    """Attributes read off a name in `names`, or off `self.<name>`."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            v = n.value
            if isinstance(v, ast.Name) and v.id in names:
                out.add(n.attr)
            elif isinstance(v, ast.Attribute) and v.attr in names and isinstance(v.value, ast.Name) \
                    and v.value.id == "self":
                out.add(n.attr)
    return out


def test_the_decode_step_reads_only_the_declared_step_buffers():
    tree = ast.parse((LABKIT / "engine/model/forward.py").read_text())
    read = _reads_of(tree, {"st"})
    assert read, "the step's reads of its state were not found (renamed?)"
    assert read <= MEMBERS, f"the decode step reads {sorted(read - MEMBERS)}, not declared in StepBuffers"


def test_the_runner_state_provides_every_step_buffer():
    tree = ast.parse((LABKIT / "engine/drive/runner.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DecodeState")
    assert any(isinstance(b, ast.Name) and b.id == "StepBuffers" for b in cls.bases)
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    set_here = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert MEMBERS - set_here - methods == set()


def _state_touched(node: ast.AST) -> str | None:
    """The cache-state name a write target or call receiver goes through (`c.lens[:4]`, `c.pages.free`), or None;
    `self.<name>` alone is an object's own attribute."""
    chain = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and len(chain) == 1:
        return None
    return next((a for a in chain if a in CACHE_STATE), None)


def _cache_writes(path: Path, root: Path = REPO) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            if (name := _state_touched(t)):
                out.append(f"{path.relative_to(root)}:{n.lineno} writes .{name}")
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in IN_PLACE:
            if (name := _state_touched(n.func.value)):
                out.append(f"{path.relative_to(root)}:{n.lineno} .{name}.{n.func.attr}(...)")
    return out


def test_measuring_code_changes_the_cache_only_through_its_calls():
    lab = [p for p in LABKIT.rglob("*.py") if "engine" not in p.relative_to(LABKIT).parts[:1]]
    found = [w for p in lab for w in _cache_writes(p)]
    assert not found, "engine state written from outside the engine:\n" + "\n".join(found)


def test_the_check_finds_a_write_it_should(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text("def f(cache, c):\n    cache.lens[:4] = 8\n    c.lens.fill_(3)\n    c.pages.free = []\n"
                       "    c.set_lengths(8)\n    n = c.lens[0]\n")
    found = {w.split(" ", 1)[1] for w in _cache_writes(planted, tmp_path)}
    assert found == {"writes .lens", ".lens.fill_(...)", "writes .pages"}
