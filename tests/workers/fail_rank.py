"""Failure-handling worker: rank 1 fails right after joining; every other rank sleeps far
longer than the test allows, so only the launcher's kill can end them quickly.

``fail_rank.py [exit|raise]``: rank 1 calls ``sys.exit(3)`` (default) or raises an uncaught
exception (exit code 1).  Both must reach the launcher at once (initialize()'s fail-fast hooks),
not after jax's distributed shutdown barrier times out."""

import os
import sys
import time

from _harness import import_launch

launch = import_launch()
cfg = launch.initialize()
rank = cfg.process_id if cfg else 0
print(f"rank {rank} initialized, pid={os.getpid()}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "exit"
if rank == 1:
    if mode == "raise":
        raise RuntimeError("rank 1 failing on purpose with an exception")
    print("rank 1 failing on purpose with exit code 3", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(float(os.environ.get("FAIL_RANK_SLEEP", "300")))
