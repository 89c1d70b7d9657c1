"""The JAX alternatives a user would otherwise pick, fed the same inputs as our ops.

Mesh: 1-D, axis ``"ep"`` (``_common.make_ep_mesh``), R = number of ranks (>= 1).

Engram lookup (table of ``R * rows_per_rank`` rows of ``hidden``, row-sharded over "ep"; each rank
looks up its own ``T`` tokens x ``E`` ids, i.e. ids are a global ``[R*T, E]`` int32 array sharded
over "ep"; output ``[R*T, E*hidden]`` = ``table[ids]``):
  * ``gspmd_take(table, ids)``   plain ``jnp.take`` under jit, partitioned by GSPMD
                                 (every shard gathers every id, masked, then an all-reduce).
  * ``a2a_lookup(table, ids)``   shard_map: bucket ids by owner (static capacity T*E per peer),
                                 all_to_all ids, local take, all_to_all rows back, unbucket.
  * ``check_engram_lookup(table, ids, out)`` exact comparison with numpy ``table[ids]``.

MoE dispatch / combine (inside shard_map over "ep"; per rank x [N, H], topk_idx [N, K] int32,
topk_weights [N, K] f32, E experts, El = E/R local experts per rank; global arrays are the per-rank
ones stacked along axis 0):
  * ``make_ragged_a2a_dispatch_combine``: MaxText style. Expand by top-k (``jnp.repeat``) + sort
    by expert (``argsort``), per-expert counts, one ``all_gather`` of the counts ([R, E]; MaxText
    does two), offsets, ``jax.lax.ragged_all_to_all`` into a worst-case receive buffer of
    ``R*N*min(K, El)`` rows, then a local (stable) permute to expert-major order. Combine is the
    reverse: inverse local permute, ragged_all_to_all back, inverse sort, top-k weighted sum (f32).
  * ``make_a2a_capacity_dispatch_combine``: GShard style. Per-expert capacity
    ``C = ceil(1.25 * N*K / E)`` (overflowing (token, k) pairs are dropped, first come first
    served in (token, k) order), bucket ``[E, C, H]``, ``jax.lax.all_to_all``; combine gathers the
    kept rows back and takes the weighted sum.

  * ``make_dedup_dispatch_combine``: each token sent ONCE per destination rank holding one of its experts
    (deduplicated, dropless: all_to_all with per-rank capacity N, or ``impl="all_gather"``), with its routing
    row; ``expand=True`` adds the local permute to expert-major rows. Bit-exact with our ops' contract.

``make_loops`` builds the timing loops of any of them with our ops' loop structure (one shard_map'ed
``fori_loop``, local chaining, outputs carried: no partitioner-made all-reduce), ``pack_rows`` the FP8
rows (x's bytes then the scales'), ``hlo_collectives`` counts the collectives in a compiled program.

All builders return a ``MoEBaseline`` with jitted ``dispatch(x, topk_idx) -> (recv_x, group_sizes,
handle)`` and ``combine(y, handle, topk_weights) -> out [R*N, H]``, the inputs, and ``check()``,
which verifies dispatch against numpy (bit-exact) and combine with an expert-dependent fake expert
(and poisoned unused rows) against a float64 numpy reference.

Seen with this code on 2xH200 (jax 0.11.2, per call with ``time_fn``, medians): Engram T=512,
E=24, hidden 128 bf16, 524288 rows/rank: gspmd_take 266 us, a2a_lookup 299 us. MoE hidden 7168
bf16, top-8, 256 experts: N=4096 ragged dispatch 91.8 ms / combine 92.2 ms, capacity-1.25
dispatch 3.7 ms / combine 1.5 ms; N=128 ragged 3.1 / 3.4 ms, capacity 0.41 / 0.35 ms. The native
ragged path's check() passed there (bit-exact dispatch, combine rel. err 1.7e-3).

``jax.lax.ragged_all_to_all`` is not implemented on XLA:CPU. ``ragged_all_to_all_supported(mesh)``
detects that; the ragged builder then returns ``supported=False`` with the reason (benchmarks print
n/a). ``impl="emulated"`` swaps in an all_to_all-based emulation so the surrounding sort / offset /
permute logic can be tested on CPU; it is NOT a baseline and must not be timed as one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = [
    "make_engram_inputs", "gspmd_take", "a2a_lookup", "make_gspmd_take", "make_a2a_lookup",
    "check_engram_lookup", "engram_traffic",
    "make_moe_inputs", "MoEBaseline", "make_ragged_a2a_dispatch_combine", "make_a2a_capacity_dispatch_combine",
    "ragged_all_to_all_supported", "ep_traffic", "moe_capacity",
]

AXIS = "ep"


def _R(mesh) -> int:
    return int(mesh.shape[AXIS])


def _excl_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _mesh_key(mesh):
    return (tuple(d.id for d in mesh.devices.flat), tuple(mesh.axis_names))


# =============================================================================================
# Engram lookup
# =============================================================================================
def make_engram_inputs(mesh, rows_per_rank: int, hidden: int, tokens: int, ids_per_token: int,
                       dtype=jnp.bfloat16, seed: int = 0, ids_replicated: bool = False):
    """Random table ``[R*rows_per_rank, hidden]`` (row-sharded over "ep") and ids ``[R*tokens, E]``
    int32 uniform in ``[0, R*rows_per_rank)`` (sharded over "ep": rank r's tokens are rows
    r*T..(r+1)*T; ``ids_replicated=True`` gives a replicated copy instead, for ``gspmd_take`` only).
    Generated on the devices. Returns ``(table, ids)``."""
    kt, ki = jax.random.split(jax.random.key(seed))
    return _engram_input_gen(mesh, rows_per_rank, hidden, tokens, ids_per_token, np.dtype(dtype),
                             bool(ids_replicated))(kt, ki)


@functools.lru_cache(maxsize=None)
def _engram_input_gen(mesh, rows_per_rank, hidden, tokens, ids_per_token, dtype, ids_replicated):
    R = _R(mesh)
    ids_spec = P(None, None) if ids_replicated else P(AXIS, None)

    def gen(kt, ki):
        table = jax.random.normal(kt, (R * rows_per_rank, hidden), jnp.float32).astype(dtype)
        ids = jax.random.randint(ki, (R * tokens, ids_per_token), 0, R * rows_per_rank, jnp.int32)
        return table, ids

    return jax.jit(gen, out_shardings=(NamedSharding(mesh, P(AXIS, None)), NamedSharding(mesh, ids_spec)))


def _take_rows(t, i):
    return jnp.take(t, i.reshape(-1), axis=0).reshape(i.shape[0], -1)


@functools.lru_cache(maxsize=None)
def _gspmd_take_cached(mesh, ids_spec):
    out_sh = NamedSharding(mesh, P(ids_spec[0] if len(ids_spec) else None, None))
    # The mesh axis is Explicit; the explicit-sharding rule for gather refuses a row-sharded operand,
    # so let GSPMD partition it (auto_axes), which is exactly what a user without an Explicit mesh gets.
    return jax.jit(jax.sharding.auto_axes(_take_rows, out_sharding=out_sh))


def make_gspmd_take(mesh, ids_sharded: bool = True) -> Callable:
    """Jitted ``(table, ids) -> table[ids].reshape(T, E*hidden)`` partitioned by GSPMD."""
    return _gspmd_take_cached(mesh, P(AXIS, None) if ids_sharded else P(None, None))


def gspmd_take(table, ids):
    """``jnp.take(table, ids.reshape(-1), axis=0)`` reshaped to ``[T, E*hidden]`` under jit on the
    row-sharded table; output is sharded like ``ids`` along axis 0 (replicated ids -> replicated)."""
    mesh = table.sharding.mesh
    spec = ids.sharding.spec if isinstance(ids.sharding, NamedSharding) else P()
    sharded = len(spec) > 0 and spec[0] is not None
    return make_gspmd_take(mesh, sharded)(table, ids)


@functools.lru_cache(maxsize=None)
def _a2a_lookup_cached(mesh):
    R = _R(mesh)

    def body(tab, ix):
        # tab [Nr, H] local rows; ix [T, E] global ids of this rank's tokens
        nr, h = tab.shape
        flat = ix.reshape(-1)
        cap = flat.shape[0]                                  # static capacity T*E per owner
        owner = flat // nr
        order = jnp.argsort(owner, stable=True)
        s_owner = owner[order]
        counts = jnp.bincount(owner, length=R)
        starts = _excl_cumsum(counts)
        pos = jnp.arange(cap, dtype=jnp.int32) - starts[s_owner]
        send = jnp.full((R, cap), -1, jnp.int32).at[s_owner, pos].set(flat[order], unique_indices=True)
        recv = lax.all_to_all(send, AXIS, 0, 0, tiled=False)            # [R(src), cap] ids I own
        local = jnp.where(recv >= 0, recv - lax.axis_index(AXIS) * nr, 0)
        rows = jnp.take(tab, local.reshape(-1), axis=0).reshape(R, cap, h)
        back = lax.all_to_all(rows, AXIS, 0, 0, tiled=False)            # [R(owner), cap, H]
        got = back[s_owner, pos]                                         # rows in sorted order
        out = jnp.zeros((cap, h), tab.dtype).at[order].set(got, unique_indices=True)
        return out.reshape(ix.shape[0], -1)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS, None), P(AXIS, None)),
                                 out_specs=P(AXIS, None)))


def make_a2a_lookup(mesh) -> Callable:
    """Jitted all_to_all-based lookup ``(table, ids) -> [R*T, E*hidden]`` (ids sharded over "ep")."""
    return _a2a_lookup_cached(mesh)


def a2a_lookup(table, ids):
    """TorchRec-style lookup (bucket ids by owner, all_to_all, local take, all_to_all back)."""
    mesh = table.sharding.mesh
    spec = ids.sharding.spec if isinstance(ids.sharding, NamedSharding) else P()
    if not (len(spec) > 0 and spec[0] == AXIS):
        ids = jax.device_put(ids, NamedSharding(mesh, P(AXIS, None)))
    return make_a2a_lookup(mesh)(table, ids)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def check_engram_lookup(table, ids, out) -> dict:
    """Bit-exact comparison of ``out`` with numpy ``table[ids].reshape(len(ids), -1)``."""
    t = np.asarray(table)
    i = np.asarray(ids)
    o = np.asarray(out)
    ref = t[i.reshape(-1)].reshape(i.shape[0], -1)
    shape_ok = ref.shape == o.shape
    bad = int(np.sum(_bits(ref) != _bits(o))) if shape_ok else -1
    return dict(ok=bool(shape_ok and bad == 0), shape=list(o.shape), ref_shape=list(ref.shape), mismatches=bad)


def engram_traffic(tokens: int, ids_per_token: int, hidden: int, dtype=jnp.bfloat16, ranks: int = 1) -> dict:
    """Per-rank rows/bytes of one lookup (for MPPS and GB/s). With uniform ids a fraction (R-1)/R
    of the rows is remote."""
    rows = tokens * ids_per_token
    rb = hidden * np.dtype(dtype).itemsize
    return dict(rows=rows, row_bytes=rb, bytes=rows * rb, remote_bytes=rows * rb * (ranks - 1) / max(ranks, 1))


# =============================================================================================
# MoE dispatch / combine
# =============================================================================================
def make_moe_inputs(mesh, N: int, H: int, K: int, E: int, dtype=jnp.bfloat16, seed: int = 0):
    """Per rank x [N, H] (normal), topk_idx [N, K] int32 (top-k of random scores: K distinct
    experts, uniform routing), topk_weights [N, K] f32 (softmax of the top-k scores). Global
    arrays ``[R*N, ...]`` sharded over "ep", generated on the devices."""
    R = _R(mesh)
    if E % R:
        raise ValueError(f"E={E} experts not divisible by R={R} ranks")
    if K > E:
        raise ValueError(f"K={K} > E={E}")
    kx, ks = jax.random.split(jax.random.key(seed))
    return _moe_input_gen(mesh, N, H, K, E, np.dtype(dtype))(kx, ks)


@functools.lru_cache(maxsize=None)
def _moe_input_gen(mesh, N, H, K, E, dtype):
    R = _R(mesh)
    sh = NamedSharding(mesh, P(AXIS, None))

    def gen(kx, ks):
        x = jax.random.normal(kx, (R * N, H), jnp.float32).astype(dtype)
        vals, idx = lax.top_k(jax.random.normal(ks, (R * N, E), jnp.float32), K)
        return x, idx.astype(jnp.int32), jax.nn.softmax(vals, axis=-1)

    return jax.jit(gen, out_shardings=(sh, sh, sh))


def moe_capacity(N: int, K: int, E: int, factor: float = 1.25) -> int:
    """GShard per-expert capacity ceil(factor * N*K / E) (at least 1)."""
    return max(1, int(math.ceil(factor * N * K / E)))


def ep_traffic(topk_idx, ranks: int, experts: int, row_bytes: int) -> dict:
    """Per-rank average traffic of one dispatch for the given routing (host numpy).

    ``logical_bytes``: DeepEP V2 convention, rows deduplicated per destination rank, local rank
    included; ``physical_bytes``: same without the local rank (what crosses NVLink for a dedup
    implementation); ``expanded_bytes`` / ``expanded_remote_bytes``: one row per (token, k), what
    the two JAX baselines actually send (no dedup)."""
    t = np.asarray(topk_idx)
    R = ranks
    N = t.shape[0] // R
    t = t.reshape(R, N, -1)
    El = experts // R
    dest = t // El                                              # [R, N, K]
    onehot = np.zeros((R, N, R), bool)
    np.put_along_axis(onehot, dest, True, axis=2)
    dedup = onehot.sum()
    local = sum(onehot[r, :, r].sum() for r in range(R))
    exp_total = dest.size
    exp_local = sum((dest[r] == r).sum() for r in range(R))
    f = row_bytes / R
    return dict(logical_bytes=float(dedup * f), physical_bytes=float((dedup - local) * f),
                expanded_bytes=float(exp_total * f), expanded_remote_bytes=float((exp_total - exp_local) * f),
                row_bytes=row_bytes, tokens_per_rank=N)


@dataclasses.dataclass
class MoEBaseline:
    """A dispatch/combine pair and its inputs.

    ``dispatch(x, topk_idx) -> (recv_x, group_sizes, handle)``; ``combine(y, handle, topk_weights)
    -> out [R*N, H]`` where ``y`` has ``recv_x``'s shape/layout (the experts' outputs). Both jitted.
    ``inputs = (x, topk_idx, topk_weights)``. If ``supported`` is False, dispatch/combine are None and
    ``reason`` says why (print n/a)."""
    name: str
    supported: bool
    reason: str | None
    dispatch: Callable | None
    combine: Callable | None
    inputs: tuple
    meta: dict
    layout: str
    _check: Callable | None = None
    make_inputs: Callable | None = None
    local: tuple | None = None  # (dispatch_body, combine_body): the per-rank functions, for use inside shard_map

    def check(self, fresh_seed: int | None = None) -> dict:
        """Verify dispatch (bit-exact vs numpy) and combine (fake expert, rel. error vs float64).
        ``fresh_seed`` draws new inputs for the check instead of reusing ``inputs``. Uses the
        current ``self.dispatch`` / ``self.combine`` (so a wrapped or replaced pair is checked).
        Host-side numpy over the whole global dispatch output (the ragged one is the worst-case
        buffer, R*N*min(K, El) rows per rank): run it at small N (e.g. 128 tokens), not at 4096."""
        if not self.supported:
            return dict(ok=None, reason=self.reason)
        inputs = self.inputs if fresh_seed is None else self.make_inputs(fresh_seed)
        return self._check(self.dispatch, self.combine, *inputs)


# ---------- ragged_all_to_all support detection & CPU emulation ----------
def _ragged_a2a_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """Same result as ``lax.ragged_all_to_all`` (one update per peer) built from all_to_all.
    Testing aid only: pads every peer slice to the operand length."""
    m = operand.shape[0]
    rest = operand.shape[1:]
    ar = jnp.arange(m, dtype=jnp.int32)
    src_idx = jnp.clip(input_offsets[:, None] + ar[None, :], 0, m - 1)           # [R, m]
    valid = ar[None, :] < send_sizes[:, None]
    vmask = valid.reshape(valid.shape + (1,) * len(rest))
    send = jnp.where(vmask, operand[src_idx], jnp.zeros((), operand.dtype))      # [R, m, ...]
    recv = lax.all_to_all(send, axis_name, 0, 0, tiled=False)                     # [R(src), m, ...]
    offs = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)            # offs[s]: where s's slice lands here
    dst = offs[:, None] + ar[None, :]
    dst = jnp.where(ar[None, :] < recv_sizes[:, None], dst, output.shape[0])       # out of range -> dropped
    return output.at[dst.reshape(-1)].set(recv.reshape((-1,) + rest), mode="drop")


_RAGGED_SUPPORT: dict = {}


def ragged_all_to_all_supported(mesh) -> tuple[bool, str | None]:
    """Compile and run a tiny ``jax.lax.ragged_all_to_all`` on ``mesh`` and check its result.
    Returns ``(True, None)`` or ``(False, reason)``. Cached per mesh."""
    key = _mesh_key(mesh)
    if key in _RAGGED_SUPPORT:
        return _RAGGED_SUPPORT[key]
    R = _R(mesh)

    def body(x):
        # rank r sends 1 row (its row j) to every rank j; receiver stores sender s's row at row s
        n = x.shape[0]
        me = lax.axis_index(AXIS)
        ones = jnp.ones((R,), jnp.int32)
        return lax.ragged_all_to_all(x, jnp.zeros_like(x), jnp.arange(R, dtype=jnp.int32), ones,
                                     jnp.full((R,), me, jnp.int32), ones, axis_name=AXIS)

    try:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS, None), out_specs=P(AXIS, None)))
        xs = np.arange(R * R * 2, dtype=np.float32).reshape(R * R, 2)
        y = np.asarray(f(jax.device_put(xs, NamedSharding(mesh, P(AXIS, None))))).reshape(R, R, 2)
        ref = xs.reshape(R, R, 2).transpose(1, 0, 2)
        res = (True, None) if np.array_equal(y, ref) else (False, "ragged_all_to_all gave a wrong result on this backend")
    except Exception as e:
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        res = (False, f"ragged_all_to_all unsupported on this backend ({jax.default_backend()}): {msg}")
    _RAGGED_SUPPORT[key] = res
    return res


# ---------- numpy references ----------
def _np_inputs(x, topk, w, R):
    xn = np.asarray(x)
    tn = np.asarray(topk)
    wn = np.asarray(w).astype(np.float64)
    N = xn.shape[0] // R
    return xn.reshape(R, N, -1), tn.reshape(R, N, -1), wn.reshape(R, N, -1), N


def _fake_scale(E):
    # distinct per expert, exactly representable in bf16 steps used below
    return 0.5 + (np.arange(E, dtype=np.float64) % 16) / 16.0


def _apply_scale(rows: np.ndarray, scale: float | np.ndarray, dtype) -> np.ndarray:
    return (rows.astype(np.float64) * scale).astype(dtype)


def _combine_reference(xn, tn, wn, kept, E, dtype):
    """out[r, n] = sum_k kept * w * bf16(x[r, n] * scale[e])  (float64)."""
    scale = _fake_scale(E)
    R, N, K = tn.shape
    out = np.zeros(xn.shape, np.float64)
    for k in range(K):
        y = _apply_scale(xn, scale[tn[:, :, k]][..., None], dtype).astype(np.float64)
        out += np.where(kept[:, :, k, None], wn[:, :, k, None] * y, 0.0)
    return out


def _rel_err(out, ref):
    o = np.asarray(out).astype(np.float64)
    denom = np.linalg.norm(ref)
    if not np.all(np.isfinite(o)):
        return float("inf")
    return float(np.linalg.norm(o - ref) / (denom if denom else 1.0))


_COMBINE_TOL = 1e-2  # bf16 output: expect ~2e-3


# ---------- MaxText-style ragged_all_to_all ----------
def make_ragged_a2a_dispatch_combine(mesh, N: int, H: int, K: int, E: int, dtype=jnp.bfloat16, *,
                                     seed: int = 0, impl: str = "auto", buffer_rows: int | None = None,
                                     make_inputs: bool = True) -> MoEBaseline:
    """MaxText-style dropless dispatch/combine through ``jax.lax.ragged_all_to_all``.

    Per rank: ``dispatch(x [N,H], topk_idx [N,K])`` returns ``recv_x [B, H]`` in expert-major order
    (local expert, then source rank, then token, then k; rows past ``sum(group_sizes)`` are zero),
    ``group_sizes [El]`` int32, and ``handle = (order [N*K], local_perm [B], all_sizes [R, R])``.
    ``B = buffer_rows`` or the worst case ``R*N*min(K, El)`` (= MaxText's balanced*min(EP, E/K)).
    ``combine(y [B,H], handle, topk_weights [N,K]) -> [N, H]``: sum_k w * y[row of (n, k)] in f32,
    cast to ``dtype``. Global shapes stack the per-rank ones along axis 0.

    ``impl``: "auto" (native if ``ragged_all_to_all_supported``; else ``supported=False``),
    "native" (no probe), "emulated" (all_to_all stand-in; testing only, never a baseline).
    """
    R = _R(mesh)
    if E % R:
        raise ValueError(f"E={E} not divisible by R={R}")
    El = E // R
    M = N * K
    B = int(buffer_rows) if buffer_rows else R * N * min(K, El)
    name = "ragged_all_to_all (MaxText-style sort)"
    meta = dict(R=R, N=N, H=H, K=K, E=E, El=El, buffer_rows=B, dtype=np.dtype(dtype).name, impl=impl)
    mk = lambda s: make_moe_inputs(mesh, N, H, K, E, dtype, s)  # noqa: E731
    inputs = mk(seed) if make_inputs else ()
    if impl == "auto":
        ok, reason = ragged_all_to_all_supported(mesh)
        if not ok:
            return MoEBaseline(name, False, reason, None, None, inputs, meta, "expert-major", None, mk)
        ra2a = lax.ragged_all_to_all
        meta["impl"] = "native"
    elif impl == "native":
        ra2a = lax.ragged_all_to_all
    elif impl == "emulated":
        ra2a = _ragged_a2a_emulated
        name += " [EMULATED with all_to_all: test only]"
    else:
        raise ValueError(f"impl={impl!r}")

    def dispatch_body(xl, tk):
        me = lax.axis_index(AXIS)
        flat_e = tk.reshape(-1)
        order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)   # expert-major, (n, k) order within
        rows = jnp.repeat(xl, K, axis=0)[order]                       # expand by top-k, then sort
        counts = jnp.bincount(flat_e, length=E).astype(jnp.int32)    # per expert, this rank
        all_counts = lax.all_gather(counts, AXIS)                     # [R(src), E]
        all_sizes = all_counts.reshape(R, R, El).sum(-1)              # [R(src), R(dst)]
        send_sizes = all_sizes[me]
        input_offsets = _excl_cumsum(send_sizes)
        recv_sizes = all_sizes[:, me]
        output_offsets = _excl_cumsum(all_sizes, axis=0)[me]           # where my block lands on each dst
        buf = jnp.zeros((B, xl.shape[1]), xl.dtype)
        recv = ra2a(rows, buf, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=AXIS)
        # local permute: received rows are (src, local expert)-major -> (local expert, src)-major
        my_counts = lax.dynamic_slice_in_dim(all_counts, me * El, El, axis=1)      # [R(src), El]
        seg_end = jnp.cumsum(my_counts.reshape(-1))
        seg = jnp.searchsorted(seg_end, jnp.arange(B, dtype=jnp.int32), side="right")
        le = jnp.where(seg < R * El, seg % El, El)                     # tail rows -> El (sorted last)
        perm = jnp.argsort(le, stable=True).astype(jnp.int32)
        return recv[perm], my_counts.sum(0).astype(jnp.int32), (order, perm, all_sizes.astype(jnp.int32))

    def combine_body(y, order, perm, all_sizes, w):
        me = lax.axis_index(AXIS)
        h = y.shape[1]
        y_src = jnp.zeros_like(y).at[perm].set(y, unique_indices=True)       # undo local permute
        recv_sizes = all_sizes[:, me]                                         # rows I hold from each src
        in_off = _excl_cumsum(recv_sizes)
        out_off = _excl_cumsum(all_sizes, axis=1)[:, me]                      # where src put its rows for me
        back = ra2a(y_src, jnp.zeros((M, h), y.dtype), in_off, recv_sizes, out_off, all_sizes[me],
                    axis_name=AXIS)                                           # [M, H] in sorted order
        unsorted = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
        out = jnp.einsum("nkh,nk->nh", unsorted.reshape(-1, K, h).astype(jnp.float32), w.astype(jnp.float32))
        return out.astype(y.dtype)

    spec = P(AXIS)
    dispatch = jax.jit(jax.shard_map(dispatch_body, mesh=mesh, in_specs=(spec, spec),
                                     out_specs=(spec, spec, (spec, spec, spec))))
    _combine = jax.jit(jax.shard_map(combine_body, mesh=mesh, in_specs=(spec, spec, spec, spec, spec),
                                     out_specs=spec))
    combine = jax.jit(lambda y, handle, w: _combine(y, handle[0], handle[1], handle[2], w))

    def check(dispatch, combine, x, topk, w):
        xn, tn, wn, n = _np_inputs(x, topk, w, R)
        recv, gs, handle = dispatch(x, topk)
        recv_n = np.asarray(recv).reshape(R, B, H)
        gs_n = np.asarray(gs).reshape(R, El)
        disp_bad = 0
        gs_ok = True
        for r in range(R):
            exp_rows, exp_gs = [], []
            for le in range(El):
                g = r * El + le
                cnt = 0
                for s in range(R):
                    idx = np.nonzero(tn[s].reshape(-1) == g)[0]
                    exp_rows.append(xn[s][idx // K])
                    cnt += idx.size
                exp_gs.append(cnt)
            exp = np.concatenate(exp_rows, 0) if exp_rows else np.zeros((0, H), xn.dtype)
            if exp.shape[0] > B:
                return dict(ok=False, reason=f"rank {r} receives {exp.shape[0]} rows > buffer {B}")
            full = np.zeros((B, H), xn.dtype)
            full[:exp.shape[0]] = exp
            disp_bad += int(np.sum(_bits(full) != _bits(recv_n[r])))
            gs_ok &= bool(np.array_equal(gs_n[r], np.array(exp_gs)))
        # fake expert: y = bf16(x * scale[global expert]); rows past the valid count are poisoned
        scale = _fake_scale(E)
        y = np.full((R, B, H), np.nan, dtype=xn.dtype)
        for r in range(R):
            ge = r * El + np.repeat(np.arange(El), gs_n[r])
            nv = ge.size
            y[r, :nv] = _apply_scale(recv_n[r, :nv], scale[ge][:, None], xn.dtype)
        y_dev = jax.device_put(y.reshape(R * B, H), recv.sharding)
        out = combine(y_dev, handle, w)
        ref = _combine_reference(xn, tn, wn, np.ones(tn.shape, bool), E, xn.dtype)
        err = _rel_err(np.asarray(out).reshape(ref.shape), ref)
        return dict(ok=bool(disp_bad == 0 and gs_ok and err < _COMBINE_TOL), dispatch_mismatches=disp_bad,
                    group_sizes_ok=gs_ok, combine_rel_err=err, dropped=0)

    meta["recv_shape_per_rank"] = [B, H]
    return MoEBaseline(name, True, None, dispatch, combine, inputs, meta, "expert-major", check, mk,
                       local=(dispatch_body, lambda y, h, w: combine_body(y, *h, w)))


# ---------- GShard-style all_to_all with capacity factor ----------
def make_a2a_capacity_dispatch_combine(mesh, N: int, H: int, K: int, E: int, dtype=jnp.bfloat16, *,
                                       seed: int = 0, capacity_factor: float = 1.25,
                                       make_inputs: bool = True) -> MoEBaseline:
    """GShard-style dispatch/combine with a fixed per-expert capacity and ``jax.lax.all_to_all``.

    ``C = ceil(capacity_factor * N*K / E)``. Per rank: ``dispatch(x, topk_idx)`` returns
    ``recv_x [R(src), El, C, H]`` (slot c of (src, expert) holds the c-th (token, k) of src routed
    to that expert; empty slots are zero; overflow dropped), ``group_sizes [El]`` (rows actually
    received per local expert, after drops) and ``handle = (expert_or_E [N*K], slot [N*K])``.
    ``combine(y [R, El, C, H], handle, topk_weights) -> [N, H]`` (dropped pairs contribute 0).
    Global recv shape: ``[R*R, El, C, H]``.
    """
    R = _R(mesh)
    if E % R:
        raise ValueError(f"E={E} not divisible by R={R}")
    El = E // R
    M = N * K
    Cap = moe_capacity(N, K, E, capacity_factor)
    name = f"all_to_all capacity {capacity_factor:g} (GShard-style, drops)"
    meta = dict(R=R, N=N, H=H, K=K, E=E, El=El, capacity=Cap, capacity_factor=capacity_factor,
                dtype=np.dtype(dtype).name, recv_shape_per_rank=[R, El, Cap, H])
    mk = lambda s: make_moe_inputs(mesh, N, H, K, E, dtype, s)  # noqa: E731
    inputs = mk(seed) if make_inputs else ()

    def dispatch_body(xl, tk):
        h = xl.shape[1]
        flat_e = tk.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)
        counts = jnp.bincount(flat_e, length=E).astype(jnp.int32)
        starts = _excl_cumsum(counts)
        pos_sorted = jnp.arange(M, dtype=jnp.int32) - starts[flat_e[order]]
        pos = jnp.zeros((M,), jnp.int32).at[order].set(pos_sorted, unique_indices=True)
        keep = pos < Cap
        e_idx = jnp.where(keep, flat_e, E).astype(jnp.int32)             # E = dropped
        slot = jnp.where(keep, pos, 0).astype(jnp.int32)
        rows = jnp.repeat(xl, K, axis=0)
        buf = jnp.zeros((E, Cap, h), xl.dtype).at[e_idx, slot].set(rows, mode="drop")
        recv = lax.all_to_all(buf.reshape(R, El, Cap, h), AXIS, 0, 0, tiled=False)   # [R(src), El, C, H]
        kept_counts = jnp.minimum(counts, Cap)
        all_kept = lax.all_gather(kept_counts, AXIS)                       # for group_sizes only
        me = lax.axis_index(AXIS)
        gs = lax.dynamic_slice_in_dim(all_kept, me * El, El, axis=1).sum(0).astype(jnp.int32)
        return recv, gs, (e_idx, slot)

    def combine_body(y, e_idx, slot, w):
        h = y.shape[-1]
        back = lax.all_to_all(y, AXIS, 0, 0, tiled=False).reshape(E, Cap, h)   # [E(owner-major), C, H]
        keep = e_idx < E
        rows = back[jnp.minimum(e_idx, E - 1), slot]                          # [M, H]
        rows = jnp.where(keep[:, None], rows.astype(jnp.float32), 0.0)       # where, not *0: NaN-safe
        out = jnp.einsum("nkh,nk->nh", rows.reshape(-1, K, h), w.astype(jnp.float32))
        return out.astype(y.dtype)

    spec = P(AXIS)
    dispatch = jax.jit(jax.shard_map(dispatch_body, mesh=mesh, in_specs=(spec, spec),
                                     out_specs=(spec, spec, (spec, spec))))
    _combine = jax.jit(jax.shard_map(combine_body, mesh=mesh, in_specs=(spec, spec, spec, spec),
                                     out_specs=spec))
    combine = jax.jit(lambda y, handle, w: _combine(y, handle[0], handle[1], w))

    def check(dispatch, combine, x, topk, w):
        xn, tn, wn, n = _np_inputs(x, topk, w, R)
        recv, gs, handle = dispatch(x, topk)
        recv_n = np.asarray(recv).reshape(R, R, El, Cap, H)
        gs_n = np.asarray(gs).reshape(R, El)
        kept = np.zeros(tn.shape, bool)                                       # [R, N, K]
        exp = np.zeros_like(recv_n)
        exp_gs = np.zeros((R, El), np.int64)
        for s in range(R):
            flat = tn[s].reshape(-1)
            kflat = kept[s].reshape(-1)
            for g in range(E):
                idx = np.nonzero(flat == g)[0][:Cap]
                kflat[idx] = True
                exp[g // El, s, g % El, :idx.size] = xn[s][idx // K]
                exp_gs[g // El, g % El] += idx.size
            kept[s] = kflat.reshape(N, K)
        disp_bad = int(np.sum(_bits(exp) != _bits(recv_n)))
        gs_ok = bool(np.array_equal(gs_n, exp_gs))
        # fake expert; empty slots poisoned with NaN (must never reach the output)
        scale = _fake_scale(E)
        ge = (np.arange(R)[:, None, None] * El + np.arange(El)[None, None, :])     # [R(recv), 1, El]
        y = _apply_scale(recv_n, scale[ge][:, :, :, None, None], xn.dtype)
        filled = np.zeros((R, R, El, Cap), bool)
        for r in range(R):
            for s in range(R):
                for le in range(El):
                    c = int(np.sum(tn[s] == r * El + le))
                    filled[r, s, le, :min(c, Cap)] = True
        y = np.where(filled[..., None], y, np.array(np.nan, dtype=xn.dtype))
        out = combine(jax.device_put(y.reshape(R * R, El, Cap, H), recv.sharding), handle, w)
        ref = _combine_reference(xn, tn, wn, kept, E, xn.dtype)
        err = _rel_err(np.asarray(out).reshape(ref.shape), ref)
        return dict(ok=bool(disp_bad == 0 and gs_ok and err < _COMBINE_TOL), dispatch_mismatches=disp_bad,
                    group_sizes_ok=gs_ok, combine_rel_err=err, dropped=int((~kept).sum()),
                    dropped_fraction=float((~kept).mean()))

    return MoEBaseline(name, True, None, dispatch, combine, inputs, meta, "[src, local expert, slot]", check, mk,
                       local=(dispatch_body, lambda y, h, w: combine_body(y, *h, w)))


# ---------- deduplicated: each token sent once per destination rank ----------
def _pack_meta(tk, w, sf=None):
    """[N, 2K (+P)] int32: topk ids, the weights' and the scales' bits (one small collective for the routing)."""
    parts = [tk.astype(jnp.int32), lax.bitcast_convert_type(w.astype(jnp.float32), jnp.int32)]
    if sf is not None and sf.shape[-1]:
        parts.append(lax.bitcast_convert_type(sf.astype(jnp.float32), jnp.int32))
    return jnp.concatenate(parts, axis=-1)


def make_dedup_dispatch_combine(mesh, N: int, H: int, K: int, E: int, dtype=jnp.bfloat16, *, seed: int = 0,
                                expand: bool = False, impl: str = "all_to_all",
                                make_inputs: bool = True) -> MoEBaseline:
    """The strongest simple JAX alternative: every token sent ONCE per destination rank that holds one of its
    experts (deduplicated, dropless), with its routing (top-k ids and weights) beside it -- what our non-expand
    dispatch moves.

    ``impl="all_to_all"``: per destination rank the tokens routed there, compacted into a send buffer of capacity
    N (every token can go everywhere, so nothing drops), one ``all_to_all`` of the rows and one of the routing
    ([N, 2K] int32). ``impl="all_gather"`` (non-expand only): every rank gathers every rank's x and routing, and
    combine is one ``psum_scatter``; at 2 ranks with top-8 of 256 experts (99.6 % of the tokens go to the other
    rank) it moves about the same bytes.

    Per rank: ``dispatch(x [N, H], topk_idx [N, K]) -> (recv_x, group_sizes [El], handle)``; non-expand:
    ``recv_x [R(src) * N, H]`` (all_gather: every source row; all_to_all: slot order, unused slots zero);
    ``expand=True`` adds a local permute to expert-major rows ``[B, H]``, ``B = R*N*min(K, El)`` (local expert,
    then source rank, slot, k; rows past the count are zero), as ragged_all_to_all's layout.
    ``combine(y, handle, topk_weights) -> [N, H]``: ``y`` has recv_x's shape (bf16 expert outputs; rows of x's
    dtype at dispatch may be any dtype, e.g. fp8 packed with its scales as uint8). Non-expand: out = bf16(sum over
    destination ranks d of f32(y_d)); expand: the expert side first sums its rows of a token in f32 and rounds to
    bf16 (one row per token and rank goes back), then the same. The weights stay with the caller, as in our
    combine; ``topk_weights`` is accepted for the common signature and ignored. With ``y = recv_x`` (an identity
    expert) the result equals our ops' contract bit for bit: bf16(sum_d f32(bf16(f32(x) * c_d))), c_d = the
    token's experts on d (expand) or 1.
    """
    R = _R(mesh)
    if E % R:
        raise ValueError(f"E={E} not divisible by R={R}")
    if impl not in ("all_to_all", "all_gather"):
        raise ValueError(f"impl={impl!r}")
    if impl == "all_gather" and expand:
        raise ValueError("the all_gather variant is non-expand only")
    El = E // R
    B = R * N * min(K, El)
    name = ("dedup all_gather (each token to every rank once)" if impl == "all_gather" else
            "dedup all_to_all (each token once per dest rank, capacity N)") + (" + local expand" if expand else "")
    meta = dict(R=R, N=N, H=H, K=K, E=E, El=El, impl=impl, expand=expand, dtype=np.dtype(dtype).name,
                recv_shape_per_rank=[B, H] if expand else [R * N, H])
    mk = lambda s: make_moe_inputs(mesh, N, H, K, E, dtype, s)  # noqa: E731
    inputs = mk(seed) if make_inputs else ()

    def _local_expand(rows, rtk):
        # rows [R*N, h] received (zeros where unused), rtk [R*N, K] global expert ids (-1 unused)
        me = lax.axis_index(AXIS)
        le = jnp.where((rtk >= 0) & (rtk // El == me), rtk - me * El, El).reshape(-1)          # [R*N*K]
        order = jnp.argsort(le, stable=True).astype(jnp.int32)[:B]                            # expert-major
        valid = le[order] < El
        out = jnp.where(valid[:, None], rows[order // K], jnp.zeros((), rows.dtype))
        gs = jnp.bincount(le, length=El + 1)[:El].astype(jnp.int32)
        return out, gs, order, valid

    def dispatch_body(xl, tk, w):
        n = xl.shape[0]
        me = lax.axis_index(AXIS)
        dest = jnp.where(tk >= 0, tk // El, -1)
        hit = (dest[:, :, None] == jnp.arange(R, dtype=jnp.int32)[None, None, :]).any(axis=1)   # [N, R]
        meta_rows = _pack_meta(tk, w)
        if impl == "all_gather":
            rows = lax.all_gather(xl, AXIS, tiled=True)                                        # [R*N, h]
            rmeta = lax.all_gather(meta_rows, AXIS, tiled=True)
            rtk = rmeta[:, :K]
            mine = (jnp.where(rtk >= 0, rtk // El, -1) == me).any(axis=1)
            gs = jnp.bincount(jnp.where((rtk >= 0) & (rtk // El == me), rtk - me * El, El).reshape(-1),
                              length=El + 1)[:El].astype(jnp.int32)
            return rows, gs, (hit, mine)
        # slot of token t on dest d = number of earlier tokens routed to d; unused slots point past the end
        slot = jnp.cumsum(hit, axis=0, dtype=jnp.int32) - 1                                     # [N, R]
        src = jnp.full((R, n), n, jnp.int32).at[jnp.arange(R)[None, :], jnp.where(hit, slot, n)].set(
            jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, R)), mode="drop")    # [R, N]
        used = src < n
        send = jnp.where(used[:, :, None], xl[jnp.minimum(src, n - 1)], jnp.zeros((), xl.dtype))
        smeta = jnp.where(used[:, :, None], meta_rows[jnp.minimum(src, n - 1)], -1)
        recv = lax.all_to_all(send, AXIS, 0, 0, tiled=False).reshape(R * n, -1)                # [R(src)*N, h]
        rmeta = lax.all_to_all(smeta, AXIS, 0, 0, tiled=False).reshape(R * n, -1)
        rtk = rmeta[:, :K]
        if expand:
            out, gs, order, valid = _local_expand(recv, rtk)
            return out, gs, (hit, slot, order, valid)
        gs = jnp.bincount(jnp.where((rtk >= 0) & (rtk // El == me), rtk - me * El, El).reshape(-1),
                          length=El + 1)[:El].astype(jnp.int32)
        return recv, gs, (hit, slot)

    def combine_body(y, handle, w=None):
        del w
        h = y.shape[-1]
        if impl == "all_gather":
            hit, mine = handle
            part = jnp.where(mine[:, None], y, jnp.zeros((), y.dtype))
            return lax.psum_scatter(part, AXIS, scatter_dimension=0, tiled=True)
        if expand:
            hit, slot, order, valid = handle
            # expert side: sum a token's rows (f32), one bf16 row per (source, slot) goes back
            seg = jnp.where(valid, order // K, R * N)
            per = jnp.zeros((R * N + 1, h), jnp.float32).at[seg].add(y.astype(jnp.float32))[:R * N]
            y = per.astype(y.dtype)
        else:
            hit, slot = handle
        back = lax.all_to_all(y.reshape(R, N, h), AXIS, 0, 0, tiled=False)                       # [R(dst), N, h]
        rows = back[jnp.arange(R)[None, :], jnp.where(hit, slot, 0)]                               # [N, R, h]
        acc = jnp.full((N, h), -0.0, jnp.float32)  # left fold from -0.0, as the contract's reference
        for d in range(R):
            acc = acc + jnp.where(hit[:, d, None], rows[:, d].astype(jnp.float32), -0.0)
        return jnp.where(hit.any(axis=1)[:, None], acc, 0.0).astype(y.dtype)

    # the common signature dispatch(x, topk) carries no weights; zeros stand for them (the same [N, 2K] int32
    # routing row moves)
    d_local = lambda x, tk: dispatch_body(x, tk, jnp.zeros_like(tk, jnp.float32))  # noqa: E731
    spec = P(AXIS)
    dispatch = jax.jit(jax.shard_map(d_local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec, spec)))
    _combine = jax.jit(jax.shard_map(lambda y, h: combine_body(y, h), mesh=mesh, in_specs=(spec, spec),
                                     out_specs=spec))
    combine = jax.jit(lambda y, handle, w: _combine(y, handle))

    def check(dispatch, combine, x, topk, w):
        xn, tn, _, n = _np_inputs(x, topk, w, R)
        recv, gs, handle = dispatch(x, topk)
        dest = np.where(tn >= 0, tn // El, -1)                                           # [R, N, K]
        cnt = (dest[..., None] == np.arange(R)).sum(axis=2)                             # [R(src), N, R(dst)]
        per = cnt if expand else np.minimum(cnt, 1)
        # dispatch: the rows each rank must hold, in the layout above
        recv_n = np.asarray(recv).reshape(R, -1, H)
        bad = 0
        for r in range(R):
            if impl == "all_gather":
                want = xn.reshape(R * n, H)
            else:
                slots = np.zeros((R, n, H), xn.dtype)
                for s in range(R):
                    toks = np.nonzero(cnt[s, :, r] > 0)[0]
                    slots[s, :toks.size] = xn[s][toks]
                want = slots.reshape(R * n, H)
                if expand:
                    rows = []
                    for le in range(El):
                        for s in range(R):
                            toks = np.nonzero(cnt[s, :, r] > 0)[0]
                            for j, t in enumerate(toks):
                                rows += [xn[s][t]] * int(np.sum(tn[s, t] == r * El + le))
                    want = np.zeros((B, H), xn.dtype)
                    if rows:
                        want[:len(rows)] = np.stack(rows)
            bad += int(np.sum(_bits(want) != _bits(recv_n[r])))
        # combine with an identity expert: the ops' contract, bit for bit
        y = recv.astype(jnp.bfloat16)
        out = np.asarray(combine(y, handle, w)).reshape(R, n, H)
        xf = xn.astype(jnp.bfloat16).astype(np.float32)
        parts = (xf[:, :, None, :] * per[..., None].astype(np.float32)).astype(jnp.bfloat16).astype(np.float32)
        acc = np.full(xf.shape, -0.0, np.float32)
        for d in range(R):
            acc = np.where(per[:, :, d, None] > 0, (acc + parts[:, :, d]).astype(np.float32), acc)
        want_c = np.where((per > 0).any(axis=2)[..., None], acc, 0.0).astype(jnp.bfloat16)
        bad_c = int(np.sum(_bits(want_c) != _bits(out)))
        return dict(ok=bool(bad == 0 and bad_c == 0), dispatch_mismatches=bad, combine_mismatches=bad_c, dropped=0)

    return MoEBaseline(name, True, None, dispatch, combine, inputs, meta,
                       "expert-major" if expand else "[src rank, slot]", check, mk,
                       local=(d_local,
                              lambda y, h, w: combine_body(y, h)))


# ---------- timing loops shaped like ours, and the collectives in them ----------
def pack_rows(x, x_scales=None):
    """The rows a baseline moves for our dispatch's x (and FP8 scales): x itself, or x's bytes followed by the
    scales' bytes as one uint8 row [N, H*itemsize + 4P] (the same bytes our dispatch moves per row)."""
    if x_scales is None or x_scales.shape[-1] == 0:
        return x
    xb = lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 else \
        lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)
    sb = lax.bitcast_convert_type(x_scales.astype(jnp.float32), jnp.uint8).reshape(x.shape[0], -1)
    return jnp.concatenate([xb, sb], axis=-1)


