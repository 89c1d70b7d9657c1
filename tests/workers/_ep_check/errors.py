"""Error reporting: bad routing found by the kernels, a too-small window, trace-time validation naming the
argument, and the handlers' own checks of result shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jax_engram as je
from jax_engram import ep

from _ep_check.common import EPC, LOCAL, R, SPEC, args, check, devices, mesh, shard
from _harness import expect_error


def suite_errors(_ctx_unused):
    E, K, M, H = 2 * R, 2, 8, 128

    def run_bad(idx_full, needles, detail):
        ctx = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout)
        try:
            f = jax.jit(jax.shard_map(
                lambda x, i: ep.dispatch(x[0], i[0], ctx=ctx, num_experts=E, max_tokens_per_rank=M).recv_x[None],
                mesh=mesh, in_specs=SPEC, out_specs=SPEC))
            x = np.ones((R, M, H), jnp.bfloat16)

            def go():  # GPU kernels record the error; the next op / ctx.check() raises it
                jax.block_until_ready(f(shard(x), shard(idx_full)))
                ctx.check()

            ok, msg = expect_error(go, *needles)
            if not ok and devices[0].platform != "cpu":  # generic device-error text: detail = token*64 + kind
                ok2, msg2 = expect_error(go, f"detail {detail}")
                return ok2, msg + " / " + msg2
            return ok, msg
        finally:
            ctx.close()

    good = np.tile(np.array([[0, 1]], np.int32), (R, M, 1))
    dup = good.copy()
    dup[0, 3] = [1, 1]
    check("error_duplicate_expert_names_token",
          lambda: run_bad(dup, ["token 3", "expert 1", "more than once"], 3 * 64 + 1))
    oob = good.copy()
    oob[R - 1, 5, 1] = E
    check("error_expert_out_of_range", lambda: run_bad(oob, ["token 5", f"expert id {E}", "outside [-1"], 5 * 64 + 2))
    neg = good.copy()
    neg[0, 2, 0] = -7
    check("error_expert_below_minus_one", lambda: run_bad(neg, ["token 2", "expert id -7"], 2 * 64 + 2))

    def too_small():
        ctx = je.init(mesh, "ep", ep_config=EPC, device_bytes=1 << 20, timeout_s=args.timeout)
        try:
            Mb = 4096  # staging needs 2 * 4096 * 7168 * 2 bytes > 1 MiB
            f = jax.jit(jax.shard_map(
                lambda x, i: ep.dispatch(x[0], i[0], ctx=ctx, num_experts=E, max_tokens_per_rank=Mb).recv_x[None],
                mesh=mesh, in_specs=SPEC, out_specs=SPEC))
            spec = [jax.ShapeDtypeStruct((R, 8, 7168), jnp.bfloat16, sharding=NamedSharding(mesh, SPEC)),
                    jax.ShapeDtypeStruct((R, 8, K), jnp.int32, sharding=NamedSharding(mesh, SPEC))]
            need = ep.dispatch_staging_bytes(R, Mb, K, E, 7168 * 2, 0, push=ctx.platform != "cpu")
            if need <= 1 << 20:  # one GPU rank: the push dispatch stages only its counts, which fit
                f.trace(*spec)
                return True, f"fits: {need} bytes"
            return expect_error(lambda: f.trace(*spec), "EP dispatch buffer", str(need), "device_bytes")
        finally:
            ctx.close()

    if not LOCAL:  # the local path takes no staging region
        check("error_window_too_small_names_bytes", too_small)
    check("error_init_cuda_graphs_not_bool",
          lambda: expect_error(lambda: je.init(mesh, "ep", ep_config=EPC, cuda_graphs="yes"), "cuda_graphs must be a bool"))

    # Trace-time validation: messages name the argument.
    ctx = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout)
    try:
        def trace(fn, *shapes):
            specs = [jax.ShapeDtypeStruct((R,) + s[0], s[1], sharding=NamedSharding(mesh, SPEC)) for s in shapes]
            return jax.jit(jax.shard_map(lambda *a: fn(*[v[0] for v in a]), mesh=mesh, in_specs=SPEC,
                                         out_specs=SPEC)).trace(*specs)

        bf, i32 = jnp.bfloat16, jnp.int32
        kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M)
        tests = {
            "val_n_gt_m": (lambda x, i: ep.dispatch(x, i, **kw).recv_x[None], [((M + 1, H), bf), ((M + 1, K), i32)],
                           ["max_tokens_per_rank"]),
            "val_experts_multiple": (lambda x, i: ep.dispatch(x, i, **{**kw, "num_experts": 2 * R + 1}).recv_x[None],
                                     [((M, H), bf), ((M, K), i32)], ["num_experts", "multiple"]),
            "val_zero_padding": (lambda x, i: ep.dispatch(x, i, zero_padding=True, **kw).recv_x[None],
                                 [((M, H), bf), ((M, K), i32)], ["zero_padding", "expand"]),
            "val_fp8_needs_scales": (lambda x, i: ep.dispatch(x, i, **kw).recv_x[None],
                                     [((M, H), jnp.float8_e4m3fn), ((M, K), i32)], ["x_scales"]),
            "val_topk_dtype": (lambda x, i: ep.dispatch(x, i, **kw).recv_x[None],
                               [((M, H), bf), ((M, K), jnp.float32)], ["topk_idx", "int32"]),
            "val_topk_gt_32": (lambda x, i: ep.dispatch(x, i, **{**kw, "num_experts": 64 * R}).recv_x[None],
                               [((M, H), bf), ((M, 33), i32)], ["top-k", "32"]),
            "val_weights_shape": (lambda x, i: ep.dispatch(x, i, jnp.zeros((M, K + 1), jnp.float32), **kw).recv_x[None],
                                  [((M, H), bf), ((M, K), i32)], ["topk_weights", "[N, K]"]),
            "val_combine_rows": (lambda x, i: ep.combine(x, ep.dispatch(x, i, **kw).handle).combined_x[None],
                                 [((M, H), bf), ((M, K), i32)], ["y must be", str(R * M)]),
            "val_combine_handle": (lambda x, i: ep.combine(x, None).combined_x[None], [((M, H), bf), ((M, K), i32)],
                                   ["handle", "EPHandle"]),
            "val_combine_bias": (lambda x, i: ep.combine(jnp.zeros((R * M, H), bf), ep.dispatch(x, i, **kw).handle,
                                                         bias=jnp.zeros((M, H + 1), bf)).combined_x[None],
                                 [((M, H), bf), ((M, K), i32)], ["bias[0]", "[N, H]"]),
            "val_cached_config": (lambda x, i: ep.dispatch(x, None, handle=ep.dispatch(x, i, **kw).handle,
                                                           **{**kw, "expand": True}).recv_x[None],
                                  [((M, H), bf), ((M, K), i32)], ["handle", "expand"]),
        }
        if R == 1:  # every num_experts is a multiple of one rank, and R*M rows are M rows
            del tests["val_experts_multiple"], tests["val_combine_rows"]
        for name, (fn, shapes, needles) in tests.items():
            check(name, lambda fn=fn, shapes=shapes, needles=needles: expect_error(lambda: trace(fn, *shapes), *needles))
    finally:
        ctx.close()

    # Handler-level validation (handlers/validate.h, shared by both backends): the Python layer always asks for the
    # right result shapes, so one is made wrong on its way to ffi_call; the handler must refuse it and name it.
    from jax_engram import _call
    # with --cuda-graphs on GPU: the graph targets, whose refusal comes while XLA captures them
    graphs = args.cuda_graphs and devices[0].platform == "gpu"

    def handler_rejects(target, index, needles, expand=False):
        real = _call.call
        target = target + "_graph" if graphs else target

        def patched(ctx_, tgt, results, *ops, **attrs):
            if tgt == target:
                results = list(results)
                r = results[index]
                results[index] = r.update(shape=(r.shape[0] + 1,) + tuple(r.shape[1:]))
            return real(ctx_, tgt, results, *ops, **attrs)

        ctx = je.init(mesh, "ep", ep_config=EPC, timeout_s=args.timeout, cuda_graphs=graphs)
        kw = dict(ctx=ctx, num_experts=E, max_tokens_per_rank=M, expand=expand)

        def body(x, i):
            d = ep.dispatch(x[0], i[0], **kw)
            c = ep.dispatch(x[0], None, handle=d.handle, **kw)
            if target.startswith("jax_engram_ep_dispatch_cached"):  # its bad result would fail combine's own trace-time check
                return c.recv_x[None]
            y = ep.combine(c.recv_x, d.handle).combined_x
            return y[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC))
        x = np.ones((R, M, H), jnp.bfloat16)
        idx = np.tile(np.array([[0, 1]], np.int32), (R, M, 1))
        _call.call = patched
        try:
            return expect_error(lambda: jax.block_until_ready(f(shard(x), shard(idx))), *needles)
        finally:
            _call.call = real
            ctx.close()

    if LOCAL:  # the local path's only custom call: its guard (the copy of topk_idx it returns)
        check("handler_guard_topk_out_shape",
              lambda: handler_rejects("jax_engram_ep_guard", 1, ["topk_out must have shape", f"[{M},{K}]"]))
        return
    check("handler_dispatch_recv_x_shape",
          lambda: handler_rejects("jax_engram_ep_dispatch", 0, ["recv_x must have shape"]))
    check("handler_dispatch_dst_row_shape",
          lambda: handler_rejects("jax_engram_ep_dispatch", 8, ["dst_row must have shape", f"[{M},{R}]"]))
    check("handler_cached_recv_x_shape",
          lambda: handler_rejects("jax_engram_ep_dispatch_cached", 0, ["recv_x must have shape"], expand=True))
    check("handler_combine_combined_x_shape",
          lambda: handler_rejects("jax_engram_ep_combine", 0, ["combined_x must have shape", f"[{M},{H}]"]))
