"""MoE expert-parallel dispatch / combine (DeepEP V2 direct mode) as jit-able, differentiable JAX ops.

Call inside ``jax.shard_map`` over the context's mesh axis (local shapes), under ``jax.jit``::

    res = jax_engram.dispatch(x, topk_idx, topk_weights, ctx=ctx, num_experts=E, max_tokens_per_rank=M,
                              expand=True, expert_alignment=128, zero_padding=True)
    y = expert_mlp(res.recv_x, res.group_sizes) * res.recv_topk_weights[:, None]
    out = jax_engram.combine(y.astype(jnp.bfloat16), res.handle).combined_x

Shapes are static worst cases (R ranks, M = max_tokens_per_rank, K = top-k, E_loc = E / R, A = alignment):
non-expand ``recv_x`` is ``[R*M, H]`` (rows grouped by source rank, then source token), expand ``recv_x`` is
``[align(R*M*min(K,E_loc) + (A-1)*E_loc, A), H]`` (per local expert a segment at
``start[e] = sum_{j<e} align(count_j, A)``, rows sorted by source global id ``src_rank*M + t``). The real
counts are device data (``num_recv_tokens``, ``group_sizes``, the handle's psums), so a changing number of
routed tokens never recompiles. Rows past the real count are unspecified (only alignment padding rows are
defined, and only with ``zero_padding=True``).

Semantics: ``docs/semantics.md`` ("MoE dispatch", "MoE combine"); they are tested bit-exactly against
:mod:`jax_engram.reference`. Notes:

* The receive order is always canonical: the receiver pulls rows in the reference (= DeepEP
  deterministic-mode) order, run to run.
* ``combine`` is an UNWEIGHTED sum (fp32 accumulation, one rounding per reduction level, bias first, ranks
  in ascending order of the token's master top-k position). Apply routing weights yourself before it
  (multiply the expert outputs by ``recv_topk_weights``); ``combine(topk_weights=...)`` only routes weights
  back to the source tokens (``combined_topk_weights``).
* Ordering: every op takes ``after=`` and returns ``done`` (an opaque float32 scalar, as for every jax_engram
  op). ``combine`` follows its dispatch through ``handle.done``; pass ``after=`` explicitly to order EP ops
  that are not otherwise connected by data (e.g. two micro-batches): every rank must run the same sequence of
  EP ops on a context. The gradient pass is ordered the same way, in reverse (the cotangent of ``done``
  carries the order).
* Autodiff (``jax.custom_vjp``): d dispatch / d x = combine of the ``recv_x`` cotangent (fp32 sums);
  d dispatch / d topk_weights = the combine's routing of the ``recv_topk_weights`` cotangent (as in DeepEP,
  non-expand: the cotangent of copies at top-k positions whose expert is not on the receiving rank is
  dropped); d combine / d y = cached dispatch of the ``combined_x`` cotangent (rows combine did not read get
  0), d combine / d topk_weights = its routing back, d bias = the cotangent.
* Buffers: staging regions are sized from M, hidden, K and dtype on first use (``ctx.region``), carved from
  the context's ``device_bytes`` reservation if one was given (a too-small one fails with the bytes needed).
"""
from __future__ import annotations

from typing import Optional

import jax

from jax_engram import _ep_args, _ep_hier, _ep_local
from jax_engram._ep_types import (MAX_EXPERTS, MAX_LOCAL_EXPERTS, MAX_TOPK, CombineResult, DispatchConfig,
                                  DispatchResult, EPHandle, combine_staging_bytes, dispatch_staging_bytes, expand_rows)
from jax_engram.config import EPConfig, ep_config as _ep_config
from jax_engram.context import AnyContext, HierContext

__all__ = ["dispatch", "combine", "DispatchResult", "CombineResult", "EPHandle", "dispatch_staging_bytes",
           "combine_staging_bytes", "expand_rows", "MAX_TOPK"]

for _public in (EPHandle, DispatchResult, CombineResult):  # defined in _ep_types, documented here
    _public.__module__ = __name__


def _path(cfg: DispatchConfig):
    """The module whose ``dispatch(DispatchArgs)`` / ``combine(CombineArgs)`` run an op of this dispatch config
    (``args.config``; a combine's is its handle's): the hierarchical path for a ("node", "gpu") group, the one-rank
    path for a flat context of one rank with ``EPConfig.one_rank == "local"`` (the default), else the flat path on
    the native kernels (:func:`jax_engram._ep_local.path`, which the hierarchical path's intra-node ops use too: a
    node of one rank takes the one-rank path). Each runs under the one gradient rule per op of
    :mod:`jax_engram._ep_autodiff`."""
    if isinstance(cfg.ctx, HierContext):
        return _ep_hier
    return _ep_local.path(cfg)


