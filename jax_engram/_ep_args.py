"""The arguments of ``jax_engram.dispatch`` / ``jax_engram.combine``, validated once for every path.

``dispatch_args`` / ``combine_args`` turn what the user passed into a frozen record: the static configuration
(:class:`~jax_engram._ep_types.DispatchConfig`) and the arrays, with dtypes and shapes checked. The checks and
their messages are the same whatever the shape of the context's group (one mesh axis, or ("node", "gpu")
axes): they speak of the user's arguments (global expert ids, ``num_experts``, the group's ranks), never of a
path's inner numbers. The paths (:mod:`jax_engram._ep_flat`, :mod:`jax_engram._ep_hier`) take these records
and check nothing again.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import _call, _ep_guard
from jax_engram._ep_types import (BAD_DUPLICATE_EXPERT, BAD_EXPERT_RANGE, COMBINE_DTYPES, MAX_EXPERTS,
                                  MAX_LOCAL_EXPERTS, MAX_TOPK, SF_DTYPES, X_DTYPES, DispatchConfig, EPHandle)
from jax_engram.config import EPConfig


def dtype_in(dtype, choices) -> bool:
    """Whether ``dtype`` is one of ``choices``."""
    return any(np.dtype(dtype) == np.dtype(c) for c in choices)


def check_int(name: str, v, lo: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class DispatchArgs:
    """A validated dispatch: ``config`` (static), the arrays as given (``topk_idx`` int32 [N, K], None with a
    handle; ``topk_weights`` float32 [N, K] or None; ``x_scales`` [N, P] or None), the handle of a cached
    dispatch or None, the ordering token as given (None: none / the handle's) and ``validate_routing``."""

    config: DispatchConfig
    zero_padding: bool
    x: jax.Array
    topk_idx: Optional[jax.Array]
    topk_weights: Optional[jax.Array]
    x_scales: Optional[jax.Array]
    handle: Optional[EPHandle]
    token: Optional[jax.Array]
    validate_routing: bool

    @property
    def cached(self) -> bool:
        return self.handle is not None


@dataclasses.dataclass(frozen=True)
class CombineArgs:
    """A validated combine: the handle's ``config``, ``y`` [rows, H], ``topk_weights`` (non-expand [R*M, K],
    expand [rows]) or None, 0-2 ``biases`` [N, H] of y's dtype, the handle, the ordering token as given (None:
    the handle's)."""

    config: DispatchConfig
    y: jax.Array
    topk_weights: Optional[jax.Array]
    biases: tuple
    handle: EPHandle
    token: Optional[jax.Array]


def _check_token(token):
    """The ordering token as given (None: none), which must be a scalar."""
    if token is None:
        return None
    token = jnp.asarray(token)
    if token.shape != ():
        raise ValueError(f"after= must be a scalar (e.g. the done of a previous jax_engram op), got shape "
                         f"{token.shape}")
    return token


def _check_row_bytes(op: str, ctx, hidden: int, dtype, why: str) -> None:
    if ctx.platform != "cpu" and (hidden * np.dtype(dtype).itemsize) % 16 != 0:
        raise ValueError(f"jax_engram.{op}: hidden * itemsize = {hidden * np.dtype(dtype).itemsize} bytes must be a "
                         f"multiple of 16 on GPUs{why}")


def dispatch_args(x, topk_idx, topk_weights, *, ctx, num_experts, max_tokens_per_rank, expand, expert_alignment,
                  zero_padding, x_scales, handle, num_sms, token, validate_routing,
                  config: Optional[EPConfig]) -> DispatchArgs:
    """Check the arguments of ``jax_engram.dispatch`` (see its docstring) against ``ctx`` (inside shard_map over
    its axes); raise ``TypeError`` / ``ValueError`` naming the argument."""
    _call.check_axis(ctx, "dispatch")
    num_ranks = ctx.num_ranks
    x = _call.on_mesh(ctx, "dispatch", x)
    if x.ndim != 2:
        raise ValueError(f"jax_engram.dispatch: x must be [num_tokens, hidden], got shape {x.shape}")
    if not dtype_in(x.dtype, X_DTYPES):
        raise TypeError(f"jax_engram.dispatch: x must be bfloat16, float16, float32 or float8_e4m3fn, got {x.dtype}")
    num_tokens, hidden = x.shape
    num_experts = check_int("num_experts", num_experts, 1)
    max_tokens_per_rank = check_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    expert_alignment = check_int("expert_alignment", expert_alignment, 1)
    num_sms = 0 if num_sms is None else check_int("num_sms", num_sms, 0)
    expand, zero_padding = bool(expand), bool(zero_padding)
    if num_experts % num_ranks != 0:
        raise ValueError(f"jax_engram.dispatch: num_experts={num_experts} must be a multiple of the {num_ranks} "
                         "ranks of the context")
    if num_experts > MAX_EXPERTS or num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        raise ValueError(f"jax_engram.dispatch: num_experts={num_experts} exceeds the limits (E <= {MAX_EXPERTS}, "
                         f"E / ranks <= {MAX_LOCAL_EXPERTS}; got {num_experts // num_ranks} per rank)")
    if num_tokens > max_tokens_per_rank:
        raise ValueError(f"jax_engram.dispatch: x has {num_tokens} tokens but max_tokens_per_rank="
                         f"{max_tokens_per_rank}")
    if zero_padding and not expand:
        raise ValueError("jax_engram.dispatch: zero_padding requires expand=True")
    _check_row_bytes("dispatch", ctx, hidden, x.dtype, " (x rows are moved in 16-byte vectors)")
    if dtype_in(x.dtype, (jnp.float8_e4m3fn,)) and x_scales is None:
        raise ValueError("jax_engram.dispatch: float8_e4m3fn x requires x_scales [N, P] (float32 or int32)")
    if x_scales is not None:
        x_scales = jnp.asarray(x_scales)
        if x_scales.ndim != 2 or x_scales.shape[0] != num_tokens:
            raise ValueError(f"jax_engram.dispatch: x_scales must be [N={num_tokens}, P], got shape {x_scales.shape}")
        if not dtype_in(x_scales.dtype, SF_DTYPES):
            raise TypeError(f"jax_engram.dispatch: x_scales must be float32 or int32, got {x_scales.dtype}")
    if handle is not None:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"jax_engram.dispatch: handle must be an EPHandle from a previous dispatch, got "
                            f"{type(handle).__name__}")
        c = handle.config
        mismatches = [(n, a, b) for n, a, b in (
            ("ctx", c.ctx, ctx), ("num_experts", c.num_experts, num_experts),
            ("max_tokens_per_rank", c.max_tokens_per_rank, max_tokens_per_rank), ("expand", c.expand, expand),
            ("expert_alignment", c.expert_alignment, expert_alignment), ("num_tokens", c.num_tokens, num_tokens))
            if a is not b and a != b]
        if mismatches:
            raise ValueError("jax_engram.dispatch: the handle comes from a dispatch with a different "
                             + ", ".join(f"{n} (handle {a!r}, here {b!r})" for n, a, b in mismatches))
        topk = c.topk
        cfg = dataclasses.replace(c, num_sms=num_sms, ep=c.ep if config is None else config)
        topk_idx = None
    else:
        if topk_idx is None:
            raise ValueError("jax_engram.dispatch: topk_idx is required (or pass handle= to replay a layout)")
        topk_idx = jnp.asarray(topk_idx)
        if topk_idx.ndim != 2 or topk_idx.shape[0] != num_tokens:
            raise ValueError(f"jax_engram.dispatch: topk_idx must be [N={num_tokens}, K], got shape "
                             f"{topk_idx.shape}")
        if not dtype_in(topk_idx.dtype, (jnp.int32, jnp.int64)):
            raise TypeError(f"jax_engram.dispatch: topk_idx must be int32 or int64, got {topk_idx.dtype}")
        topk = topk_idx.shape[1]
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"jax_engram.dispatch: top-k = {topk} must be in [1, {MAX_TOPK}]")
        cfg = DispatchConfig(ctx, num_ranks, num_experts, max_tokens_per_rank, num_tokens, topk, expand,
                             expert_alignment, num_sms, ctx.ep_config if config is None else config)
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        if topk_weights.shape != (num_tokens, topk):
            raise ValueError(f"jax_engram.dispatch: topk_weights must be [N, K] = {(num_tokens, topk)}, got "
                             f"{topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise TypeError(f"jax_engram.dispatch: topk_weights must be float32, got {topk_weights.dtype}")
    if token is None and handle is not None:
        token = handle.done
    return DispatchArgs(cfg, zero_padding, x, topk_idx, topk_weights, x_scales, handle, _check_token(token),
                        bool(validate_routing))


def combine_args(y, handle, *, topk_weights, bias, token) -> CombineArgs:
    """Check the arguments of ``jax_engram.combine`` (see its docstring) against the handle's dispatch."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"jax_engram.combine: handle must be the EPHandle of the dispatch it reverses, got "
                        f"{type(handle).__name__}")
    cfg = handle.config
    _call.check_axis(cfg.ctx, "combine")
    y = _call.on_mesh(cfg.ctx, "combine", y)
    if y.ndim != 2 or y.shape[0] != cfg.rows:
        raise ValueError(f"jax_engram.combine: y must be [{cfg.rows}, hidden] (the "
                         f"{'expand' if cfg.expand else 'non-expand'} receive layout of the handle's dispatch), got "
                         f"shape {y.shape}")
    if not dtype_in(y.dtype, COMBINE_DTYPES):
        raise TypeError(f"jax_engram.combine: y must be bfloat16 (or float32), got {y.dtype}")
    num_tokens, hidden = cfg.num_tokens, y.shape[1]
    _check_row_bytes("combine", cfg.ctx, hidden, y.dtype, "")
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        want = (cfg.rows,) if cfg.expand else (cfg.token_rows, cfg.topk)
        if topk_weights.shape != want:
            raise ValueError(f"jax_engram.combine: topk_weights must be {list(want)} for expand={cfg.expand}, got "
                             f"shape {topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise TypeError(f"jax_engram.combine: topk_weights must be float32, got {topk_weights.dtype}")
    if bias is None:
        biases = ()
    elif isinstance(bias, (tuple, list)):
        biases = tuple(bias)
    else:
        biases = (bias,)
    if len(biases) > 2:
        raise ValueError(f"jax_engram.combine: at most two bias arrays, got {len(biases)}")
    checked = []
    for i, b in enumerate(biases):
        b = jnp.asarray(b)
        if b.shape != (num_tokens, hidden):
            raise ValueError(f"jax_engram.combine: bias[{i}] must be [N, H] = {(num_tokens, hidden)}, got shape "
                             f"{b.shape}")
        if b.dtype != y.dtype:
            raise TypeError(f"jax_engram.combine: bias[{i}] must have y's dtype {y.dtype}, got {b.dtype}")
        checked.append(b)
    return CombineArgs(cfg, y, topk_weights, tuple(checked), handle,
                       _check_token(handle.done if token is None else token))


# ---------------------------------------------------------------------------------------------- routing records
def routing_records(topk_idx, num_experts: int, ctx):
    """The group's routing records, int32 [R + 1, 3] (ep_layout.h ep_first_offender): row r = (kind, token, id) of
    global rank r's first bad entry of topk_idx in (token, k) order, as the dispatch kernels find it -- an id outside
    [-1, num_experts) or a valid id an earlier k of its token holds (kind an EpBadKind; 0: none) -- gathered over
    the group; the last row = (this rank's global rank, 0, 0). Ranks are the context's global ranks, whatever the
    shape of its group."""
    N, K = topk_idx.shape
    if N * K == 0:
        rec = jnp.zeros((3,), jnp.int32)
    else:
        ids = topk_idx.astype(jnp.int32)
        out_of_range = (ids < -1) | (ids >= num_experts)
        earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [k, j]: j < k
        repeated = jnp.any((ids[:, :, None] == ids[:, None, :]) & earlier[None], axis=2) & (ids >= 0)
        bad = (out_of_range | repeated).reshape(-1)
        f = jnp.argmax(bad)
        kind = jnp.where(bad[f], jnp.where(out_of_range.reshape(-1)[f], BAD_EXPERT_RANGE, BAD_DUPLICATE_EXPERT), 0)
        rec = jnp.stack([kind, f // K, ids.reshape(-1)[f]]).astype(jnp.int32)
    everyone = jax.lax.all_gather(_call.vary(rec, ctx.axis_name), ctx.axis_name)  # [R, 3], by global rank
    me = jax.lax.axis_index(ctx.axis_name).astype(jnp.int32)
    return _call.vary(jnp.concatenate([everyone, jnp.stack([me, jnp.int32(0), jnp.int32(0)])[None]]),
                      ctx.axis_name)


def routing_guard(records, num_experts: int, ctx, guard_ctx, *, refuse: bool):
    """The guard of ``guard_ctx`` (the context whose ops follow: the flat one, or a ("node", "gpu") group's inner
    one) over ``records`` (``routing_records``). ``refuse`` (validate_routing=True): the call fails with the first
    offender's message, nothing recorded, the context stays usable (on GPU the records are read on the host first);
    else the first offender is recorded in the context as the flat dispatch kernel records bad routing. Returns
    (a float32 zero that comes after the guard, the records as the guard copied them)."""
    zero = _call.vary(jnp.zeros((), jnp.float32), ctx.axis_name)
    return _ep_guard.guard_call(guard_ctx, zero, records, combine=False, num_experts=num_experts,
                                records=2 if refuse else 1)


def routing_errors(topk_idx, num_experts: int, ctx, guard_ctx=None):
    """validate_routing=True: a float32 zero that the dispatch depends on, computed after every rank's topk_idx
    (global expert ids) was checked and the first offender of any rank refused on every rank (the op's own error,
    raised by the call before anything is sent; the context stays usable). ``guard_ctx``: see ``routing_guard``
    (default ``ctx``)."""
    zero, _ = routing_guard(routing_records(topk_idx, num_experts, ctx), num_experts, ctx, guard_ctx or ctx,
                            refuse=True)
    return jax.lax.stop_gradient(zero)
