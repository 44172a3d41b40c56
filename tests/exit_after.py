"""Run a worker script (argv[1], with the rest of argv as its own) as __main__, then leave
without the interpreter's teardown (conftest.torchrun_script runs every rank through this).

Bare multi-rank scripts on gloo, fsdp and ddp alike, aborted now and then after their work was
done and their process group destroyed: "terminate called without an active exception", no
Python frame left (a C++ thread still joinable as static objects are destroyed; torch 2.13 CPU,
2026-11-27: four CI runs in a row each lost one such worker). An exception in the script still
ends the process the usual way, with its traceback and a non-zero exit.
"""

import os
import runpy
import sys

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
