"""A peer that fails: what the other ranks of a job see when rank --victim never calls jax_engram.init, skips an
op that the others call, dies by SIGKILL mid-job, or never joins the NCCL communicator of ``nccl_topology()``.
Started by tests/test_reliability.py as plain processes of one jax.distributed job (not through the launcher, which
would kill the whole job at the first death); CPU or CUDA as the launch environment says (on CUDA the ranks may
share one GPU: JAX_ENGRAM_GPUS=1).

Cases (--case):
  no_init    the victim never calls jax_engram.init; the others' init must fail (INIT_ERROR_AFTER seconds message).
  skip_op    every rank runs --op once (checked against numpy); then the victim skips its second call of it
             (engram_lookup: one-sided reads, so the others' lookup must succeed without the victim).
  kill       every rank runs --op once; then the victim SIGKILLs itself and the others run --op again.
  nccl_init  (CUDA) the victim takes part in nccl_topology()'s rendezvous (barrier, unique id) but never calls
             ncclCommInitRank, so the others wait in NCCL's bootstrap until the communicator's init expires. The
             shared-GPU refusal is bypassed with the private Context._nccl_topology(). Afterwards every rank runs a
             barrier (the context still works) and closes the context.

Every non-victim rank prints, one line each (seconds from the start of the call):
  ERROR_AFTER seconds by Type: message   the first error; by = "op" when the call raised, "check" when it returned
                                         and ctx.check() raised (a CUDA kernel records a timeout and returns)
                                         (or NO_ERROR when the op succeeded; its result is checked)
  NEXT_OP_AFTER seconds by Type: message   the same op once more (it must fail at once, with the same error)
  CLOSE_AFTER seconds [raised Type: message]
  EXITING                                the test measures the time from here to the process's exit
The victim of skip_op / no_init / nccl_init waits until the others are done (a key in jax.distributed's store);
after a skip_op without error both close the context.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from _harness import import_launch

ap = argparse.ArgumentParser()
ap.add_argument("--case", required=True, choices=["no_init", "skip_op", "kill", "nccl_init"])
ap.add_argument("--op", default="barrier", choices=["barrier", "dispatch", "engram_write", "engram_lookup"],
                help="skip_op / kill: the op the victim skips, or the survivors run after its death")
ap.add_argument("--timeout", type=float, default=5.0, help="the context's timeout_s")
ap.add_argument("--heartbeat", type=int, default=60, help="jax.distributed heartbeat_timeout_seconds")
ap.add_argument("--shutdown", type=int, default=5, help="jax.distributed shutdown_timeout_seconds")
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--reraise", action="store_true", help="kill: end with the op's error uncaught (launch's fail-fast "
                "exit), instead of os._exit(0)")
args = ap.parse_args()

cfg = import_launch().initialize(heartbeat_timeout_seconds=args.heartbeat, shutdown_timeout_seconds=args.shutdown)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram._jax_private import kv_client  # noqa: E402

AX = "ep"
rank = jax.process_index()
R = jax.device_count()
victim = rank == args.victim
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,))
DONE_KEY = "peer_fault/others_done"
VICTIM_CLOSED_KEY = "peer_fault/victim_closed"  # skip_op: the victim's close is over (the coordinator may exit)


def say(line: str) -> None:
    print(line, flush=True)


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:900]}"


def others_done(outcome: str = "error") -> None:
    kv_client().key_value_set(DONE_KEY, outcome)


def wait_for_others() -> str:
    """The others' outcome: "error" (they failed and close without meeting this rank) or "ok"."""
    try:
        return kv_client().blocking_key_value_get(DONE_KEY, int((3 * args.timeout + 20) * 1000))
    except Exception as e:  # noqa: BLE001 - the others are gone (the coordinator with them): nothing to wait for
        say(f"VICTIM_WAIT_ENDED {one_line(e)}")
        return "error"


def exit_now(code: int = 0) -> None:
    say("EXITING")
    sys.stderr.flush()
    os._exit(code)


if args.case == "no_init":
    if victim:
        say(f"VICTIM rank {rank} skips jax_engram.init")
        wait_for_others()
        os._exit(0)
    t0 = time.monotonic()
    try:
        je.init(mesh, AX, timeout_s=args.timeout)
        say("INIT_OK")
    except Exception as e:  # noqa: BLE001
        say(f"INIT_ERROR_AFTER {time.monotonic() - t0:.2f} {one_line(e)}")
    others_done()
    exit_now()

ctx = je.init(mesh, AX, timeout_s=args.timeout)
barrier = jax.jit(jax.shard_map(lambda: je.barrier(ctx=ctx).reshape(1), mesh=mesh, in_specs=(), out_specs=P(AX)))


def local(a):
    return np.asarray(a.addressable_shards[0].data)


