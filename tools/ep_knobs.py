"""A/B of EP configurations in ONE process (diagnosis): an EPConfig is part of each op's compiled program, so one
dispatch loop per configuration is compiled and timed in turn, the configurations interleaved over several rounds so
that drift hits all of them; per call = the slope of loops of n and 3n calls (benchmarks/_common.time_per_call).
Every configuration's output is compared with the first one's (a config must never change the result).

    python tools/ep_knobs.py {dispatch|combine}[_expand][:unroll] TOKENS ROUNDS 'FIELD=VALUE,FIELD=VALUE' 'FIELD=VALUE' ...
    (an empty string: the defaults; combine loops reuse one dispatch's handle, whose config the combine follows;
    ":unroll": the n calls in straight-line code instead of a lax.fori_loop, chained by their done (after=) as in the loop)

Fields are jax_engram.EPConfig's, e.g. copy_engine_pieces=8,dispatch_copy_engine=always or combine_stage_warps=10.
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


def config(s):
    return je.EPConfig(**{k: v if k == "dispatch_copy_engine" else int(v) for k, v in s.items()})


configs = [config(s) for s in settings]  # validated before anything runs
mesh, ctx, R, tk, x = setup(M)
tk, x = tk.reshape(R * M, -1), x.reshape(R * M, -1)
xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P("ep")))
ts = jax.device_put(tk, NamedSharding(mesh, P("ep")))
kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=layout == "expand")
n1 = 10 if M >= 1024 else 30


progs = {}


def make_for(cfg):
    def make(n):
        if (cfg, n) in progs:
            return progs[cfg, n]

        def repeat(body, t):
            if mode == "unroll":
                for i in range(n):
                    t = body(i, t)
                return t
            return lax.fori_loop(0, n, body, t)

        def loop(x, tk):
            t0 = lax.pcast(jnp.zeros((), jnp.float32), "ep", to="varying")
            if op == "dispatch":
                return repeat(lambda i, t: je.dispatch(x, tk, after=t, config=cfg, **kw).done, t0)[None]
            res = je.dispatch(x, tk, after=t0, config=cfg, **kw)
            y = res.recv_x
            return repeat(lambda i, t: je.combine(y, res.handle, after=t).done, res.done)[None]
        progs[cfg, n] = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
        return progs[cfg, n]
    return make


def first(x, tk, cfg):
    res = je.dispatch(x, tk, config=cfg, **kw)
    if op == "combine":  # every row of combined_x is specified (expand: recv_x holds unspecified rows, y = 0 there)
        if layout == "expand":
            rows = jnp.arange(res.recv_x.shape[0])[:, None]
            y = jnp.where(rows < res.num_recv_tokens, res.recv_x, 0)
            out = je.combine(y, res.handle).combined_x
            return out[None], jnp.full((1,), out.shape[0], jnp.int32)
        out = je.combine(res.recv_x, res.handle).combined_x
        return out[None], jnp.full((1,), out.shape[0], jnp.int32)
    return res.recv_x[None], res.num_recv_tokens[None]


ones = {cfg: jax.jit(jax.shard_map(lambda x, tk, cfg=cfg: first(x, tk, cfg), mesh=mesh, in_specs=(P("ep"), P("ep")),
                                   out_specs=(P("ep"), P("ep")))) for cfg in configs}
ref = None
res = {i: [] for i in range(len(settings))}
for r in range(rounds):
    for i, (s, cfg) in enumerate(zip(settings, configs)):
        rx, nr = ones[cfg](xs, ts)
        rx, nr = np.asarray(rx).view(np.uint16), np.asarray(nr)
        out = [rx[k, :nr[k]] for k in range(R)]  # rows past the count are unspecified
        if ref is None:
            ref = out
        same = all(np.array_equal(a, b) for a, b in zip(out, ref))
        t = C.time_per_call(make_for(cfg), (xs, ts), n1, 3 * n1, warmup=1, iters=3)
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
