"""Foundation ops: barrier and ring_exchange (they prove the whole path: windows, peer loads, barriers)."""
from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

from jax_engram import _call
from jax_engram.context import Context

Placement = Literal["device", "host"]

def barrier(*, ctx: Context, after: Optional[jax.Array] = None) -> jax.Array:
    """Barrier over the context's ranks; call inside ``jax.shard_map`` over ctx's axis.

    Args:
      ctx: the :class:`jax_engram.Context`.
      after: optional float32 [] scalar that an earlier jax_engram op returned (other dtypes are converted) to
        order the barrier after it.

    Returns ``done``, a float32 [] scalar: pass it as ``after=`` to the next jax_engram op (or use it in the
    computation) to order the two; independent side-effecting calls may run in any order on XLA:CPU.
    """
    _call.check_axis(ctx, "barrier")
    token = _call.new_token(ctx) if after is None else jnp.asarray(after).astype(jnp.float32)
    token = _call.on_mesh(ctx, "barrier", token)
    return _call.call(ctx, "jax_engram_barrier", _call.like(token), token, effect=True)


def ring_exchange(x: jax.Array, *, ctx: Context, placement: Placement = "device") -> jax.Array:
    """Each rank publishes its block ``x`` in its window and returns its left neighbour's (rank - 1).

    Args:
      x: any shape and dtype (local shape inside ``shard_map``).
      ctx: the :class:`jax_engram.Context`.
      placement: the window memory used, ``"device"`` (HBM) or ``"host"`` (host NUMA memory on GPUs), so a
        test can prove that both segments of a peer are readable from every device.

    Returns an array of x's shape and dtype: rank r gets rank (r - 1) mod R's block.
    """
    _call.check_axis(ctx, "ring_exchange")
    x = _call.on_mesh(ctx, "ring_exchange", x)
    nbytes = x.size * x.dtype.itemsize
    region = ctx.region(nbytes, placement, key=("ring_exchange", placement), what="ring_exchange buffer")
    return _call.call(ctx, "jax_engram_ring_exchange", _call.like(x), x, alloc_id=region.alloc_id,
                      offset=region.offset)
