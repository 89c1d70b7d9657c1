"""The flat EP path: dispatch / combine over a one-axis context as custom calls of the native handlers. Takes the
validated arguments of :mod:`jax_engram._ep_args`; the gradients are the shared rules of
:mod:`jax_engram._ep_autodiff`. The one-rank path (:mod:`jax_engram._ep_local`) is a sibling on the same operands and
outputs: it runs through this module's entry points (:func:`dispatch_on` / :func:`combine_on`) and the wrappers
around the raw calls (:func:`dispatch_with`, :func:`cached_with`, :func:`combine_with`), with raw calls of its own.
Semantics: :mod:`jax_engram.ep`."""
from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np

from jax_engram import _call, _ep_args, _ep_autodiff
from jax_engram._ep_types import (CombineResult, DispatchConfig, DispatchResult, EPHandle, combine_staging_bytes,
                                  dispatch_staging_bytes)


# ------------------------------------------------------------------------------------------- helpers
def _vary(x, ctx):
    return _call.vary(x, ctx.axis_name)


def _data_axes(x) -> tuple[str, ...]:
    """Every manual axis x varies along (the context's, and e.g. a data-parallel axis of a 2-D mesh): the gradient
    rules return cotangents typed like the data, so the differentiable operands (token, weights, biases) must
    carry the data's varying axes (``_call.vary(a, _data_axes(x))``)."""
    return tuple(sorted(_call.varying_axes(x)))


def _ffi_token(token, ctx):
    """The ordering token as the custom calls take it (float32, varying); a fresh one for None."""
    if token is None:
        return _call.new_token(ctx)
    return _vary(jnp.asarray(token).astype(jnp.float32), ctx)


def _empty(shape, dtype, ctx):
    return _vary(jnp.zeros(shape, dtype), ctx)


def _dispatch_plan(cfg: DispatchConfig, hidden: int, dtype) -> tuple[int, bool]:
    """(copy-engine pieces, graph target) of a dispatch-type call of this config, decided once at trace time: the
    pieces from the native policy (what ``ctx.dispatch_path`` reports; 0 = SM stores), passed to the handler as an
    attribute. The graph targets (``*_graph``) take the calls of a context with CUDA graphs that move rows by SM
    stores (copy-engine rows need the handler on every call). The region key says graph or not, so a region never
    serves both kinds of call."""
    ctx = cfg.ctx
    pieces = ctx._copy_pieces(cfg.max_tokens_per_rank, hidden * np.dtype(dtype).itemsize, cfg.topk, cfg.num_experts,
                              cfg.ep)
    return pieces, bool(ctx.cuda_graphs and ctx.platform != "cpu" and pieces == 0)


def _target(base: str, graph: bool) -> str:
    return base + "_graph" if graph else base


def _dispatch_region(cfg: DispatchConfig, hidden: int, dtype, num_scales: int, graph: bool = False):
    R, M, K, E = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.topk, cfg.num_experts
    nbytes = dispatch_staging_bytes(R, M, K, E, hidden * np.dtype(dtype).itemsize, num_scales,
                                    push=cfg.ctx.platform != "cpu")
    key = ("ep_dispatch", R, M, hidden, np.dtype(dtype).name, num_scales, K, E, "graph" if graph else "stream")
    return cfg.ctx.region(nbytes, "device", key=key, what="EP dispatch buffer")


def _combine_region(cfg: DispatchConfig, hidden: int, dtype):
    R, M, K = cfg.num_ranks, cfg.max_tokens_per_rank, cfg.topk
    nbytes = combine_staging_bytes(R, M, K, hidden * np.dtype(dtype).itemsize, push=cfg.ctx.platform != "cpu")
    return cfg.ctx.region(nbytes, "device", key=("ep_combine", R, M, hidden, np.dtype(dtype).name, K),
                          what="EP combine buffer")


# ------------------------------------------------------------------------------------------ raw FFI calls
def _dispatch_raw(cfg: DispatchConfig, zero_padding: bool, x, w, sf, topk_idx, token):
    ctx = cfg.ctx
    N, H = x.shape
    K, R, E_loc, rows, rt = cfg.topk, cfg.num_ranks, cfg.num_local_experts, cfg.rows, cfg.token_rows
    P = sf.shape[1]
    pieces, graph = _dispatch_plan(cfg, H, x.dtype)
    region = _dispatch_region(cfg, H, x.dtype, P, graph)
    i32, f32 = jnp.int32, jnp.float32
    has_w = w.shape[1] != 0
    results = [
        _call.like(x, (rows, H)),                                         # recv_x
        _call.like(x, (rows, P), sf.dtype),                               # recv_x_scales
        _call.like(x, (0 if cfg.expand else rt, K), i32),                 # recv_topk_idx
        _call.like(x, ((rows,) if cfg.expand else (rt, K)) if has_w else (0,), f32),  # recv_topk_weights
        _call.like(x, (R,), i32),                                         # psum_rank
        _call.like(x, (E_loc,), i32),                                     # psum_expert
        _call.like(x, (E_loc,), i32),                                     # unaligned
        _call.like(x, (rt, K + 2), i32),                                  # recv_src_metadata
        _call.like(x, (N, R), i32),                                       # dst_row
        _call.like(x, (), i32),                                           # num_recv_tokens
        _call.like(x, (E_loc,), i32),                                     # group_sizes
        _call.like(x, (), token.dtype),                                   # token_out
    ]
    return _call.call(ctx, _target("jax_engram_ep_dispatch", graph), results, x, sf, topk_idx, w, token,
                      alloc_id=region.alloc_id, offset=region.offset, **cfg.dispatch_attrs(pieces, zero_padding))


