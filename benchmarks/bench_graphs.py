"""A MoE decode step with the EP ops outside and inside XLA's CUDA graphs (``Context(cuda_graphs=...)``), same run.

One step per rank: dispatch (non-expand, bf16) -> an expert stand-in on ``recv_x`` (GEMM, GELU, GEMM: a few kernels, as
in a real layer) -> combine -> a residual mix that feeds the next step. DeepEP's decode shape: N tokens per rank,
hidden 7168, top-8 of 256 experts, uniform routing. XLA builds CUDA graphs (command buffers) around runs of >= 5
graph-safe kernels by default; with ``cuda_graphs=False`` every EP op cuts such a run, with ``True`` the SM-store
dispatches and the combines join it (docs/DESIGN.md "CUDA graphs").

Printed per token count, each timed per step inside one jitted ``lax.fori_loop`` (slope of n and 3n steps): the step
with ``cuda_graphs`` False and True, the ratio, the EP calls XLA captured, the largest difference between the two
modes' outputs after the loop (expected 0: the same kernels run), and the step without the EP ops (the expert
stand-in on x alone) as the floor of what the EP ops add.

    python benchmarks/bench_graphs.py [--tokens 128,512] [--loop 20] [--iters 6] [--out graphs.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _common as C  # noqa: E402
import jax_engram as je  # noqa: E402

AX = "ep"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="128,512", help="tokens per rank (comma-separated)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=512, help="inner width of the expert stand-in")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--loop", type=int, default=20, help="steps per timed loop (and 3x that)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    mesh = C.make_ep_mesh(axis_name=AX)
    R = mesh.shape[AX]
    H, F, K, E = args.hidden, args.ffn, args.topk, args.experts
    C.config_line(ranks=R, hidden=H, ffn=F, topk=K, experts=E, dtype="bfloat16", loop=args.loop, iters=args.iters,
                  xla_flags=os.environ.get("XLA_FLAGS", ""))
    ctxs = {False: je.init(mesh, AX), True: je.init(mesh, AX, cuda_graphs=True)}
    rows = []
    try:
        rng = np.random.default_rng(0)
        w1 = jnp.asarray(rng.standard_normal((H, F)) * H ** -0.5, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((F, H)) * F ** -0.5, jnp.bfloat16)
        rep = NamedSharding(mesh, P())
        w1, w2 = jax.device_put(w1, rep), jax.device_put(w2, rep)
        for N in [int(t) for t in args.tokens.split(",") if t]:
            x = rng.standard_normal((R, N, H)).astype(jnp.bfloat16)
            tk = np.argsort(rng.random((R, N, E)), axis=-1)[..., :K].astype(np.int32)
            sh = NamedSharding(mesh, P(AX))
            x, tk = jax.device_put(x, sh), jax.device_put(tk, sh)

            def expert(v, a, b):
                h = jax.nn.gelu(jnp.dot(v, a, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
                return jnp.dot(h, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

            def make_step(ctx):
                def body(xl, tkl, a, b):
                    d = je.dispatch(xl[0], tkl[0], ctx=ctx, num_experts=E, max_tokens_per_rank=N)
                    c = je.combine(expert(d.recv_x, a, b), d.handle).combined_x
                    return ((xl[0].astype(jnp.float32) + c.astype(jnp.float32)) * 0.5).astype(jnp.bfloat16)[None]

                f = jax.shard_map(body, mesh=mesh, in_specs=(P(AX), P(AX), P(), P()), out_specs=P(AX))
                return lambda c: (f(*c), c[1], c[2], c[3])

            def dense_step(c):
                f = jax.shard_map(lambda xl, a, b: expert(xl[0], a, b)[None], mesh=mesh,
                                  in_specs=(P(AX), P(), P()), out_specs=P(AX))
                return (f(c[0], c[2], c[3]), c[1], c[2], c[3])

            carry = (x, tk, w1, w2)
            res, outs = {}, {}
            for graphs, ctx in ctxs.items():
                step = make_step(ctx)
                res[graphs] = C.time_loop_per_call(step, carry, args.loop, iters=args.iters)
                run = jax.jit(lambda c, s=step: jax.lax.fori_loop(0, args.loop, lambda i, c: s(c), c))
                outs[graphs] = np.asarray(run(carry)[0].astype(jnp.float32))
            dense = C.time_loop_per_call(dense_step, carry, args.loop, iters=args.iters)
            diff = float(np.max(np.abs(outs[True] - outs[False])))
            off, on = res[False]["median_us"], res[True]["median_us"]
            row = dict(tokens=N, step_us_graphs_off=off, step_us_graphs_on=on, speedup=off / on,
                       p10_p90_off=[res[False]["p10_us"], res[False]["p90_us"]],
                       p10_p90_on=[res[True]["p10_us"], res[True]["p90_us"]],
                       dense_step_us=dense["median_us"], graph_captures=ctxs[True].graph_captures(),
                       max_abs_diff=diff)
            rows.append(row)
            print(f"tokens {N}: step {off:.1f} us (EP ops outside graphs) -> {on:.1f} us (cuda_graphs=True), "
                  f"{off / on:.2f}x; expert stand-in alone {dense['median_us']:.1f} us; EP calls captured so far "
                  f"{row['graph_captures']}; max |difference| of the outputs {diff:g}", flush=True)
        for ctx in ctxs.values():
            ctx.check()
    finally:
        for ctx in ctxs.values():
            ctx.close()
    if args.out:
        C.write_json(args.out, dict(config=dict(ranks=R, hidden=H, ffn=F, topk=K, experts=E, loop=args.loop,
                                                iters=args.iters), env=C.env_info(), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
