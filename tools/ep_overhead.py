"""Where the per-call time of a small EP dispatch goes (diagnosis): the same 128-token dispatch timed as
(a) a fori_loop of n calls, (b) a fori_loop whose body holds 10 calls, (c) n calls in straight-line code (no
loop), each call chained to the previous by its done (after=).

    python tools/ep_overhead.py [tokens] [n]
"""
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_engram as je
from _ep_setup import E, setup

M = int(sys.argv[1]) if len(sys.argv) > 1 else 128
n = int(sys.argv[2]) if len(sys.argv) > 2 else 50
if n < 10:
    raise SystemExit(f"ep_overhead: n = {n} calls; at least 10 (variant (b) runs them 10 per loop iteration)")
mesh, ctx, R, tk, x = setup(M)
tk, x = tk.reshape(R * M, -1), x.reshape(R * M, -1)
xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P("ep")))
ts = jax.device_put(tk, NamedSharding(mesh, P("ep")))
kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M)


def one(x, tk, t):
    return je.dispatch(x, tk, after=t, **kw).done


def tok0():
    return lax.pcast(jnp.zeros((), jnp.float32), "ep", to="varying")


def loop_a(x, tk):
    return lax.fori_loop(0, n, lambda i, t: one(x, tk, t), tok0())[None]


def loop_b(x, tk):
    def body(i, t):
        for _ in range(10):
            t = one(x, tk, t)
        return t
    return lax.fori_loop(0, n // 10, body, tok0())[None]


def straight(x, tk):
    t = tok0()
    for _ in range(n):
        t = one(x, tk, t)
    return t[None]


for name, f, calls in (("fori_loop, 1 call per iteration", loop_a, n),
                       ("fori_loop, 10 calls per iteration", loop_b, n // 10 * 10),
                       ("straight-line calls", straight, n)):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    g(xs, ts).block_until_ready()
    s = []
    for _ in range(7):
        t0 = time.perf_counter()
        g(xs, ts).block_until_ready()
        s.append((time.perf_counter() - t0) * 1e6 / calls)
    print(f"tokens={M} {name}: {np.median(s):.1f} us per dispatch (min {min(s):.1f})", flush=True)
ctx.close()
