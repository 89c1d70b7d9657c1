"""Shared plumbing for jax_engram's FFI calls inside shard_map: axis checks, result types from input avals,
static attributes of exact C++ types."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_axis(ctx, op: str) -> None:
    """Fail at trace time unless we are inside shard_map over the context's axis (with its size)."""
    ctx._check_open()
    try:
        size = jax.lax.axis_size(ctx.axis_name)
    except (NameError, ValueError, KeyError) as e:
        raise ValueError(
            f"jax_engram.{op} must be called inside jax.shard_map over the mesh axis {ctx.axis_name!r} of its "
            f"context (got: {e})") from None
    if int(size) != ctx.num_ranks:
        raise ValueError(f"jax_engram.{op}: axis {ctx.axis_name!r} has size {size} here but the context has "
                         f"{ctx.num_ranks} ranks")


def require_host_callbacks(what: str) -> None:
    """Errors that are only known on the device (a checked-mode id, bad routing) are raised by host callbacks,
    which JAX runs on its CPU platform: refuse at trace time, with the fix, when that platform is left out."""
    try:
        jax.devices("cpu")
    except RuntimeError as e:
        raise RuntimeError(
            f"jax_engram {what} raises its error from a host callback, which needs JAX's CPU platform: keep 'cpu' "
            "in JAX_PLATFORMS / jax_platforms (e.g. JAX_PLATFORMS=cuda,cpu)") from e


def like(x, shape=None, dtype=None):
    """Result type with x's sharding / varying-axes info (a bare ShapeDtypeStruct inside shard_map
    silently returns device 0's shard)."""
    t = jax.typeof(x)
    return t.update(shape=t.shape if shape is None else tuple(shape), dtype=t.dtype if dtype is None else dtype)


#: The dtype of every ordering token of jax_engram (float32: a token threads through jax.custom_vjp, where an
#: integer would have a float0 cotangent and could not carry the order of the backward pass).
TOKEN_DTYPE = jnp.float32


def new_token(ctx):
    """A per-rank float32 scalar (0) that varies along the context axis (an ordering token)."""
    return jax.lax.axis_index(ctx.axis_name).astype(TOKEN_DTYPE) * 0


def i64(v) -> np.int64:
    return np.int64(int(v))


def call(ctx, target: str, results, *operands, **attrs):
    """ffi_call with side effects (never DCE'd or CSE'd): every jax_engram op communicates."""
    attrs = {k: (i64(v) if isinstance(v, (bool, int, np.integer)) else v) for k, v in attrs.items()}
    outs = jax.ffi.ffi_call(target, results, has_side_effect=True)(*operands, ctx_id=i64(ctx.id), **attrs)
    return outs


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies along (shard_map's type of x)."""
    t = jax.typeof(x)
    return frozenset(t.manual_axis_type.varying if hasattr(t, "manual_axis_type") else t.vma)  # jax >= 0.11.2 / older


def vary(x, axes):
    """x marked as varying along every axis of ``axes`` (one mesh axis name or a tuple of them): results of a
    custom call get their type from their operands, and collectives over an axis need operands varying along it."""
    x = jnp.asarray(x)
    missing = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
