import atexit
import os
import sys
import threading

from .cli import main

rc = main()
# The interpreter's own exit then frees every module (torch, pandas, papermill, plotly: some 370,000 objects,
# collected and torn down one by one): 2-3 s of every heavy command on a loaded 2-core machine, with nothing
# left to save. When no thread of ours is still working, run the exit handlers (logging's flush, temporary
# folders, torch's and Jupyter's clean-up), flush the output and end the process there.
if all(t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):      # a reader gone (`labkit runs | head`) or a closed stream
            pass
    os._exit(rc if isinstance(rc, int) else 1 if rc else 0)
sys.exit(rc)
