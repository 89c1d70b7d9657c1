"""GPU check of the CUDA runtime and the foundation ops (run on a machine with NVIDIA GPUs).

One process over all local GPUs::

    python tests/workers/gpu_foundation_check.py

or one process per GPU through the local launcher::

    python -m jax_engram.launch -n 2 --platform cuda tests/workers/gpu_foundation_check.py

It creates a context over every device (axis "ep", 64 MiB device + 64 MiB host reservation), prints
ctx.info() and the NCCL topology of each local member, runs barrier and ring_exchange (placements "device"
and "host", several sizes and dtypes, repeated calls) under jit + shard_map and compares with numpy, repeats
ring_exchange on a context without reservations (one allocation per buffer), checks that a peer that does not
arrive gives a recorded timeout (multi-process only: process 0 waits alone), and that init/close x5 leaks no
file descriptors. Prints "PASS <check>" / "FAIL <check>: ..." lines, then RESULT <json>; exit code 1 on failure.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for cuMem windows
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP/multicast stays off on our GPU hosts

try:
    from jax_engram.launch import emit_result, initialize, shutdown
except ModuleNotFoundError as e:
    if e.name == "jax_engram.launch":  # launcher not available: plain single-process run
        import json

        def initialize():
            return None

        def shutdown():
            pass

        def emit_result(obj):
            print("RESULT " + json.dumps(obj, default=str), flush=True)
    elif e.name == "jax_engram":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from jax_engram.launch import emit_result, initialize, shutdown
    else:
        raise

cfg = initialize()  # before anything starts a JAX backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram  # noqa: E402

PROC = jax.process_index()
NPROC = jax.process_count()
checks: dict[str, dict] = {}


def log(msg: str) -> None:
    print(f"[p{PROC}] {msg}", flush=True)


def record(name: str, ok: bool, detail: str = "", *, warn_only: bool = False) -> bool:
    status = "PASS" if ok else ("WARN" if warn_only else "FAIL")
    checks[name] = {"status": status, "detail": detail}
    log(f"{status} {name}" + (f": {detail}" if detail else ""))
    return ok


def run_check(name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # a crash of one check must not hide the others
        record(name, False, f"{type(e).__name__}: {e}")
        traceback.print_exc()


devices = jax.devices()
N = len(devices)
mesh = Mesh(np.array(devices), ("ep",))
log(f"jax {jax.__version__}, {NPROC} process(es), {N} devices: {[str(d) for d in devices]}")
log(f"local devices: {[(str(d), d.local_hardware_id) for d in jax.local_devices()]}")


def global_array(host: np.ndarray):
    """Global array sharded along 'ep' from the same host array on every process."""
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("ep")), lambda idx: host[idx])


def local_blocks(arr, block: int):
    """{rank: numpy block} for the shards this process holds."""
    out = {}
    for s in arr.addressable_shards:
        start = s.index[0].start or 0
        out[start // block] = np.asarray(s.data)
    return out


def smap(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_targets() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


# ------------------------------------------------------------------------------------------ context
t0 = time.time()
ctx = jax_engram.init(mesh, "ep", device_bytes=64 << 20, host_bytes=64 << 20, timeout_s=60.0)
init_s = time.time() - t0
info = ctx.info()
log(f"init took {init_s:.2f} s; ctx.info() = {info}")
topo = {}
if ctx.platform != "cpu" and ctx.ranks_per_gpu == 1:
    # NCCL is created on demand (collective): the side communicator, window and device communicator.
    topo = ctx.nccl_topology()
for m in ctx.members:
    if m.ordinal not in topo:
        continue
    t = topo[m.ordinal]
    log(f"topology of GPU {m.ordinal} (rank {m.rank}): {t}")
    record(f"nccl_window[gpu{m.ordinal}]", bool(t["window_registered"]), t["window_reason"], warn_only=True)
    record(f"nccl_devcomm[gpu{m.ordinal}]", bool(t["devcomm"]) and t["lsa_size"] >= 1,
           t["devcomm_reason"] or f"lsa {t['lsa_rank']}/{t['lsa_size']}", warn_only=True)


# ------------------------------------------------------------------------------------------ barrier
def check_barrier():
    K = 64
    x = global_array(np.arange(N, dtype=np.int32) * 7)

    def body(t):
        tok = t[0]
        for _ in range(K):
            tok = jax_engram.barrier(ctx=ctx, after=tok)
        return tok.reshape(1)

    f = smap(body)
    y = f(x)
    y.block_until_ready()
    ctx.check()
    got = local_blocks(y, 1)
    ok = all(int(v[0]) == 7 * r for r, v in got.items())
    iters = 20
    t1 = time.perf_counter()
    for _ in range(iters):
        y = f(x)
    y.block_until_ready()
    per = (time.perf_counter() - t1) / (iters * K) * 1e6
    ctx.check()
    record("barrier", ok, f"{K} chained barriers x {iters + 1} calls, ~{per:.1f} us per barrier (incl. dispatch)")


# ------------------------------------------------------------------------------------------ ring_exchange
def ring_case(c, placement: str, block: int, dtype, reps: int) -> tuple[bool, str]:
    f = smap(lambda xb: jax_engram.ring_exchange(xb, ctx=c, placement=placement))
    for it in range(reps):
        host = (np.arange(N * block) % 1000 + 1000 * it).astype(dtype)
        y = f(global_array(host))
        got = local_blocks(y, block)
        for r, blk in got.items():
            left = (r - 1) % N
            want = host[left * block:(left + 1) * block]
            if not np.array_equal(blk, want):
                bad = int(np.flatnonzero(blk != want)[0])
                return False, (f"rep {it}, rank {r}: element {bad} is {blk[bad]}, want {want[bad]} "
                               f"(block {block} x {np.dtype(dtype).name})")
    c.check()
    return True, f"{reps} reps"


def check_ring(c, label: str):
    cases = [(3, np.float32, 3), (1 << 10, np.int32, 5), ((1 << 20) // 2, jnp.bfloat16, 3), (4097, np.uint8, 3)]
    for placement in ("device", "host"):
        msgs, ok_all = [], True
        for block, dtype, reps in cases:
            ok, msg = ring_case(c, placement, block, dtype, reps)
            ok_all &= ok
            msgs.append(f"{block}x{np.dtype(dtype).name}: {msg}")
            if not ok:
                break
        record(f"ring_exchange[{label},{placement}]", ok_all, "; ".join(msgs))


run_check("barrier", check_barrier)
run_check("ring_exchange[reserved]", lambda: check_ring(ctx, "reserved"))


def check_unreserved():
    c2 = jax_engram.init(mesh, "ep", timeout_s=60.0)  # no reservations: one allocation per buffer
    try:
        check_ring(c2, "own-allocations")
    finally:
        c2.close()


run_check("ring_exchange[own-allocations]", check_unreserved)
ctx.close()


# ------------------------------------------------------------------------------------------ timeout
def check_timeout():
    """Process 0 runs a barrier that process 1 never joins: the kernel must give up after timeout_s and
    record the error (no trap, no hang); ctx.check() and the next op must report it."""
    c3 = jax_engram.init(mesh, "ep", timeout_s=3.0)
    try:
        x = global_array(np.zeros(N, dtype=np.int32))
        # Every process compiles (XLA's GPU compiler shares autotuning work between the processes of a job through
        # the coordination service, so a compile on process 0 alone waits for the others); only process 0 runs it.
        f = smap(lambda t: jax_engram.barrier(ctx=c3, after=t[0]).reshape(1)).lower(x).compile()
        if PROC != 0:
            record("timeout", True, "(process 0 checks)")
            return
        t1 = time.time()
        f(x).block_until_ready()
        waited = time.time() - t1
        errs = c3.errors()
        try:
            c3.check()
            raised = ""
        except jax_engram.JaxEngramError as e:
            raised = str(e)
        try:
            f(x).block_until_ready()
            next_op = ""
        except Exception as e:  # the poisoned context refuses the next op
            next_op = str(e)
        ok = bool(errs) and "timed out" in raised and "timed out" in next_op and 2.0 < waited < 30.0
        record("timeout", ok, f"waited {waited:.1f} s; error: {raised[:300]!r}; next op: {next_op[:120]!r}")
    finally:
        # close() is collective with c3's 3 s exchange timeout: meet first, with a generous bound.
        from jax_engram._jax_private import kv_client

        kv_client().wait_at_barrier("gpu_foundation_check/timeout_done", 300_000)
        c3.close()


if NPROC > 1:
    run_check("timeout", check_timeout)


# ------------------------------------------------------------------------------------------ lifecycle
def check_lifecycle():
    def cycle():
        c = jax_engram.init(mesh, "ep", device_bytes=64 << 20, host_bytes=64 << 20, timeout_s=60.0)
        g = smap(lambda xb: jax_engram.ring_exchange(xb, ctx=c, placement="host"))
        g(global_array(np.arange(N * 8, dtype=np.float32))).block_until_ready()
        c.check()
        c.close()

    cycle()  # warm-up: NCCL and the CUDA runtime keep some descriptors for the process lifetime
    before, before_t = fd_count(), fd_targets()
    t1 = time.time()
    for _ in range(5):
        cycle()
    per = (time.time() - t1) / 5
    after, after_t = fd_count(), fd_targets()
    leaked = {k: v for k, v in after_t.items() if k not in before_t}
    record("init_close_x5_fds", after <= before,
           f"fds before {before}, after {after}, {per:.2f} s per init+op+close" +
           (f"; new: {dict(list(leaked.items())[:10])}" if leaked else ""))


run_check("init_close_x5_fds", check_lifecycle)

failed = [k for k, v in checks.items() if v["status"] == "FAIL"]
log("ALL PASS" if not failed else f"FAILED: {failed}")
emit_result({
    "process_index": PROC, "process_count": NPROC, "devices": N, "ok": not failed, "failed": failed,
    "checks": checks, "init_s": init_s, "topology": {str(k): v for k, v in topo.items()},
    "launched": cfg is not None,
})
shutdown()
sys.exit(1 if failed else 0)
