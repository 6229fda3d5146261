"""The code's shape, checked statically from the source: no import cycle between labkit's modules (imports
inside functions count: a cycle broken only by deferring an import is still a cycle), no argument parser
outside the command line, no private name imported across modules, the bottom layer imports nothing of labkit,
imports at the top of the file (the few left inside functions say why)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "labkit"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_target(mod: str, is_pkg: bool, node: ast.Call) -> str | None:
    """The module a `lazy.module("name", __package__)` call names: an import made later, still an import."""
    f = node.func
    if not (isinstance(f, ast.Attribute) and f.attr == "module" and isinstance(f.value, ast.Name)
            and f.value.id == "lazy" and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    name = node.args[0].value
    if not name.startswith("."):
        return name
    level = len(name) - len(name.lstrip("."))
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + [name[level:]])


def _imports(mod: str) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in `mod`, at any depth; `from pkg import sub` names the
    submodule when `sub` is one; a `lazy.module` of labkit's counts as an import of it."""
    f = MODULES[mod]
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Call):
            target = _lazy_target(mod, f.name == "__init__.py", node)
            if target and target.startswith("labkit"):
                out.append((target, []))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("labkit")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, f.name == "__init__.py", node)
            if not target.startswith("labkit"):
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out += [(s, []) for s in subs]
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest or not subs:
                out.append((target, rest))
    return out


def _graph() -> dict[str, set[str]]:
    g = {}
    for m in MODULES:
        # importing a module runs its packages' __init__ first: that edge is the language's, not a choice;
        # only the module's own imports count
        g[m] = {t for t, _ in _imports(m) if t in MODULES and t != m and not m.startswith(t + ".")}
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_labkit():
    assert _cycles(_graph()) == []


def _part(m: str) -> str:
    """The part of labkit a module belongs to: a subpackage (labkit.engine, labkit.report...) or a top-level module."""
    return ".".join(m.split(".")[:2])


def test_no_import_cycle_between_parts_of_labkit():
    """Data flows one way between the parts (shape -> engine -> experiment -> results -> report -> docs), at any import
    depth: a package that imports another never gets imported back by it, through any chain of modules."""
    assert _cycles(_part_graph()) == []


# The README's data-flow sentence names parts in words; each word is one part of labkit.
FLOW_PARTS = {"shape": "labkit.shapes", "engine": "labkit.engine", "experiment": "labkit.experiments",
              "run folder": "labkit.results", "report": "labkit.report", "docs": "labkit.docs"}
WRITTEN_INTO = {"run folder"}     # data that the part before it writes (through it), not code that calls back
# The parts that measure: a run's report renders what they wrote, never imports them.
MEASURING_PARTS = ("labkit.experiments", "labkit.quality", "labkit.crossmodel", "labkit.serving", "labkit.docs")


def _part_graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {_part(m): set() for m in MODULES}
    for m, targets in _graph().items():
        g[_part(m)] |= {_part(t) for t in targets if _part(t) != _part(m)}
    return g