def combine_rows(recv, H: int, x_dtype):
    """bf16 expert outputs [..., H] standing for the rows a baseline received (packed rows: x's part)."""
    if recv.dtype == jnp.uint8:
        recv = lax.bitcast_convert_type(recv[..., :H], x_dtype)
    return recv.astype(jnp.bfloat16)


def make_loops(bl: MoEBaseline, mesh, n: int, H: int, x_dtype=jnp.bfloat16):
    """Jitted ``(dispatch_loop(x, tk, w), combine_loop(x, tk, w))`` of ``n`` calls each, structured as our ops'
    loops in bench_ep: ONE shard_map'ed program whose ``lax.fori_loop`` runs the per-rank bodies, each call's
    input made to depend on the previous call's output (one element, a local update: no collective), every
    output carried through the loop and returned (so XLA cannot drop any of a call's work), and nothing in the
    loop that the partitioner must add (no global-array indexing: no all-reduce). The combine loop runs one
    dispatch first (the handle), as ours does; ``time_per_call``'s slope cancels it."""
    d_body, c_body = bl.local
    spec = P(AXIS)

    def chain(a, out):  # a with element 0 replaced by out's first element: a data dependency, local
        return a.at[(0,) * a.ndim].set(out[(0,) * out.ndim].astype(a.dtype))

    def dispatch_loop(x, tk, w):
        outs = d_body(x, tk)

        def step(i, c):
            xx, _ = c
            o = d_body(xx, tk)
            return chain(xx, o[0]), o
        return lax.fori_loop(0, n, step, (x, outs))

    def combine_loop(x, tk, w):
        recv, _, handle = d_body(x, tk)
        y = combine_rows(recv, H, x_dtype)
        out = c_body(y, handle, w)

        def step(i, c):
            yy, _ = c
            o = c_body(yy, handle, w)
            return chain(yy, o), o
        return lax.fori_loop(0, n, step, (y, out))

    mk = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))  # noqa: E731
    return mk(dispatch_loop), mk(combine_loop)


