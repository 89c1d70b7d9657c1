"""Gradients (the example MoE layer, non-expand dispatch / combine against the reference's autodiff) and the
example script itself."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import ep

from _ep_check.common import R, SPEC, check, local, mesh, ref, shard
from _harness import load_example


def suite_grad(ctx):
    ex = load_example()
    for dtype, tol in (("float32", 2e-5), ("bfloat16", 3e-2)):
        check(f"moe_grad_{dtype}", lambda dtype=dtype, tol=tol: ex.check_against_reference(
            ctx, mesh, dtype=dtype, tol=tol, seed=3))


def suite_grad_nonexpand(ctx):
    """Gradients of dispatch (non-expand) / combine w.r.t. x, weights, y, bias vs the reference's autodiff."""
    E, K, M, H = 4 * R, 3, 12, 32
    rng = np.random.default_rng(11)
    idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(M)]) for _ in range(R)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.15] = -1
    x = rng.standard_normal((R, M, H)).astype(np.float32)
    w = rng.standard_normal((R, M, K)).astype(np.float32)
    b = rng.standard_normal((R, M, H)).astype(np.float32).astype(jnp.bfloat16)
    g1 = rng.standard_normal((R, R * M, H)).astype(np.float32)
    g2 = rng.standard_normal((R, M, H)).astype(np.float32)
    g3 = rng.standard_normal((R, R * M, K)).astype(np.float32)
    g4 = rng.standard_normal((R, M, K)).astype(np.float32)
    kw = dict(num_experts=E, max_tokens_per_rank=M)

    def ours(x, w, b, idx, g1, g2, g3, g4):
        def body(x, w, b, idx, g1, g2, g3, g4):
            d = ep.dispatch(x[0], idx[0], w[0], ctx=ctx, **kw)
            # Rows past num_recv_tokens are unspecified (the contract): mask them like recv_x below. The CPU
            # backend happens to zero them; on GPU they hold whatever XLA's buffer held.
            valid = (jnp.arange(R * M) < d.num_recv_tokens)[:, None]
            local_k = (d.recv_topk_idx >= 0) & valid
            rw = jnp.where(local_k, d.recv_topk_weights, 0.0)
            y = (jnp.where(valid, d.recv_x, 0.0) * (1.0 + rw.sum(-1, keepdims=True))).astype(jnp.bfloat16)
            cr = ep.combine(y, d.handle, topk_weights=rw * 2.0, bias=b[0])
            cx, cw = cr.combined_x, cr.combined_topk_weights
            loss = (jnp.sum(jnp.where(valid, d.recv_x, 0.0) * g1[0]) + jnp.sum(cx.astype(jnp.float32) * g2[0])
                    + jnp.sum(rw * g3[0]) + jnp.sum(cw * g4[0]))
            return loss[None]
        # One loss per rank and a vjp with ones: the gradient of the sum over ranks without an XLA collective (an
        # all-reduce would need NCCL, which cannot run when several ranks share a GPU).
        f = jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC)
        return f(x, w, b, idx, g1, g2, g3, g4)

    def theirs(x, w, b, idx, g1, g2, g3, g4):
        d = ref.ep_dispatch(x, idx, w, **kw)
        rt = jnp.asarray(d["recv_topk_idx"])
        rw = jnp.where(rt >= 0, d["recv_topk_weights"], 0.0)
        valid = d["recv_token_valid"][..., None]
        y = (jnp.where(valid, d["recv_x"], 0.0) * (1.0 + rw.sum(-1, keepdims=True))).astype(jnp.bfloat16)
        cx, cw = ref.ep_combine(y, d, idx, expand=False, topk_weights=rw * 2.0, bias=b, **kw)
        per_rank = lambda a: a.reshape(R, -1).sum(-1)  # noqa: E731
        return (per_rank(jnp.where(valid, d["recv_x"], 0.0) * g1) + per_rank(cx.astype(jnp.float32) * g2)
                + per_rank(rw * g3) + per_rank(cw * g4))

    @jax.jit
    def ours_vjp(x, w, b, idx, g1, g2, g3, g4):
        loss, pull = jax.vjp(lambda x, w, b: ours(x, w, b, idx, g1, g2, g3, g4), x, w, b)
        return loss, pull(jnp.ones_like(loss))

    def run():
        args_ = [shard(v) for v in (x, w, b, idx, g1, g2, g3, g4)]
        l1, (dx1, dw1, db1) = ours_vjp(*args_)
        l2, (dx2, dw2, db2) = jax.jit(jax.value_and_grad(lambda *a: theirs(*a).sum(), argnums=(0, 1, 2)))(
            x, w, b, idx, g1, g2, g3, g4)
        l2_rank = np.asarray(jax.jit(theirs)(x, w, b, idx, g1, g2, g3, g4))
        errs = []
        for name, a, bb in (("dx", dx1, dx2), ("dw", dw1, dw2), ("dbias", db1, db2)):
            for r, got in local(a).items():
                want = np.asarray(bb[r]).astype(np.float32)
                got = got.astype(np.float32)
                scale = max(1.0, float(np.abs(want).max()))
                if not np.allclose(got, want, atol=2e-2 * scale, rtol=2e-2):
                    errs.append(f"{name} rank {r}: max err {np.abs(got - want).max()} (scale {scale})")
        for r, got in local(l1).items():
            if not np.isclose(float(got), float(l2_rank[r]), rtol=1e-2, atol=1e-1):
                errs.append(f"loss rank {r}: {float(got)} vs {float(l2_rank[r])}")
        return not errs, "; ".join(errs)

    check("grad_nonexpand_dispatch_combine", run)


def suite_example(_ctx):
    ex = load_example()
    check("example_runs", lambda: (ex.main(["--tokens", "16", "--quiet", "--dtypes", "float32"]) == 0, ""))
