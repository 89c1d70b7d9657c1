"""Phase trace of the CUDA EP kernels (diagnosis): dispatch -> combine a few times with JAX_ENGRAM_EP_TRACE=1, so
CTA 0 and the last CTA of every rank printf when each phase ends (µs since the kernel started on that GPU).

    python tools/ep_trace.py [tokens] [nonexpand|expand] [calls] [loop] [bf16|fp8]

loop > 0: each call is ONE jitted program of `loop` dispatches and then `loop` combines back to back (a fori_loop,
as the benchmark times them), so the "start" times show the gap between consecutive kernels.
"""
import os
import sys

os.environ.setdefault("JAX_ENGRAM_EP_TRACE", "1")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_engram as je  # noqa: E402
from _ep_setup import E, setup  # noqa: E402

M = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
expand = len(sys.argv) > 2 and sys.argv[2] == "expand"
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 2
loop = int(sys.argv[4]) if len(sys.argv) > 4 else 0
fp8 = len(sys.argv) > 5 and sys.argv[5] == "fp8"
mesh, ctx, R, tk, x = setup(M)


def x_in(x):  # (x, x_scales): FP8 with 56 scales per token (hidden 7168 / 128), as the benchmark
    if fp8:
        return x[0].astype(jnp.float8_e4m3fn), x[0][:, :56].astype(jnp.float32)  # varying, like x
    return x[0].astype(jnp.bfloat16), None


def f(x, tk):
    xb, sf = x_in(x)
    res = je.dispatch(xb, tk[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=expand, x_scales=sf)
    out = je.combine(res.recv_x.astype(jnp.bfloat16), res.handle).combined_x
    return out[None]


def f_loop(x, tk):
    xb, sf = x_in(x)
    kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=expand, x_scales=sf)
    tok0 = jax.lax.pcast(jnp.zeros((), jnp.float32), "ep", to="varying")
    tok = jax.lax.fori_loop(0, loop, lambda i, t: je.dispatch(xb, tk[0], after=t, **kw).done, tok0)
    res = je.dispatch(xb, tk[0], after=tok, **kw)
    y = res.recv_x.astype(jnp.bfloat16)
    tok = jax.lax.fori_loop(0, loop, lambda i, t: je.combine(y, res.handle, after=t).done,
                            res.done)
    return tok[None]


g = jax.jit(jax.shard_map(f_loop if loop > 0 else f, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
xs = jax.device_put(x, NamedSharding(mesh, P("ep")))
ts = jax.device_put(tk, NamedSharding(mesh, P("ep")))
for i in range(calls):
    print(f"--- call {i} tokens={M} expand={expand} loop={loop}", flush=True)
    g(xs, ts).block_until_ready()
    sys.stdout.flush()
ctx.close()
