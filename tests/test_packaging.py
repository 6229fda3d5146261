"""Installing labkit prints no setuptools deprecation boxes: pyproject.toml is read by setuptools itself
(the same code `pip install -e .` runs) and must raise no warning."""
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_without_setuptools_warnings():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_make_help_lists_every_documented_target():
    import re
    import subprocess
    p = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    header = re.findall(r"^#   make (\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    listed = re.findall(r"^make (\S+)", p.stdout, flags=re.M)
    assert listed == header and {"sweep", "test", "lab", "help"} <= set(listed)


def test_editable_install_as_the_makefile_runs_it_prints_nothing(tmp_path):
    """The Makefile's own editable-install line (its environment prefix and pip flags), run against a
    throwaway prefix without dependencies or build isolation (no network): nothing on the terminal."""
    import re
    import shlex
    import subprocess
    import sys
    line = next(l.strip() for l in (ROOT / "Makefile").read_text().splitlines()
                if "$(BIN)/python -m pip install" in l and " -e " in l)
    env_part, cmd = line.split("$(BIN)/python", 1)
    env = dict(kv.split("=", 1) for kv in shlex.split(env_part))
    # $(BYTECODE) as `make test` sets it (`make venv` leaves it empty)
    args = [{"$(BYTECODE)": "--no-compile"}.get(a, a) for a in shlex.split(cmd) if not a.startswith(".[")]
    assert args[:3] == ["-m", "pip", "install"] and re.search(r"-q\b", cmd)
    import os
    # --ignore-installed: pip must not uninstall the labkit this test runs from (it would, for a new prefix)
    p = subprocess.run([sys.executable, *args, ".", "--no-deps", "--no-build-isolation", "--ignore-installed",
                        "--prefix", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "" and p.stderr.strip() == "", (p.stdout + p.stderr)[-2000:]