_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "ragged-all-to-all", "collective-permute",
                "reduce-scatter", "collective-broadcast")


def hlo_collectives(fn, *args, compiler_options: dict | None = None) -> dict:
    """Collective ops in the compiled (partitioned, optimized) HLO of jitted ``fn(*args)``: {op name: count}
    (async pairs count once, by their -start)."""
    import re
    text = fn.lower(*args).compile(compiler_options or {}).as_text()
    out = {}
    for op in _COLLECTIVES:
        out[op] = len(re.findall(rf"= [^=\n]*(?<![\w-]){op}(?:-start)?\(", text))
    return out



def local_permute_dispatch(x, topk_idx, topk_weights, num_experts: int):
    """The plain-JAX MoE permute of one device (no communication), the one-rank baseline's dispatch: the
    flattened top-k ids sorted by expert (``argsort``, -1 last), x's rows gathered with ``take`` into [N*K, H]
    expert-major rows. Returns (rows, their source token [N*K], their weight [N*K], 0 for -1 ids)."""
    K = topk_idx.shape[1]
    flat = jnp.where(topk_idx >= 0, topk_idx, num_experts).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // K
    w = jnp.where(flat[order] < num_experts, topk_weights.reshape(-1)[order], 0.0)
    return jnp.take(x, tok, axis=0), tok, w


def local_permute_combine(rows, tok, w, num_tokens: int):
    """The one-rank baseline's combine: the weighted rows summed per source token (``segment_sum``, float32),
    cast back to the rows' dtype: [num_tokens, H]."""
    out = jax.ops.segment_sum(rows.astype(jnp.float32) * w[:, None], tok, num_segments=num_tokens)
    return out.astype(rows.dtype)
