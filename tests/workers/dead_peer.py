"""A rank that dies mid-job (SIGKILL): what the survivors see. Started by tests/test_reliability.py as plain
processes (not through the launcher, which would kill the whole job at the first death).

Every rank: init a context over all devices, run a barrier (everyone alive), then rank --victim SIGKILLs itself;
the survivors run the barrier again and print ``ERROR_AFTER seconds message``, then ``CLOSE_AFTER seconds`` for
ctx.close(), then ``EXITING`` (the test measures the time from there to the process's exit).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--timeout", type=float, default=5.0, help="the context's timeout_s")
ap.add_argument("--heartbeat", type=int, default=30, help="jax.distributed heartbeat_timeout_seconds")
ap.add_argument("--shutdown", type=int, default=5, help="jax.distributed shutdown_timeout_seconds")
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--reraise", action="store_true", help="end with the op's error uncaught (launch's fail-fast exit)")
ap.add_argument("--no-init", action="store_true", help="the victim never calls jax_engram.init (it sleeps): the "
                "others' init must fail within the timeout (INIT_ERROR_AFTER seconds message)")
args = ap.parse_args()

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jax_engram.launch import initialize  # noqa: E402

cfg = initialize(heartbeat_timeout_seconds=args.heartbeat, shutdown_timeout_seconds=args.shutdown)
import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402

rank = jax.process_index()
mesh = jax.make_mesh((jax.device_count(),), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
if args.no_init:
    if rank == args.victim:
        time.sleep(2 * args.timeout + 5)
        os._exit(0)
    t0 = time.monotonic()
    try:
        je.init(mesh, "ep", timeout_s=args.timeout)
        print("INIT_OK", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"INIT_ERROR_AFTER {time.monotonic() - t0:.2f} {type(e).__name__}: {' '.join(str(e).split())[:600]}",
              flush=True)
    print("EXITING", flush=True)
    os._exit(0)
ctx = je.init(mesh, "ep", timeout_s=args.timeout)
f = jax.jit(jax.shard_map(lambda: je.barrier(ctx).reshape(1), mesh=mesh, in_specs=(), out_specs=P("ep")))
jax.block_until_ready(f())
print(f"READY rank {rank}", flush=True)
if rank == args.victim:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)  # the victim is gone
t0 = time.monotonic()
error = None
try:
    jax.block_until_ready(f())
    print("NO_ERROR", flush=True)
except Exception as e:  # noqa: BLE001
    error = e
    msg = " ".join(str(e).split())
    print(f"ERROR_AFTER {time.monotonic() - t0:.2f} {type(e).__name__}: {msg[:600]}", flush=True)
t0 = time.monotonic()
try:
    ctx.close()
    print(f"CLOSE_AFTER {time.monotonic() - t0:.2f}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"CLOSE_AFTER {time.monotonic() - t0:.2f} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}",
          flush=True)
print("EXITING", flush=True)
if args.reraise and error is not None:
    raise error
