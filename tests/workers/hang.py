"""Timeout-handling worker: starts a grandchild in its process group (to check that the
launcher kills whole groups), prints ``pid=`` / ``grandchild_pid=`` (before the slow
jax.distributed start, so tests can always verify that everything died), joins the job and
then sleeps forever, like a deadlocked collective."""

import os
import subprocess
import sys
import time

from _harness import import_launch

initialize = import_launch().initialize

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
print(f"pid={os.getpid()} grandchild_pid={child.pid}", flush=True)
initialize()
print("initialized; hanging", flush=True)
while True:
    time.sleep(3600)
