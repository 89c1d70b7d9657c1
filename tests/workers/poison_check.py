"""No poisoned state after a reported error (one process, all local devices; CPU or CUDA).

Engram mode="checked": a lookup with an out-of-range id raises JaxEngramError once, from that call; the next
lookups (global and inside jit) succeed bit-exactly, the context reports no error, and nothing is raised again
at interpreter exit. EP validate_routing=True: bad routing raises before anything is sent and the context keeps
working. Prints ``CHECK name PASS|FAIL`` lines, ``TIME name seconds`` for the errors, then ``DONE``.

Run: python tests/workers/poison_check.py --platform cpu --cpu-devices 4   |   --platform cuda
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial

from _harness import Checks, bits, start
from _harness import shard as put

ap = argparse.ArgumentParser()
ap.add_argument("--platform", default="cpu", choices=["cpu", "cuda"])
ap.add_argument("--cpu-devices", type=int, default=4)
args = ap.parse_args()

start(args.platform, args.cpu_devices)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from jax_engram import reference  # noqa: E402

R = len(jax.devices())
AX = "ep"
mesh = jax.make_mesh((R,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,))
ctx = je.init(mesh, AX, timeout_s=30.0)
checks = Checks()
check = checks.expect


N, H, E, T = 16, 32, 3, 4
table = je.EngramTable(N, H, jnp.bfloat16, ctx=ctx, placement="device")
rng = np.random.default_rng(0)
x = rng.standard_normal((R * N, H)).astype(np.float32).astype(jnp.bfloat16)
table.write_global(x)
shards = x.reshape(R, N, H)


sharded = partial(put, mesh=mesh, spec=P(AX, None))


def good_ids(seed):
    return np.random.default_rng(seed).integers(-1, R * N, size=(R * T, E)).astype(np.int32)


def expect_exact(data, ids):
    want = np.concatenate([np.asarray(reference.engram_lookup(shards, b)[0]) for b in np.split(ids, R)])
    assert np.array_equal(bits(np.asarray(data)), bits(want)), "lookup differs from the reference"


def expect_error(name, fn, needles, error_type=Exception):
    t0 = time.perf_counter()
    try:
        fn()
    except error_type as e:
        dt = time.perf_counter() - t0
        msg = str(e)
        for n in needles:
            assert n in msg, f"{name}: {n!r} not in the error: {msg}"
        print(f"TIME {name} {dt:.3f}s", flush=True)
        print(f"MESSAGE {name}: {msg.splitlines()[0][:400]}", flush=True)
        return
    raise AssertionError(f"{name}: no error raised")


def engram_global():
    ids = good_ids(1)
    data, _ = table.lookup_global(sharded(ids), mode="checked")
    expect_exact(data, ids)
    bad = good_ids(2)
    bad[1, 2] = R * N + 5  # rank 0, flat position E + 2
    expect_error("engram_checked_global", lambda: table.lookup_global(sharded(bad), mode="checked"),
                 [f"id {R * N + 5}", f"position {E + 2}", "stay usable"], je.JaxEngramError)
    for seed, mode in ((3, "checked"), (4, "fill"), (5, "checked")):  # the same table, afterwards
        ids = good_ids(seed)
        data, _ = table.lookup_global(sharded(ids), mode=mode)
        expect_exact(data, ids)
    ctx.check()


def engram_in_jit():
    f = jax.jit(jax.shard_map(lambda i: table.lookup(i, mode="checked")[0], mesh=mesh, in_specs=P(AX, None),
                              out_specs=P(AX, None)))
    bad = good_ids(6)
    bad[0, 0] = -5  # padding is fine
    bad[T * (R - 1) + 1, 1] = R * N  # last rank, flat position E + 1
    expect_error("engram_checked_in_jit", lambda: jax.block_until_ready(f(sharded(bad))),
                 [f"id {R * N}", f"position {E + 1}"])
    ids = good_ids(7)
    expect_exact(f(sharded(ids)), ids)
    data, _ = table.lookup_global(sharded(ids), mode="checked")
    expect_exact(data, ids)
    ctx.check()


def ep_validate_routing():
    from jax_engram import ep

    E_loc, K, M, Hx = 4, 3, 8, 64
    NE = E_loc * R
    spec = P(AX)

    shard = partial(put, mesh=mesh, spec=spec)

    def body(x, idx):
        d = ep.dispatch(x[0], idx[0], ctx=ctx, num_experts=NE, max_tokens_per_rank=M, validate_routing=True)
        cx = ep.combine(d.recv_x.astype(jnp.bfloat16), d.handle).combined_x
        return d.num_recv_tokens[None], cx[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    rng = np.random.default_rng(11)
    x = rng.standard_normal((R, M, Hx)).astype(np.float32).astype(jnp.bfloat16)

    def routing():
        return np.argsort(rng.random((R, M, NE)), axis=-1)[..., :K].astype(np.int32)

    for name, val, needle in (("ep_validate_out_of_range", NE + 2, f"expert id {NE + 2} outside [-1"),
                              ("ep_validate_duplicate", None, "more than once")):
        idx = routing()
        rr = R - 1
        if val is None:
            idx[rr, 3, 1] = idx[rr, 3, 0]
        else:
            idx[rr, 3, 2] = val
        expect_error(name, lambda: jax.block_until_ready(f(shard(x), shard(idx))), [f"rank {rr}", "token 3", needle,
                                                                                     "still usable"])
        idx = routing()
        num, cx = f(shard(x), shard(idx))
        want = reference.ep_dispatch(x, idx, num_experts=NE, max_tokens_per_rank=M)
        assert np.array_equal(np.asarray(num), np.asarray(want["num_recv_tokens"])), "counts after the error"
        wcx, _ = reference.ep_combine(np.asarray(want["recv_x"]).astype(jnp.bfloat16), want, idx, num_experts=NE, expand=False,
                                      max_tokens_per_rank=M)
        assert np.array_equal(bits(np.asarray(cx)), bits(np.asarray(wcx))), "combine after the error"
    ctx.check()


check("engram_checked_global_then_usable", engram_global)
check("ep_validate_routing_then_usable", ep_validate_routing)
check("engram_checked_in_jit_then_usable", engram_in_jit)
ctx.close()
print(f"SUMMARY {len(checks.failed)} failed: {checks.failed}", flush=True)
print("DONE", flush=True)
print("DONE", file=sys.stderr, flush=True)  # anything after this on stderr comes from the interpreter's exit
sys.exit(1 if checks.failed else 0)
