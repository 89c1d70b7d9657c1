"""Foundation ops: barrier and ring_exchange (they prove the whole path: windows, peer loads, barriers)."""
from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp

from jax_engram import _call
from jax_engram.context import Context

Placement = Literal["device", "host"]

_UNSET: Any = object()


def _legacy_ctx(op: str, legacy, ctx):
    """The context of a call that may still use the old positional spelling (one release, with a warning)."""
    if legacy is not _UNSET:
        if ctx is not None:
            raise TypeError(f"jax_engram.{op}: the context was given twice (positionally and as ctx=)")
        warnings.warn(f"jax_engram.{op}: passing the context positionally is deprecated; use ctx=",
                      DeprecationWarning, stacklevel=3)
        ctx = legacy
    if ctx is None:
        raise TypeError(f"jax_engram.{op}: missing the keyword argument ctx= (the jax_engram Context)")
    return ctx


def barrier(_ctx: Any = _UNSET, _token: Any = _UNSET, /, *, ctx: Optional[Context] = None,
            token: Optional[jax.Array] = None) -> jax.Array:
    """Barrier over the context's ranks; call inside ``jax.shard_map`` over ctx's axis.

    Args:
      ctx: the :class:`jax_engram.Context`.
      token: optional float32 [] token of an earlier jax_engram op (other dtypes are converted) to order the
        barrier after it.

    Returns a float32 [] token: pass it to the next jax_engram op (or use it in the computation) to order the
    two; independent side-effecting calls may run in any order on XLA:CPU. ``barrier(ctx[, token])``
    (positional) is deprecated.
    """
    ctx = _legacy_ctx("barrier", _ctx, ctx)
    if _token is not _UNSET:
        if token is not None:
            raise TypeError("jax_engram.barrier: the token was given twice (positionally and as token=)")
        token = _token
    _call.check_axis(ctx, "barrier")
    token = _call.new_token(ctx) if token is None else jnp.asarray(token).astype(jnp.float32)
    return _call.call(ctx, "jax_engram_barrier", _call.like(token), token)


def ring_exchange(x: jax.Array, _ctx: Any = _UNSET, /, *, ctx: Optional[Context] = None,
                  placement: Placement = "device") -> jax.Array:
    """Each rank publishes its block ``x`` in its window and returns its left neighbour's (rank - 1).

    Args:
      x: any shape and dtype (local shape inside ``shard_map``).
      ctx: the :class:`jax_engram.Context`.
      placement: the window memory used, ``"device"`` (HBM) or ``"host"`` (host NUMA memory on GPUs), so a
        test can prove that both segments of a peer are readable from every device.

    Returns an array of x's shape and dtype: rank r gets rank (r - 1) mod R's block.
    ``ring_exchange(x, ctx)`` (positional context) is deprecated.
    """
    ctx = _legacy_ctx("ring_exchange", _ctx, ctx)
    _call.check_axis(ctx, "ring_exchange")
    x = jnp.asarray(x)
    nbytes = x.size * x.dtype.itemsize
    region = ctx.region(nbytes, placement, key=("ring_exchange", placement), what="ring_exchange buffer")
    return _call.call(ctx, "jax_engram_ring_exchange", _call.like(x), x, alloc_id=region.alloc_id,
                      offset=region.offset)
