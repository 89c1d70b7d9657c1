"""Foundation checks on any platform: init/close, barrier, ring exchange (device and host segments),
two live contexts on different axes, bad arguments, timeouts that name op/rank/peer, no leaks.

Standalone (one process over all local devices):  python foundation_check.py [--platform cpu --cpu-devices 4]
Under the launcher:                               python -m jax_engram.launch -n 2 ... foundation_check.py
Prints `CHECK <name> PASS|FAIL <detail>` lines and one `RESULT <json>` line.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from _harness import Checks, shard, start

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="auto")
ap.add_argument("--cpu-devices", type=int, default=4)
ap.add_argument("--cycles", type=int, default=20)
ap.add_argument("--skip-timeout", action="store_true")
args = ap.parse_args()

cfg = start(args.platform, args.cpu_devices)
from jax_engram import launch  # noqa: E402
import jax  # noqa: E402

if cfg is None and args.platform != "cpu":
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # CPU devices too, should JAX pick the CPU
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402

checks = Checks()
check = checks.run
results = checks.results
multi = jax.process_count() > 1


def global_blocks(mesh, axis, per_rank):
    """Global array [R*per_rank] sharded along `axis`, value = 1000*global_rank + i, built per process."""
    n = mesh.shape[axis]
    full = (np.arange(n)[:, None] * 1000 + np.arange(per_rank)[None, :]).astype(np.float32).reshape(-1)
    return shard(full, mesh, P(axis)), full


def local_equal(arr, expected_full):
    for s in arr.addressable_shards:
        if not np.array_equal(np.asarray(s.data), expected_full[s.index]):
            return False
    return True


devices = jax.devices()
n = len(devices)
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def t_barrier_and_ring():
    with je.init(mesh, "x", timeout_s=60.0) as ctx:
        bar = jax.jit(jax.shard_map(lambda: je.barrier(ctx=ctx)[None], mesh=mesh, in_specs=(), out_specs=P("x")))
        for _ in range(5):
            bar().block_until_ready()
        x, full = global_blocks(mesh, "x", 16)
        want = np.roll(full.reshape(n, 16), 1, axis=0).reshape(-1)  # rank r gets rank r-1's block
        ok = True
        for placement in ("device", "host"):
            f = jax.jit(jax.shard_map(lambda a, p=placement: je.ring_exchange(a, ctx=ctx, placement=p), mesh=mesh,
                                      in_specs=P("x"), out_specs=P("x")))
            for rep in range(3):  # repeated calls: the leading barrier protects readers of the previous call
                y = f(x + rep)
                ok &= local_equal(y, want + rep)
        ctx.check()
        return ok, ""


def t_reservations():
    # Reserved segments: regions carved from them; an over-large request names bytes and knob.
    with je.init(mesh, "x", device_bytes=4 << 20, host_bytes=4 << 20, timeout_s=60.0) as ctx:
        x, full = global_blocks(mesh, "x", 1024)
        want = np.roll(full.reshape(n, 1024), 1, axis=0).reshape(-1)
        ok = True
        for placement in ("device", "host"):
            f = jax.jit(jax.shard_map(lambda a, p=placement: je.ring_exchange(a, ctx=ctx, placement=p), mesh=mesh,
                                      in_specs=P("x"), out_specs=P("x")))
            ok &= local_equal(f(x), want)
        try:
            ctx.region(64 << 20, "device", what="test buffer")
            return False, "no MemoryError for an oversized region"
        except MemoryError as e:
            msg = str(e)
            ok &= "device_bytes" in msg and str(64 << 20) in msg
        return ok, ""


def t_two_contexts():
    if n % 2:
        return True, "skipped (odd device count)"
    m2 = jax.make_mesh((2, n // 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    ca = je.init(m2, "a", timeout_s=60.0)
    cb = je.init(m2, "b", timeout_s=60.0)
    try:
        na, nb = 2, n // 2
        full = np.arange(n * 4, dtype=np.float32).reshape(na, nb, 4)
        xs = jax.make_array_from_callback(full.shape, NamedSharding(m2, P("a", "b")), lambda idx: full[idx])
        fa = jax.jit(jax.shard_map(lambda v: je.ring_exchange(v, ctx=ca), mesh=m2, in_specs=P("a", "b"),
                                   out_specs=P("a", "b")))
        fb = jax.jit(jax.shard_map(lambda v: je.ring_exchange(v, ctx=cb), mesh=m2, in_specs=P("a", "b"),
                                   out_specs=P("a", "b")))
        ok = local_equal(fa(xs), np.roll(full, 1, axis=0)) and local_equal(fb(xs), np.roll(full, 1, axis=1))
        return ok, ""
    finally:
        ca.close()
        cb.close()


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


def _engram_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "jax_engram" in line)


def t_init_close_cycles():
    # Warm up once (first init loads modules, creates XLA state), then count.
    je.init(mesh, "x", timeout_s=60.0).close()
    fd0, maps0 = _fd_count(), _engram_maps()
    bar = None
    for i in range(args.cycles):
        ctx = je.init(mesh, "x", device_bytes=2 << 20, host_bytes=2 << 20, timeout_s=60.0)
        if i % 5 == 0:
            bar = jax.jit(jax.shard_map(lambda: je.barrier(ctx=ctx)[None], mesh=mesh, in_specs=(), out_specs=P("x")))
            bar().block_until_ready()
        ctx.close()
    fd1, maps1 = _fd_count(), _engram_maps()
    return fd1 <= fd0 and maps1 <= maps0, f"fds {fd0}->{fd1}, jax_engram mappings {maps0}->{maps1}"


def t_bad_arguments():
    msgs = []
    for fn, exc, needle in [
        (lambda: je.init("mesh", "x"), TypeError, "jax.sharding.Mesh"),
        (lambda: je.init(mesh, "nope"), ValueError, "axis_name"),
        (lambda: je.init(mesh, "x", timeout_s=-1), ValueError, "timeout_s"),
        (lambda: je.init(mesh, "x", timeout_s=float("inf")), ValueError, "finite"),
        (lambda: je.init(mesh, "x", device_bytes=-5), ValueError, "device_bytes"),
    ]:
        try:
            fn()
            msgs.append(f"no {exc.__name__} for {needle}")
        except exc as e:
            if needle not in str(e):
                msgs.append(f"message lacks {needle!r}: {e}")
    ctx = je.init(mesh, "x", timeout_s=60.0)
    try:
        try:  # outside shard_map
            jax.jit(lambda: je.barrier(ctx=ctx))()
            msgs.append("barrier outside shard_map did not raise")
        except ValueError as e:
            if "shard_map" not in str(e):
                msgs.append(f"outside-shard_map message: {e}")
        try:
            jax.jit(lambda a: je.ring_exchange(a, ctx=ctx, placement="disk"))  # traced lazily below
            jax.jit(jax.shard_map(lambda a: je.ring_exchange(a, ctx=ctx, placement="disk"), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x"))).lower(
                jax.ShapeDtypeStruct((n * 4,), jnp.float32, sharding=NamedSharding(mesh, P("x"))))
            msgs.append("bad placement accepted")
        except ValueError as e:
            if "placement" not in str(e):
                msgs.append(f"placement message: {e}")
    finally:
        ctx.close()
    try:
        jax.jit(jax.shard_map(lambda: je.barrier(ctx=ctx)[None], mesh=mesh, in_specs=(), out_specs=P("x")))()
        msgs.append("closed context accepted")
    except RuntimeError as e:
        if "closed" not in str(e):
            msgs.append(f"closed message: {e}")
    return not msgs, "; ".join(msgs)


def t_timeout_names_peer():
    # Provoke a peer that never arrives: run the barrier only on device 0 (a one-device sub-mesh), so
    # rank 0 waits for rank 1. It must fail within ~timeout, naming op, rank and peer, without hanging.
    ctx = je.init(mesh, "x", timeout_s=1.0)
    try:
        from jax_engram import _call

        sub = jax.make_mesh((1,), ("x",), devices=devices[:1], axis_types=(jax.sharding.AxisType.Explicit,))

        def body():  # the raw op: the public wrapper would (rightly) reject an axis of the wrong size
            tok = _call.new_token(ctx)
            return _call.call(ctx, "jax_engram_barrier", _call.like(tok), tok)[None]

        f = jax.jit(jax.shard_map(body, mesh=sub, in_specs=(), out_specs=P("x")))
        t0 = time.time()
        raised = ""
        try:
            f().block_until_ready()
        except Exception as e:  # CPU: the op itself fails
            raised = str(e)
        dt = time.time() - t0
        try:  # GPU: the kernel recorded it without trapping; the context reports it
            ctx.check()
        except je.JaxEngramError as e:
            raised = raised or str(e)
        ok = "barrier" in raised and "rank 0" in raised and "peer rank 1" in raised and dt < 30
        return ok, f"after {dt:.1f}s: {raised[:300]}"
    finally:
        ctx.close()


def t_new_context_after_failure():
    with je.init(mesh, "x", timeout_s=60.0) as ctx:
        bar = jax.jit(jax.shard_map(lambda: je.barrier(ctx=ctx)[None], mesh=mesh, in_specs=(), out_specs=P("x")))
        bar().block_until_ready()
        ctx.check()
        return True, ""


check("barrier_and_ring_exchange", t_barrier_and_ring)
check("reservations", t_reservations)
check("two_contexts_different_axes", t_two_contexts)
check("init_close_cycles_no_leaks", t_init_close_cycles)
check("bad_arguments", t_bad_arguments)
if not multi and n > 1 and not args.skip_timeout:
    check("timeout_names_op_rank_peer", t_timeout_names_peer)
    check("new_context_after_failure", t_new_context_after_failure)

print(f"SUMMARY {sum(results.values())}/{len(results)} passed on {jax.process_count()} process(es), "
      f"{n} {devices[0].platform} device(s)", flush=True)
launch.emit_result({"checks": results, "platform": devices[0].platform, "devices": n,
                    "processes": jax.process_count()})
launch.shutdown()
sys.exit(0 if all(results.values()) else 1)
