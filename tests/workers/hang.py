"""Timeout-handling worker: starts a grandchild in its process group (to check that the
launcher kills whole groups), prints ``pid=`` / ``grandchild_pid=`` (before the slow
jax.distributed start, so tests can always verify that everything died), joins the job and
then sleeps forever, like a deadlocked collective."""

import os
import subprocess
import sys
import time
from pathlib import Path

try:
    from jax_engram.launch import initialize
except ModuleNotFoundError as e:
    if e.name not in ("jax_engram", "jax_engram.launch"):
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from jax_engram.launch import initialize

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
print(f"pid={os.getpid()} grandchild_pid={child.pid}", flush=True)
initialize()
print("initialized; hanging", flush=True)
while True:
    time.sleep(3600)
