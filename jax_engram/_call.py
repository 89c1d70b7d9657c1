"""Shared plumbing for jax_engram's FFI calls inside shard_map: axis checks, result types from input avals,
static attributes of exact C++ types."""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir
import numpy as np

from jax_engram import _jax_private


def check_axis(ctx, op: str) -> None:
    """Fail at trace time unless we are inside shard_map over the context's axis (with its size), under jit."""
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
    if _jax_private.in_eager_shard_map():
        raise ValueError(
            f"jax_engram.{op}: called in a shard_map that is not under jax.jit; jax_engram ops run only inside "
            "jitted code (wrap the shard_map: jax.jit(jax.shard_map(...)))")


def on_mesh(ctx, op: str, x):
    """``x`` (an operand that reaches the op's custom calls), carrying the mesh check: when the function is lowered,
    fail unless the enclosing shard_map's mesh places the context's devices where the context does."""
    axes = _axes(ctx.axis_name)
    (x,) = _mesh_check_p.bind(jnp.asarray(x), op=op, context_id=int(ctx.id), axes=axes,
                              groups=ep_groups(ctx.mesh, axes))
    return x


def _axes(axis_name) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def ep_groups(mesh, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of ``mesh`` along ``axes`` (the first axis major): per group, its devices' ids in rank order.
    An op's rank is the position of its device in its group, which is how its member is found at run time."""
    names = list(mesh.axis_names)
    order = [i for i, n in enumerate(names) if n not in axes] + [names.index(a) for a in axes]
    ids = np.vectorize(lambda d: int(d.id), otypes=[np.int64])(mesh.devices)
    size = int(np.prod([mesh.shape[a] for a in axes]))
    return tuple(tuple(int(v) for v in row) for row in np.transpose(ids, order).reshape(-1, size))


# The mesh check. Inside shard_map only the abstract mesh (axis names and sizes) is known while tracing; the
# concrete mesh, whose device order decides which device runs which position of the axis, is known when the
# function is lowered. check_axis passes one of the op's operands through this primitive (no code emitted); its
# lowering compares the enclosing shard_map's mesh with the context's. Being on the operand's path, it is kept
# exactly where the op is, without an effect (see _ffi_p).
_mesh_check_p = jax.extend.core.Primitive("jax_engram_mesh_check")
_mesh_check_p.multiple_results = True
_mesh_check_p.def_abstract_eval(lambda *avals, **_: list(avals))
_mesh_check_p.def_impl(lambda *xs, **_: list(xs))
ad.primitive_jvps[_mesh_check_p] = lambda primals, tangents, **kw: (_mesh_check_p.bind(*primals, **kw), list(tangents))
batching.primitive_batchers[_mesh_check_p] = lambda args, dims, **kw: (_mesh_check_p.bind(*args, **kw), list(dims))


def _mesh_check_lowering(lowering, *operands, op, context_id, axes, groups):
    mesh = getattr(lowering.module_context.axis_context, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh) or not all(a in mesh.axis_names for a in axes):
        return list(operands)  # not lowered inside a shard_map over a concrete mesh: nothing to compare
    known = set(groups)
    for got in ep_groups(mesh, axes):
        if got not in known:
            theirs = next((g for g in groups if set(g) & set(got)), groups[0])
            name = axes[0] if len(axes) == 1 else axes
            raise ValueError(
                f"jax_engram.{op}: the shard_map's mesh does not place the devices along axis {name!r} as the "
                f"mesh of context {context_id} does: the context's group has devices {list(theirs)} (by id, "
                f"rank 0 first), this mesh has {list(got)}. An op's rank is its device's position in the context's "
                "mesh, so the rows would reach the wrong ranks; run the op in a shard_map over the context's mesh "
                "(ctx.mesh)")
    return list(operands)


mlir.register_lowering(_mesh_check_p, _mesh_check_lowering)


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


# jax_engram's FFI calls. ``jax.ffi.ffi_call(has_side_effect=True)`` gives a call JAX's FFI effect, and a jitted
# function with any effect leaves JAX's C++ dispatch path: every call of it goes through Python (about a
# millisecond per step of a model). Our ops are ordered by data dependencies and their results carry what they do,
# so at the JAX level they are effect-free equations (dropped with their results, like any other); in the HLO they
# stay side-effecting custom calls, which XLA never merges, drops or rematerializes. An op whose only result is its
# effect (a write, a barrier) keeps JAX's effect (``effect=True``). A call with ``keep=True`` (an overlapped
# fetch's wait) is kept even when its results are unused, without an effect: it joins the stream its fetch runs on,
# and the fetch is kept by whatever else reads the pending buffers (start_before), which XLA would otherwise reuse
# while that stream still writes them.
_ffi_p = jax.extend.core.Primitive("jax_engram_ffi_call")
_ffi_p.multiple_results = True


def _ffi_dce(used_outputs, eqn):
    if any(used_outputs) or eqn.params["effect"] or eqn.params["keep"]:
        return [True] * len(eqn.invars), eqn
    return [False] * len(eqn.invars), None


def _ffi_abstract_eval(*avals, result_avals, effect, **_):
    return list(result_avals), ({_jax_private.ffi_effect()} if effect else frozenset())


def _ffi_impl(*args, **params):
    return jax.jit(lambda *a: _ffi_p.bind(*a, **params))(*args)


def _ffi_lowering(lowering, *operands, target, result_avals, aliases, attributes, effect, keep):
    del result_avals, effect, keep
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=dict(aliases) or None)
    return rule(lowering, *operands, **dict(attributes))


def _ffi_not_differentiable(*_, target, **__):
    raise ValueError(f"The FFI call to {target} cannot be differentiated (jax_engram differentiates its ops with "
                     "custom rules; this operand reached the call directly)")


_ffi_p.def_effectful_abstract_eval(_ffi_abstract_eval)
_ffi_p.def_impl(_ffi_impl)
ad.primitive_jvps[_ffi_p] = _ffi_not_differentiable
ad.primitive_transposes[_ffi_p] = _ffi_not_differentiable
mlir.register_lowering(_ffi_p, _ffi_lowering)
_jax_private.register_dce_rule(_ffi_p, _ffi_dce)


def call(ctx, target: str, results, *operands, input_output_aliases=None, effect: bool = False, keep: bool = False,
         **attrs):
    """The FFI call ``target`` (``results``: result types, see ``like``); a side-effecting custom call in the HLO,
    effect-free for JAX unless ``effect``, kept with unused results if ``keep`` (see ``_ffi_p``).
    ``input_output_aliases``: {operand index: result index}, as ``jax.ffi.ffi_call`` takes it. Returns the list
    of results (one result if ``results`` is one type)."""
    attrs = {k: (i64(v) if isinstance(v, (bool, int, np.integer)) else v) for k, v in attrs.items()}
    attrs["ctx_id"] = i64(ctx.id)
    single = not isinstance(results, (list, tuple))
    result_avals = tuple([results] if single else results)
    outs = _ffi_p.bind(*[jnp.asarray(o) for o in operands], target=target, result_avals=result_avals,
                       aliases=tuple(sorted((input_output_aliases or {}).items())),
                       attributes=tuple(sorted(attrs.items())), effect=bool(effect), keep=bool(keep))
    return outs[0] if single else list(outs)


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
