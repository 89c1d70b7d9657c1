"""The gradients of dispatch and combine (``jax.custom_vjp``), one rule per op for every path.

A path (:mod:`jax_engram._ep_flat`, :mod:`jax_engram._ep_local`, :mod:`jax_engram._ep_hier`; ``jax_engram.ep._path``
picks one per context) is a module with three functions over varying arrays, absent operands given as None:

* ``dispatch_impl(cfg, zero_padding, x, w, sf, topk_idx, token) -> (recv_x, recv_sf, recv_w, handle)``
* ``cached_impl(cfg, zero_padding, x, w, sf, handle, token) -> (recv_x, recv_sf, recv_w, token)``
* ``combine_impl(cfg, y, w, biases, handle, token) -> (combined_x, combined_w, token)``

The rules (docs/semantics.md): d dispatch / d x = the combine of the ``recv_x`` cotangent through the handle (fp32
sums; FP8 inputs get none), d dispatch / d topk_weights = the combine's routing of the ``recv_topk_weights``
cotangent; d combine / d y = the cached dispatch of the ``combined_x`` cotangent, with rows the combine did not
read set to 0, d combine / d topk_weights = its routing back, d bias = the cotangent. The token's cotangent
carries the order of the backward pass, in reverse.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_engram import _call
from jax_engram._ep_types import COMBINE_DTYPES


def _float_ct(g, like):
    """Instantiate a (possibly symbolic-zero / float0) cotangent as an array of like's type."""
    if g is None or (hasattr(g, "dtype") and g.dtype == jax.dtypes.float0):
        return jnp.zeros_like(like)
    return g


def _token_ct(t, token):
    return jax.lax.convert_element_type(t, token.dtype) + jnp.zeros_like(token)


def valid_rows(cfg, num_recv, psum_expert, unaligned):
    """[rows] bool: rows of a receive layout that hold a real (token[, k]) (not padding, not past the count)."""
    r = jnp.arange(cfg.rows, dtype=jnp.int32)
    if not cfg.expand:
        return r < num_recv
    start = psum_expert - unaligned
    e = jnp.clip(jnp.searchsorted(start, r, side="right") - 1, 0, cfg.num_local_experts - 1)
    return (r >= start[e]) & (r < psum_expert[e])


# ------------------------------------------------------------------------------------------------ dispatch
def _dispatch_grad(path, cfg, handle, x, w, token, g_x, g_w, g_tok):
    """(dx, dw, token cotangent) of a (cached) dispatch: the combine of the received rows' cotangents through the
    handle (FP8 inputs get no dx)."""
    axes = cfg.ctx.axis_name
    g_x = _float_ct(g_x, jnp.zeros((cfg.rows, x.shape[1]), x.dtype))
    y = g_x if any(g_x.dtype == jnp.dtype(d) for d in COMBINE_DTYPES) else g_x.astype(jnp.float32)
    gw = None
    if w is not None:
        gw = _call.vary(_float_ct(g_w, jnp.zeros((cfg.rows,) if cfg.expand else (cfg.token_rows, cfg.topk),
                                                 jnp.float32)), axes)
    g_tok = _float_ct(g_tok, token)
    dx, dw, t = path.combine_impl(cfg, _call.vary(y, axes), gw, (), handle,
                                  _call.vary(g_tok.astype(jnp.float32), axes))
    dx = None if x.dtype == jnp.dtype(jnp.float8_e4m3fn) else dx.astype(x.dtype)
    return dx, dw, _token_ct(t, token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def dispatch_op(path, cfg, zero_padding, x, w, sf, topk_idx, token):
    """(recv_x, recv_sf, recv_w, handle) of a dispatch on ``path``."""
    return path.dispatch_impl(cfg, zero_padding, x, w, sf, topk_idx, token)


def _dispatch_fwd(path, cfg, zero_padding, x, w, sf, topk_idx, token):
    out = path.dispatch_impl(cfg, zero_padding, x, w, sf, topk_idx, token)
    return out, (out[3], x, w, token)


def _dispatch_bwd(path, cfg, zero_padding, saved, g):
    handle, x, w, token = saved
    g_x, _, g_w, g_handle = g
    dx, dw, tok_ct = _dispatch_grad(path, cfg, handle, x, w, token, g_x, g_w, g_handle.done)
    return dx, dw, None, None, tok_ct


dispatch_op.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def cached_dispatch_op(path, cfg, zero_padding, x, w, sf, handle, token):
    """(recv_x, recv_sf, recv_w, token) of a cached dispatch on ``path`` (the layout of ``handle``)."""
    return path.cached_impl(cfg, zero_padding, x, w, sf, handle, token)


def _cached_fwd(path, cfg, zero_padding, x, w, sf, handle, token):
    return path.cached_impl(cfg, zero_padding, x, w, sf, handle, token), (handle, x, w, token)


def _cached_bwd(path, cfg, zero_padding, saved, g):
    handle, x, w, token = saved
    g_x, _, g_w, g_tok = g
    dx, dw, tok_ct = _dispatch_grad(path, cfg, handle, x, w, token, g_x, g_w, g_tok)
    return dx, dw, None, jax.tree_util.tree_map(lambda _: None, handle), tok_ct


cached_dispatch_op.defvjp(_cached_fwd, _cached_bwd)


# ------------------------------------------------------------------------------------------------- combine
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def combine_op(path, cfg, y, w, biases, handle, token):
    """(combined_x, combined_w, token) of a combine on ``path``."""
    return path.combine_impl(cfg, y, w, biases, handle, token)


def _combine_fwd(path, cfg, y, w, biases, handle, token):
    return path.combine_impl(cfg, y, w, biases, handle, token), (y, w, biases, handle, token)


def _combine_bwd(path, cfg, saved, g):
    y, w, biases, handle, token = saved
    g_x, g_w, g_tok = g
    axes = cfg.ctx.axis_name
    num_tokens, hidden, topk = cfg.num_tokens, y.shape[1], cfg.topk
    g_x = _call.vary(_float_ct(g_x, jnp.zeros((num_tokens, hidden), y.dtype)), axes)
    g_tok = _float_ct(g_tok, token)
    gw = None if w is None else _call.vary(_float_ct(g_w, jnp.zeros((num_tokens, topk), jnp.float32)), axes)
    dy, _, dw, t = path.cached_impl(cfg, cfg.expand, g_x, gw, None, handle,
                                    _call.vary(g_tok.astype(jnp.float32), axes))
    valid = valid_rows(cfg, handle.psum_num_recv_tokens_per_rank[-1], handle.psum_num_recv_tokens_per_expert,
                       handle.num_unaligned_recv_tokens_per_expert)
    dy = jnp.where(valid[:, None], dy, jnp.zeros((), dy.dtype))
    if w is not None:
        dw = (jnp.where(valid, dw, 0.0) if cfg.expand
              else jnp.where(valid[:, None] & (handle.recv_topk_idx >= 0), dw, 0.0))
    db = tuple(g_x.astype(b.dtype) for b in biases)
    return dy, dw, db, jax.tree_util.tree_map(lambda _: None, handle), _token_ct(t, token)


combine_op.defvjp(_combine_fwd, _combine_bwd)