def _cached_raw(cfg: DispatchConfig, zero_padding: bool, x, w, sf, meta, psum_rank, psum_expert, unaligned, dst_row,
                token):
    N, H = x.shape
    K, rows, rt = cfg.topk, cfg.rows, cfg.token_rows
    P = sf.shape[1]
    pieces, graph = _dispatch_plan(cfg, H, x.dtype)
    region = _dispatch_region(cfg, H, x.dtype, P, graph)
    has_w = w.shape[1] != 0
    results = [
        _call.like(x, (rows, H)),
        _call.like(x, (rows, P), sf.dtype),
        _call.like(x, ((rows,) if cfg.expand else (rt, K)) if has_w else (0,), jnp.float32),
        _call.like(x, (), token.dtype),
    ]
    return _call.call(cfg.ctx, _target("jax_engram_ep_dispatch_cached", graph), results, x, sf, w, meta, psum_rank,
                      psum_expert, unaligned, dst_row, token, alloc_id=region.alloc_id, offset=region.offset,
                      **cfg.dispatch_attrs(pieces, zero_padding))


def _combine_raw(cfg: DispatchConfig, y, w, biases, meta, dst_row, topk_idx, psum_rank, token):
    H = y.shape[1]
    N, K = cfg.num_tokens, cfg.topk
    region = _combine_region(cfg, H, y.dtype)
    has_w = w.size != 0
    results = [
        _call.like(y, (N, H)),
        _call.like(y, (N, K if has_w else 0), jnp.float32),
        _call.like(y, (), token.dtype),
    ]
    no_bias = _empty((0, H), y.dtype, cfg.ctx)  # the handler takes two bias operands, [0, H] = none
    b0, b1 = tuple(biases) + (no_bias,) * (2 - len(biases))
    graph = cfg.ctx.cuda_graphs and cfg.ctx.platform != "cpu"
    return _call.call(cfg.ctx, _target("jax_engram_ep_combine", graph), results, y, w, b0, b1, meta, dst_row, topk_idx,
                      psum_rank, token, alloc_id=region.alloc_id, offset=region.offset, **cfg.combine_attrs())


# ------------------------------------------------------------------------- the path (see jax_engram._ep_autodiff)
# Around a path's raw calls, which take and return what the native handlers do (an absent weights / scales operand is
# an empty array, a fresh dispatch returns every handle array): the flat path's are the custom calls above, the
# one-rank path's (jax_engram._ep_local) compute the same in plain JAX.
def dispatch_with(raw, cfg: DispatchConfig, zero_padding: bool, x, w, sf, topk_idx, token):
    """(recv_x, recv_sf, recv_w, handle) of a dispatch through ``raw`` (``_dispatch_raw``'s signature); w / sf None
    when absent. The one place the EPHandle of a one-axis dispatch is built."""
    num_tokens = x.shape[0]
    w_in = w if w is not None else _call.vary(jnp.zeros((num_tokens, 0), jnp.float32), _data_axes(x))
    sf_in = sf if sf is not None else _empty((num_tokens, 0), jnp.float32, cfg.ctx)
    (recv_x, recv_sf, recv_topk, recv_w, psum_rank, psum_expert, unaligned, meta, dst_row, num_recv, group_sizes,
     t) = raw(cfg, zero_padding, x, w_in, sf_in, topk_idx, token)
    handle = EPHandle(psum_num_recv_tokens_per_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
                      num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=meta, dst_row=dst_row,
                      topk_idx=topk_idx, num_recv_tokens=num_recv, group_sizes=group_sizes,
                      recv_topk_idx=None if cfg.expand else recv_topk, done=t, config=cfg)
    return recv_x, recv_sf if sf is not None else None, recv_w if w is not None else None, handle


