"""A/B of the EP tuning knobs in ONE process (diagnosis): the handlers read the knobs per call, so one jitted
dispatch loop is timed under each setting in turn, the settings interleaved over several rounds so that drift hits
all of them; per call = the slope of loops of n and 3n calls (benchmarks/_common.time_per_call). Every setting's
output is compared with the first setting's (a knob must never change the result).

    python tools/ep_knobs.py {dispatch|combine}[_expand][:unroll] TOKENS ROUNDS 'NAME=VALUE,NAME=VALUE' 'NAME=VALUE' ...
    (an empty string: unset all; combine loops reuse one dispatch's handle; ":unroll": the n calls in straight-line
    code instead of a lax.fori_loop, chained by their tokens as in the loop)

Names are given without the JAX_ENGRAM_EP_ prefix, e.g. CE_TAPER=20,CE_OWN_FIRST=0.
"""
import os
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _common as C  # noqa: E402
import jax_engram as je  # noqa: E402
from _ep_setup import E, setup  # noqa: E402

what, _, mode = sys.argv[1].partition(":")
op, _, layout = what.partition("_")
if mode not in ("", "unroll"):
    raise SystemExit("mode after ':' must be unroll")
if op not in ("dispatch", "combine") or layout not in ("", "expand"):
    raise SystemExit("first argument: dispatch, combine, dispatch_expand or combine_expand")
M = int(sys.argv[2])
rounds = int(sys.argv[3])
settings = [dict(kv.split("=", 1) for kv in a.split(",") if kv) for a in sys.argv[4:]] or [{}]
names = sorted({k for s in settings for k in s})
mesh, ctx, R, tk, x = setup(M)
tk, x = tk.reshape(R * M, -1), x.reshape(R * M, -1)
xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P("ep")))
ts = jax.device_put(tk, NamedSharding(mesh, P("ep")))
kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=layout == "expand")
n1 = 10 if M >= 1024 else 30


def apply(s):
    for k in names:
        os.environ.pop("JAX_ENGRAM_EP_" + k, None)
    for k, v in s.items():
        os.environ["JAX_ENGRAM_EP_" + k] = v


progs = {}


def make(n):
    if n in progs:
        return progs[n]

    def repeat(body, t):
        if mode == "unroll":
            for i in range(n):
                t = body(i, t)
            return t
        return lax.fori_loop(0, n, body, t)

    def loop(x, tk):
        t0 = lax.pcast(jnp.zeros((), jnp.float32), "ep", to="varying")
        if op == "dispatch":
            return repeat(lambda i, t: je.dispatch(x, tk, token=t, **kw).token, t0)[None]
        res = je.dispatch(x, tk, token=t0, **kw)
        y = res.recv_x
        return repeat(lambda i, t: je.combine(y, res.handle, token=t).token, res.token)[None]
    progs[n] = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    return progs[n]


def first(x, tk):
    res = je.dispatch(x, tk, **kw)
    if op == "combine":  # every row of combined_x is specified (expand: recv_x holds unspecified rows, y = 0 there)
        if layout == "expand":
            rows = jnp.arange(res.recv_x.shape[0])[:, None]
            y = jnp.where(rows < res.num_recv_tokens, res.recv_x, 0)
            out = je.combine(y, res.handle).combined_x
            return out[None], jnp.full((1,), out.shape[0], jnp.int32)
        out = je.combine(res.recv_x, res.handle).combined_x
        return out[None], jnp.full((1,), out.shape[0], jnp.int32)
    return res.recv_x[None], res.num_recv_tokens[None]


one = jax.jit(jax.shard_map(first, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=(P("ep"), P("ep"))))
ref = None
res = {i: [] for i in range(len(settings))}
for r in range(rounds):
    for i, s in enumerate(settings):
        apply(s)
        rx, nr = one(xs, ts)
        rx, nr = np.asarray(rx).view(np.uint16), np.asarray(nr)
        out = [rx[k, :nr[k]] for k in range(R)]  # rows past the count are unspecified
        if ref is None:
            ref = out
        same = all(np.array_equal(a, b) for a, b in zip(out, ref))
        t = C.time_per_call(make, (xs, ts), n1, 3 * n1, warmup=1, iters=3)
        res[i].append(t["median_us"])
        print(f"round {r} setting {i} {s or 'defaults'}: {t['median_us']:.1f} us per {op}, "
              f"output {'same' if same else 'DIFFERENT'}", flush=True)
        if not same:
            raise SystemExit(f"setting {s} changed the output")
ctx.check()
for i, s in enumerate(settings):
    print(f"SUMMARY {sys.argv[1]} tokens={M} {s or 'defaults'}: median {np.median(res[i]):.1f} us over {rounds} rounds "
          f"({', '.join(f'{v:.1f}' for v in res[i])})", flush=True)
ctx.close()