def make_op(name: str):
    """(fn, check): fn() runs the op once over every rank; check(result) asserts the result of a normal call."""
    if name == "barrier":
        return barrier, lambda out: None
    if name == "dispatch":
        E, M, H, K = 2 * R, 8, 64, 2

        def routing(r):  # token t of rank r goes to experts (t + r + k) % E, k < K (distinct within a token)
            return (np.arange(M)[:, None] + r + np.arange(K)[None, :]) % E

        def body():
            r = jax.lax.axis_index(AX)
            x = (jnp.arange(M * H, dtype=jnp.float32).reshape(M, H) / 64 + r).astype(jnp.bfloat16)
            idx = (jnp.arange(M, dtype=jnp.int32)[:, None] + r + jnp.arange(K, dtype=jnp.int32)[None, :]) % E
            res = je.dispatch(x, idx, None, ctx=ctx, num_experts=E, max_tokens_per_rank=M)
            return res.num_recv_tokens.reshape(1)

        me = ctx.members[0].rank
        mine = range(me * E // R, (me + 1) * E // R)
        want = sum(int(np.isin(routing(r), mine).any(axis=1).sum()) for r in range(R))

        def check(out):
            got = int(local(out)[0])
            assert got == want, f"dispatch received {got} tokens on rank {me}, numpy says {want}"

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(AX)))
        return f, check
    if name in ("engram_write", "engram_lookup"):  # a lookup reads the peers' shards one-sided: it needs no peer
        N, H = 16, 64
        table = je.EngramTable(N, H, jnp.bfloat16, ctx=ctx, placement="device")
        data = (np.arange(R * N * H, dtype=np.float32).reshape(R * N, H) / 8).astype(jnp.bfloat16)
        ids = np.arange(R * N, dtype=np.int32).reshape(-1, 1)

        def check(out, rows=None):
            rows = table.lookup_global(ids)[0] if rows is None else rows
            got = local(rows).reshape(R * N, H)
            assert np.array_equal(got.view(np.uint16), data.view(np.uint16)), "the table read back differs"

        if name == "engram_write":
            return (lambda: table.write_global(data)), check
        table.write_global(data)
        return (lambda: table.lookup_global(ids)[0]), lambda rows: check(None, rows)
    raise ValueError(name)


def run_op(fn, check=None):
    """(by, error, seconds): run fn to completion, then ctx.check() (a CUDA kernel records its error and returns),
    then check(result) if given."""
    t0 = time.monotonic()
    try:
        out = jax.block_until_ready(fn())
    except Exception as e:  # noqa: BLE001
        return "op", e, time.monotonic() - t0
    try:
        ctx.check()
    except Exception as e:  # noqa: BLE001
        return "check", e, time.monotonic() - t0
    dt = time.monotonic() - t0
    if check is not None:
        try:
            check(out)
        except Exception as e:  # noqa: BLE001
            return "result", e, dt
    return None, None, dt


def report_error(fn, check=None) -> BaseException | None:
    by, e, dt = run_op(fn, check)
    if e is None:
        say(f"NO_ERROR after {dt:.2f}, result checked")
        return None
    say(f"ERROR_AFTER {dt:.2f} {by} {one_line(e)}")
    by2, e2, dt2 = run_op(fn)
    say(f"NEXT_OP_AFTER {dt2:.2f} {by2} {one_line(e2)}" if e2 else f"NEXT_OP_AFTER {dt2:.2f} ok")
    return e


def close() -> None:
    t0 = time.monotonic()
    try:
        ctx.close()
        say(f"CLOSE_AFTER {time.monotonic() - t0:.2f}")
    except Exception as e:  # noqa: BLE001
        say(f"CLOSE_AFTER {time.monotonic() - t0:.2f} raised {one_line(e)}")


if args.case in ("skip_op", "kill"):
    fn, check = make_op(args.op)
    check(jax.block_until_ready(fn()))  # every rank once: the op works
    ctx.check()
    jax.block_until_ready(barrier())
    say(f"READY rank {rank}")
    if victim and args.case == "kill":
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if victim:  # skip_op: the others call the op a second time, this rank does not
        say(f"VICTIM rank {rank} skips {args.op}")
        if wait_for_others() == "ok":  # nothing failed: the context is closed together
            close()
            kv_client().key_value_set(VICTIM_CLOSED_KEY, "1")
        exit_now()
    if args.case == "kill":
        time.sleep(0.5)  # the victim is gone
    error = report_error(fn, check)
    others_done("ok" if error is None else "error")
    close()
    if args.case == "skip_op" and error is None:
        # Process 0 hosts jax.distributed's coordination service and leaves with os._exit: let the victim finish
        # its side of the closing barrier first (bounded), or its barrier RPC finds the service gone.
        try:
            kv_client().blocking_key_value_get(VICTIM_CLOSED_KEY, int((args.timeout + 10) * 1000))
        except Exception as e:  # noqa: BLE001 - the victim is gone: nothing to wait for
            say(f"VICTIM_CLOSE_WAIT_ENDED {one_line(e)}")
    if args.reraise and error is not None:
        say("EXITING")
        raise error
    exit_now()

if args.case == "nccl_init":
    if ctx.platform == "cpu":
        raise SystemExit("nccl_init needs CUDA")
    jax.block_until_ready(barrier())
    say(f"READY rank {rank} ranks_per_gpu {ctx.ranks_per_gpu}")
    if victim:
        ctx._nccl_rendezvous()
        say(f"VICTIM rank {rank} joined the rendezvous and skips ncclCommInitRank")
        wait_for_others()
    else:
        t0 = time.monotonic()
        try:
            topo = ctx._nccl_topology()
            say(f"NO_ERROR after {time.monotonic() - t0:.2f}: {topo}")
        except Exception as e:  # noqa: BLE001
            say(f"ERROR_AFTER {time.monotonic() - t0:.2f} op {one_line(e)}")
        others_done()
    # The failed communicator left nothing behind: the context still works, and closes.
    by, e, dt = run_op(barrier)
    say(f"USABLE_AFTER {dt:.2f} ok" if e is None else f"USABLE_AFTER {dt:.2f} {by} {one_line(e)}")
    close()
    exit_now()