def _reaches(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for t in g[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def _flow_sentence() -> list[str]:
    text = (REPO / "README.md").read_text()
    code_map = text[text.index("## Code map"):text.index("## What a run folder holds")]
    line = " ".join(code_map[code_map.index("Data flows one way:"):].split("(")[0].split())
    return [w.strip(" .") for w in line.removeprefix("Data flows one way:").split("→")]


def test_the_readme_data_flow_holds_edge_by_edge():
    """Each arrow of the README's "shape → engine → ..." is a real import and never runs back: the later part
    imports the earlier one (the engine builds a shape, the report reads a run folder), except the arrow into the
    run folder, which the experiment writes through `results`; the imported part reaches the importer through no
    chain of imports."""
    words = _flow_sentence()
    assert [w for w in words if w not in FLOW_PARTS] == [], "a word of the sentence names no part: add it to FLOW_PARTS"
    g = _part_graph()
    for a, b in zip(words, words[1:]):
        user, used = (FLOW_PARTS[a], FLOW_PARTS[b]) if b in WRITTEN_INTO else (FLOW_PARTS[b], FLOW_PARTS[a])
        assert used in g[user], f"{a} → {b}: {user} imports nothing of {used}"
        assert user not in _reaches(g, used), f"{a} → {b} runs back: {used} reaches {user}"


def test_the_report_renders_a_run_and_imports_no_measuring_code():
    g = _part_graph()
    assert sorted(_reaches(g, "labkit.report") & set(MEASURING_PARTS)) == []



# The generated docs blocks (`labkit docs`): an experiment's tables sit beside it, in labkit/experiments/NAME/tables.py;
# labkit/docs/ makes only the blocks that span experiments (or none): the README's headlines, the roofline's kernels,
# benches and spreads, the published model's study, the claims card (whose blocks come from claims.blocks, not here).
DOCS_WIDE_TABLES = {"labkit.docs.headlines", "labkit.docs.roofline_tables", "labkit.docs.reference_tables",
                    "labkit.docs.box"}       # the reference box predicted from the published shape, every doc alike


def test_every_docs_table_sits_beside_its_experiment_or_spans_several():
    """Each generated block's function lives in an experiment's tables.py or is one of docs' cross-experiment
    modules; labkit/docs/readme_tables.py binds blocks to functions and runs and draws no table itself."""
    import functools
    import re
    from labkit.docs import readme_tables       # the binding is data, read at run time: the registry itself

    made_by = readme_tables.producers()
    assert len(made_by) > 40, "the registry lost its blocks"
    assert all(isinstance(f, functools.partial) for f in made_by.values()), "bind with partial: a lambda hides its maker"
    where = {name: f.func.__module__ for name, f in made_by.items()}
    misplaced = {name: m for name, m in where.items()
                 if m not in DOCS_WIDE_TABLES and not re.fullmatch(r"labkit\.experiments\.\w+\.tables", m)}
    assert misplaced == {}, "an experiment's table goes to labkit/experiments/NAME/tables.py"
    src = MODULES["labkit.docs.readme_tables"].read_text()
    assert not any(w in src for w in ("md_table", "load_run", "read_parquet", "pd.")), \
        "readme_tables only assembles: the table code goes beside its experiment"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_lazy_module_counts_as_an_import():
    """The experiments name their measuring module lazily (their SPEC modules stay light); the import direction
    still sees the edge."""
    g = _graph()
    assert "labkit.experiments.capacity.measure" in g["labkit.experiments.capacity"]
    assert "labkit.experiments.quality.measure" in g["labkit.experiments.quality"]


def test_no_private_name_imported_across_modules():
    bad = [(m, t, n) for m in MODULES for t, names in _imports(m) for n in names
           if n.startswith("_") and not n.startswith("__") and t != m]
    assert bad == []


def test_only_the_cli_builds_an_argument_parser():
    """One command line: no module but the CLI makes a parser or reads sys.argv. The one exception runs
    vLLM's own parser (FlexibleArgumentParser) over a server command to check it, making none of ours."""
    users = sorted(m for m, f in MODULES.items()
                   if any(w in f.read_text() for w in ("ArgumentParser(", "import argparse", "sys.argv[1:]")))
    assert users == ["labkit.cli", "labkit.serving.launcher"]
    launcher = MODULES["labkit.serving.launcher"].read_text()
    assert "argparse.ArgumentParser(" not in launcher and "FlexibleArgumentParser(" in launcher


def test_bottom_layer_imports_nothing_of_labkit():
    assert [t for t, _ in _imports("labkit.params")] == []
    assert {t for t, _ in _imports("labkit.lazy")} == set()


def test_the_model_does_not_import_the_drivers():
    """Layers point one way: model <- transfer <- drive <- experiments; the model knows no driver."""
    g = _graph()
    for m, targets in g.items():
        if m.startswith("labkit.engine.model"):
            assert not any(t.startswith(("labkit.engine.drive", "labkit.experiments", "labkit.bench")) for t in targets), m
        if m.startswith("labkit.engine.transfer"):
            assert not any(t.startswith(("labkit.engine.drive", "labkit.experiments")) for t in targets), m


EXPERIMENT_PACKAGES = {d.name for d in (PKG / "experiments").iterdir() if (d / "__init__.py").is_file()}


def _experiment_of(m: str) -> str | None:
    """The experiment package a module belongs to (labkit.experiments.NAME...), None for any other module."""
    parts = m.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["labkit", "experiments"] and parts[2] in EXPERIMENT_PACKAGES \
        else None


def _sibling_imports(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in g.items() for t in targets
                  if _experiment_of(m) and _experiment_of(t) and _experiment_of(t) != _experiment_of(m))


def test_an_experiment_imports_no_other_experiment():
    """What several experiments share is a named module at labkit/experiments/*.py (device_rates, decode_session,
    trace_replay...), never a sibling's measure.py: a module of labkit/experiments/NAME/ imports its own package,
    the registry and the shared modules, no other experiment's package (the registry's `plan("decode", ...)` names
    another experiment by name, as a user does)."""
    assert _sibling_imports(_graph()) == [], "move what they share into a module at labkit/experiments/*.py"


def test_the_sibling_check_tells_shared_modules_from_experiments():
    g = {"labkit.experiments.capacity.measure": {"labkit.experiments.decode.measure", "labkit.experiments.decode_session",
                                                  "labkit.experiments", "labkit.experiments.capacity"},
         "labkit.experiments.decode_session": {"labkit.experiments.decode"}}
    assert _sibling_imports(g) == ["labkit.experiments.capacity.measure imports labkit.experiments.decode.measure"]


# experiments that build a model without the model parameters, and why
BUILDS_WITHOUT_MODEL_PARAMS = {
    "pulse": "the first PulseInfer replay, measured on the dense stand-in; the ladder supersedes it",
    "pulse_switch": "PulseInfer's switch on the dense stand-in's committed runs",
    "pulse_scaling": "PulseInfer's two-batch bound on the dense stand-in's committed runs",
}


def test_every_experiment_checks_a_plan_one_way():
    """`plan = planner(NAME, SPEC, measuring)` in each experiment's SPEC module, its checks in `measure.check`: a
    newcomer who copies any experiment copies the same way (no checks written inline in a `plan()`)."""
    root = PKG / "experiments"
    other = sorted(f.parent.name for f in root.glob("*/__init__.py")
                   if "plan = planner(NAME, SPEC, measuring" not in f.read_text() or "def plan(" in f.read_text())
    assert other == []
    no_check = sorted(f.parent.name for f in root.glob("*/measure.py") if "\ndef check(" not in f.read_text())
    assert no_check == []


def test_an_experiment_that_builds_a_model_takes_the_model_parameters():
    """weights_dtype, expert_banks, routing and the n-gram table reach `HybridModel` the same way in every
    experiment (`params.MODEL_PARAMS` in its SPEC, `params.model_kwargs` where it builds the model; a shared
    module that builds one for several passes them on), or the experiment says above why it holds the model one
    way only."""
    root = PKG / "experiments"
    builds, passes = set(), set()
    for f in root.rglob("*.py"):
        src = f.read_text()
        if "HybridModel(" in src:
            parts = f.relative_to(root).parts
            name = parts[0] if len(parts) > 1 else f.stem       # an experiment's package, or a shared module
            builds.add(name)
            if "model_kwargs(" in src:
                passes.add(name)
    in_spec = {f.parent.name for f in root.glob("*/__init__.py") if "*MODEL_PARAMS" in f.read_text()}
    packages = {f.parent.name for f in root.glob("*/__init__.py")}
    missing = sorted(n for n in builds - set(BUILDS_WITHOUT_MODEL_PARAMS)
                     if n not in passes or (n in packages and n not in in_spec))
    assert missing == [], f"building a HybridModel without MODEL_PARAMS and model_kwargs: {missing}"
    stale = sorted(n for n in BUILDS_WITHOUT_MODEL_PARAMS if n in passes or n not in builds)
    assert stale == [], f"exemptions no longer needed: {stale}"


def test_an_experiments_figures_sit_beside_it():
    """The report keeps what every figure draws with (report/figures.py); an experiment's own figures are
    labkit/experiments/NAME/figures.py, not a report/NAME_figures.py the report could not import."""
    assert sorted(f.name for f in (PKG / "report").glob("*figures*.py")) == ["figures.py"]


def test_the_readme_code_map_names_every_folder_and_top_level_module():
    text = (REPO / "README.md").read_text()
    block = text[text.index("## Code map"):text.index("## What a run folder holds")]
    missing = [f.name for f in PKG.glob("*.py") if f.stem not in ("__init__", "__main__") and f.name not in block]
    missing += [f"{d.relative_to(REPO)}/" for d in [*PKG.iterdir(), *(PKG / "engine").iterdir()]
                if d.is_dir() and d.name not in ("__pycache__", "engine") and f"{d.name}/" not in block]
    assert not missing, missing


# Functions over MAX_LINES lines that stay for now, each with why (a Triton kernel is exempt: one kernel is one
# launch, and splitting it would cost registers or a second pass). A new long function fails the test below; one
# split since must leave this list.
MAX_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}


def _long_functions() -> dict[str, int]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("jit" in ast.unparse(d) for d in node.decorator_list):      # a Triton kernel
                continue
            n = node.end_lineno - node.lineno + 1
            if n > MAX_LINES:
                out[f"{f.relative_to(REPO)}:{node.name}"] = n
    return out


def test_no_function_over_80_lines_outside_the_allow_list():
    long = _long_functions()
    assert {k: v for k, v in long.items() if k not in LONG_FUNCTIONS} == {}, "split it where it does several things"
    assert sorted(set(LONG_FUNCTIONS) - set(long)) == [], "split since: take it off LONG_FUNCTIONS"


# Imports belong at the top of the file, where a reader sees what a module depends on. One inside a function
# stays where a light module must stay light (the command line parses without torch, Triton, papermill or
# plotly: tests/test_cli.py), or where a package is optional; `lazy.module` keeps such a dependency in the
# header instead. The ceiling only comes down; each one says why, in a comment on it or above it in its function.
FUNCTION_LEVEL_IMPORTS_MAX = 50


def _function_level_imports() -> list[tuple[str, int, int]]:
    """(file, the import's line, its function's first line) for every import inside a function of labkit."""
    out = []
    for f in sorted(PKG.rglob("*.py")):
        rel = str(f.relative_to(REPO))

        def walk(node, fn):
            for ch in ast.iter_child_nodes(node):
                inner = fn
                if fn is None and isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = ch.lineno
                if fn is not None and isinstance(ch, (ast.Import, ast.ImportFrom)):
                    out.append((rel, ch.lineno, fn))
                walk(ch, inner)

        walk(ast.parse(f.read_text()), None)
    return out


def test_imports_are_at_the_top_of_the_file():
    found = _function_level_imports()
    assert len(found) <= FUNCTION_LEVEL_IMPORTS_MAX, \
        f"{len(found)} imports inside functions: move the new ones to the top (lazy.module where it must stay light)"
    lines = {rel: (REPO / rel).read_text().splitlines() for rel, _, _ in found}
    silent = [f"{rel}:{line}" for rel, line, start in found
              if not any("#" in ln for ln in lines[rel][start - 1:line])]
    assert silent == [], "say why this import is not at the top of the file (a comment on it or above it)"
