"""Re-render every committed run's report with today's code, in a scratch copy (the committed folders are not
touched): `python scripts/rerender_all.py [--only SUBSTRING]`. Prints one line per run and exits 1 when any
run that has a notebook fails to draw."""
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    sys.path.insert(0, str(REPO))
    from labkit.experiments import EXPERIMENTS
    scratch = Path(tempfile.mkdtemp(prefix="labkit-rerender-"))
    shutil.copytree(REPO / "results" / "_assets", scratch / "_assets")
    bad = 0
    for mf in sorted((REPO / "results").glob("*/manifest.json")):
        run = mf.parent
        if only not in run.name:
            continue
        exp = json.loads(mf.read_text()).get("experiment", "")
        if exp not in EXPERIMENTS or not (run / "metrics.parquet").is_file():
            print(f"skip  {run.name}: " + (f"no notebook draws a {exp} run" if exp else "its manifest names no experiment")
                  if exp not in EXPERIMENTS
                  else f"skip  {run.name}: no metrics table")
            continue
        dst = scratch / run.name
        shutil.copytree(run, dst)
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "labkit", "report", str(dst), "--rerun"], cwd=REPO,
                           capture_output=True, text=True)
        ok = r.returncode == 0 and "Traceback" not in (dst / "report.html").read_text(errors="replace")
        bad += not ok
        last = (r.stderr.strip().splitlines() or [""])[-1][:160]
        print(f"{'ok   ' if ok else 'FAIL '} {run.name} ({exp}, {time.perf_counter() - t:.0f} s){'' if ok else ': ' + last}",
              flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