def cached_with(raw, cfg: DispatchConfig, zero_padding: bool, x, w, sf, handle: EPHandle, token):
    """(recv_x, recv_sf, recv_w, token) of a cached dispatch through ``handle`` and ``raw`` (``_cached_raw``'s
    signature)."""
    num_tokens = x.shape[0]
    w_in = w if w is not None else _call.vary(jnp.zeros((num_tokens, 0), jnp.float32), _data_axes(x))
    sf_in = sf if sf is not None else _empty((num_tokens, 0), jnp.float32, cfg.ctx)
    recv_x, recv_sf, recv_w, t = raw(
        cfg, zero_padding, x, w_in, sf_in, handle.recv_src_metadata, handle.psum_num_recv_tokens_per_rank,
        handle.psum_num_recv_tokens_per_expert, handle.num_unaligned_recv_tokens_per_expert, handle.dst_row, token)
    return recv_x, recv_sf if sf is not None else None, recv_w if w is not None else None, t


def combine_with(raw, cfg: DispatchConfig, y, w, biases, handle: EPHandle, token):
    """(combined_x, combined_w, token) of the combine through ``handle`` and ``raw`` (``_combine_raw``'s
    signature); w None when absent, 0-2 biases."""
    w_in = w if w is not None else _call.vary(jnp.zeros((0,), jnp.float32), _data_axes(y))
    cx, cw, t = raw(cfg, y, w_in, tuple(biases), handle.recv_src_metadata, handle.dst_row, handle.topk_idx,
                    handle.psum_num_recv_tokens_per_rank, token)
    return cx, cw if w is not None else None, t


def dispatch_impl(cfg: DispatchConfig, zero_padding: bool, x, w, sf, topk_idx, token):
    """(recv_x, recv_sf, recv_w, handle) of a dispatch; w / sf None when absent (the handlers take [N, 0])."""
    return dispatch_with(_dispatch_raw, cfg, zero_padding, x, w, sf, topk_idx, token)


def cached_impl(cfg: DispatchConfig, zero_padding: bool, x, w, sf, handle: EPHandle, token):
    """(recv_x, recv_sf, recv_w, token) of a cached dispatch through ``handle``."""
    return cached_with(_cached_raw, cfg, zero_padding, x, w, sf, handle, token)


def combine_impl(cfg: DispatchConfig, y, w, biases, handle: EPHandle, token):
    """(combined_x, combined_w, token) of the combine through ``handle``; w None when absent, 0-2 biases."""
    return combine_with(_combine_raw, cfg, y, w, biases, handle, token)


# ------------------------------------------------------------------------------------------- entry points
# One-axis contexts, for the flat path and the one-rank path alike (``path``: the module whose dispatch_impl /
# cached_impl / combine_impl run the op under _ep_autodiff's gradient rules).
def dispatch_on(path, args: _ep_args.DispatchArgs) -> DispatchResult:
    """A (cached) dispatch over a one-axis context on ``path``."""
    cfg = args.config
    ctx = cfg.ctx
    x = _vary(args.x, ctx)
    data_axes = _data_axes(x)
    w = _call.vary(args.topk_weights, data_axes) if args.topk_weights is not None else None
    sf = _vary(args.x_scales, ctx) if args.x_scales is not None else None
    tok = _call.vary(_ffi_token(args.token, ctx), data_axes)
    if not args.cached:
        topk_idx = args.topk_idx
        if args.validate_routing:
            tok = tok + _ep_args.routing_errors(topk_idx, cfg.num_experts, ctx)
        topk_idx = _vary(topk_idx.astype(jnp.int32), ctx)
        recv_x, recv_sf, recv_w, h = _ep_autodiff.dispatch_op(path, cfg, args.zero_padding, x, w, sf, topk_idx, tok)
    else:
        recv_x, recv_sf, recv_w, t = _ep_autodiff.cached_dispatch_op(path, cfg, args.zero_padding, x, w, sf,
                                                                     args.handle, tok)
        h = args.handle.replace(done=t, config=cfg)
    return DispatchResult(recv_x, recv_sf, h.recv_topk_idx, recv_w, h.num_recv_tokens, h.group_sizes, h, h.done)


def combine_on(path, args: _ep_args.CombineArgs) -> CombineResult:
    """The combine of a one-axis dispatch on ``path``."""
    cfg = args.config
    ctx = cfg.ctx
    y = _vary(args.y, ctx)
    data_axes = _data_axes(y)
    w = _call.vary(args.topk_weights, data_axes) if args.topk_weights is not None else None
    biases = tuple(_call.vary(b, data_axes) for b in args.biases)
    tok = _call.vary(_ffi_token(args.token, ctx), data_axes)
    cx, cw, t = _ep_autodiff.combine_op(path, cfg, y, w, biases, args.handle, tok)
    return CombineResult(cx, cw, t)


def dispatch(args: _ep_args.DispatchArgs) -> DispatchResult:
    """A (cached) dispatch over a flat context, on the native kernels."""
    return dispatch_on(sys.modules[__name__], args)


def combine(args: _ep_args.CombineArgs) -> CombineResult:
    """The combine of a flat dispatch, on the native kernels."""
    return combine_on(sys.modules[__name__], args)