def dispatch(x: jax.Array, topk_idx: Optional[jax.Array] = None, topk_weights: Optional[jax.Array] = None, *,
             ctx: AnyContext, num_experts: int, max_tokens_per_rank: int, expand: bool = False,
             expert_alignment: int = 1, zero_padding: bool = False, x_scales: Optional[jax.Array] = None,
             handle: Optional[EPHandle] = None, num_sms: Optional[int] = None, after: Optional[jax.Array] = None,
             validate_routing: bool = False, config: Optional[EPConfig] = None) -> DispatchResult:
    """Send every token to the ranks owning its top-k experts (inside shard_map over ``ctx``'s axis).

    The order of the received rows is always canonical (source rank, then source token; expand segments by
    source global id), the same run to run (DeepEP's deterministic mode).

    Args:
      x: ``[N, H]`` bf16 / f16 / f32, or float8_e4m3fn with ``x_scales`` ``[N, P]`` (f32 or int32, copied
        verbatim). N <= max_tokens_per_rank.
      topk_idx: ``[N, K]`` int32 (int64 accepted) global expert ids, -1 = none (not sent, not counted).
        A duplicate expert within a token, or an id outside [-1, num_experts), fails the op on every rank.
        Ignored (may be None) with ``handle``.
      topk_weights: ``[N, K]`` float32 or None; routed with the token (non-expand: the whole row;
        expand: the weight of each (token, k) row).
      num_experts: E, a multiple of the ranks R, with E / R <= 256.
      max_tokens_per_rank: M, the static per-rank token bound that sizes every output.
      expand: GEMM-ready per-expert layout (``group_sizes`` feeds ``jax.lax.ragged_dot``).
      expert_alignment: A, per-expert segment alignment (counts are reported aligned to it).
      zero_padding: expand only; zero the alignment padding rows (x, scales, weights).
      handle: replay the layout of a previous dispatch (cached dispatch): same ctx, E, M, expand, A, K, N.
      num_sms: SMs for the CUDA kernels (None/0 = automatic); ignored on CPU.
      after: float32 [] ``done`` of another jax_engram op, to order this op after it; default: no dependency
        (with ``handle``: ``handle.done``).
      validate_routing: check ``topk_idx`` on every rank first (ids in [-1, num_experts), no duplicate expert
        within a token): an all-gather of one small record over the axis, read by the guard (on GPU a host
        sync), which fails the call on every rank, naming the rank, token and id, before anything is sent;
        the context stays usable. Without it bad routing fails the dispatch on the device and leaves the
        context unusable (close it and init a new one). Uses an XLA collective over the axis.
      config: :class:`jax_engram.EPConfig` for this dispatch, the combine that reverses it and their gradients
        (default: the context's ``ep_config``; with ``handle``: the handle's).

    Returns a :class:`DispatchResult` (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
    num_recv_tokens, group_sizes, handle, done).
    """
    args = _ep_args.dispatch_args(
        x, topk_idx, topk_weights, ctx=ctx, num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
        expand=expand, expert_alignment=expert_alignment, zero_padding=zero_padding, x_scales=x_scales,
        handle=handle, num_sms=num_sms, token=after, validate_routing=validate_routing,
        config=None if config is None else _ep_config(config, "jax_engram.dispatch: config"))
    # Every argument is checked: from here on only the path differs (chosen by the context and its EPConfig,
    # see _path).
    return _path(args.config).dispatch(args)


def combine(y: jax.Array, handle: EPHandle, *, topk_weights: Optional[jax.Array] = None,
            bias: jax.Array | tuple[jax.Array, ...] | None = None,
            after: Optional[jax.Array] = None) -> CombineResult:
    """Reduce the expert outputs back to their source tokens (inverse of the dispatch that made ``handle``).

    The context is the handle's (``handle.ctx``); call inside shard_map over its axis.

    Args:
      y: the dispatch's receive layout, bfloat16 (float32 accepted, e.g. for gradient checks; CPU only
        where the CUDA build does not support it): non-expand ``[R*M, H]``, expand ``[rows_exp, H]``.
        Only rows of real (token[, k]) entries are read.
      handle: ``DispatchResult.handle`` of that dispatch.
      topk_weights: non-expand ``[R*M, K]`` / expand ``[rows_exp]`` float32, routed back to the source tokens
        (``combined_topk_weights[t, k]`` = the entry of (t, k) on the rank owning expert ``topk_idx[t, k]``,
        0 where ``topk_idx < 0``). Not applied to y: the combine is an unweighted sum.
      bias: None, one ``[N, H]`` array or a tuple of two, of y's dtype; added first (fp32).
      after: float32 []: order after this instead of the handle's dispatch (default: ``handle.done``).

    Returns a :class:`CombineResult`: ``combined_x`` [N, H] of y's dtype, ``combined_topk_weights`` [N, K]
    float32 or None, ``done`` float32 [].
    """
    args = _ep_args.combine_args(y, handle, topk_weights=topk_weights, bias=bias, token=after)
    # Every argument is checked: from here on only the path differs (chosen by the context and its EPConfig,
    # see _path).
    return _path(args.config).combine(args)
