"""Foundation ops: barrier and ring_exchange (they prove the whole path: windows, peer loads, barriers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_engram import _call


def barrier(ctx, token=None):
    """Barrier over the context's ranks; call inside jax.shard_map over ctx's axis.

    Returns a token (int32 scalar); pass it to the next jax_engram op (or use it in the computation) to
    order the two: independent side-effecting calls may run in any order on XLA:CPU.
    """
    _call.check_axis(ctx, "barrier")
    if token is None:
        token = _call.new_token(ctx)
    token = jnp.asarray(token)
    return _call.call(ctx, "jax_engram_barrier", _call.like(token), token)


def ring_exchange(x, ctx, *, placement: str = "device"):
    """Each rank publishes its block `x` in its window and returns its left neighbour's (rank - 1).

    `placement` selects the window memory used: "device" (HBM) or "host" (host NUMA memory on GPUs), so
    a test can prove that both segments of a peer are readable from every device.
    """
    _call.check_axis(ctx, "ring_exchange")
    x = jnp.asarray(x)
    nbytes = x.size * x.dtype.itemsize
    region = ctx.region(nbytes, placement, key=("ring_exchange", placement), what="ring_exchange buffer")
    return _call.call(ctx, "jax_engram_ring_exchange", _call.like(x), x, alloc_id=region.alloc_id,
                      offset=region.offset)
