"""Pure-JAX reference implementations of the jax_engram communication primitives.

Every native op of jax_engram (Engram sharded-table lookup, MoE expert-parallel
dispatch/combine in DeepEP V2 *direct* mode) is tested bit-exactly against the
functions in this module.  They are written from the behavioural contract in
``docs/semantics.md`` (Engram, MoE dispatch, MoE combine), not from any kernel.

Conventions
-----------
* **Global view.**  All functions take and return the data of all ``R`` ranks
  stacked on a leading axis: ``x[r]`` is what rank ``r`` holds.  Inside a
  ``shard_map`` the native op sees ``x[r]``; the reference sees the whole stack.
* **Static shapes** (the XLA analogue of DeepEP's ``do_cpu_sync=False``):
  dispatch outputs have the worst-case number of rows (``R*M`` token rows,
  ``expand_rows(R, M, K, E_loc, A)`` expanded rows); the real counts live in the
  ``num_*`` / ``psum_*`` outputs.
* **Canonical order** (= DeepEP deterministic mode):
  token rows on a destination rank are sorted by ``src_gid = src_rank*M + t``
  (i.e. grouped by source rank ascending, then source token ascending); each token
  appears once per destination rank that owns at least one of its experts.
  Expanded rows: per local expert ``e`` a segment at
  ``start[e] = sum_{j<e} align(count_j, A)`` holding its ``count_e`` (token, k)
  rows sorted by ``src_gid`` (a token can hit an expert at most once), followed
  by ``align(count_e, A) - count_e`` alignment-padding rows.
* **Rows past the real count.**  The reference sets them to 0 (data, scales,
  weights), -1 (``recv_topk_idx``, ``recv_src_metadata``).  The native ops leave
  them UNSPECIFIED, except the alignment-padding rows of an expand dispatch with
  ``zero_padding=True`` which must be zero (data, scales, weights).  Compare only
  rows where ``recv_row_defined`` (or ``recv_token_valid`` for token-row fields)
  is True.
* **Comparing a non-deterministic native op.**  ``recv_src_metadata`` rows are in
  canonical order in BOTH layouts (DeepEP's deterministic expand mode only
  re-sorts the expanded rows, not the metadata rows).  A native op whose slot
  order is arrival order must be compared after a stable sort of its token rows
  by ``recv_src_metadata[:, 0]`` (and of each expert segment's rows by src_gid),
  remapping ``recv_src_metadata[:, 2:]`` accordingly.
* **Signed zeros.**  Every fp32 sum in combine is a left fold over its terms
  (accumulator initialised to -0.0, the exact additive identity), so a single
  -0.0 term is returned as -0.0; a token with no term at all gives +0.0.
* **Masked routing.**  A negative ``topk_idx`` entry means "no expert": not
  counted, not sent, weight 0 in combine.  (DeepEP only documents -1; any negative
  value behaves the same there, and here.)  Ids ``>= num_experts`` raise in
  :func:`check_routing` when the routing is concrete; under tracing they are
  treated as masked.

All functions are pure ``jax.numpy``, jit-able (keyword arguments are static
Python values) and differentiable where the math is (gathers, fp32 sums).  Input
validation runs eagerly in Python; the computational bodies are ``jax.jit``-ed
per static configuration, so an eager call compiles one executable (inside an
outer ``jit`` / ``grad`` they are simply inlined).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import numpy as np

import jax
import jax.numpy as jnp

__all__ = [
    "MAX_TOPK",
    "ENGRAM_MODES",
    "SF_LAYOUTS",
    "align",
    "expand_rows",
    "master_positions",
    "check_routing",
    "per_rank",
    "engram_lookup",
    "ep_dispatch",
    "ep_combine",
]

#: Static limit on the number of top-k positions (as DeepEP V2).
MAX_TOPK = 32
#: Accepted Engram out-of-range handling modes.
ENGRAM_MODES = ("fill", "clip", "checked")
#: Accepted Engram scale-factor output layouts.
SF_LAYOUTS = ("row", "tma_col_major")

_SF_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))


# --------------------------------------------------------------------------- #
# Small utilities
# --------------------------------------------------------------------------- #
def _bf16_round(a):
    """Round f32 values to bf16 precision, staying f32.

    XLA may drop a convert(f32 -> bf16 -> f32) pair ("excess precision", on by default), which silently
    removes the roundings the combine contract prescribes whenever the caller computes in f32 inside the same
    jit (seen on XLA:GPU and XLA:CPU). reduce_precision is an explicit op XLA must keep.
    """
    return jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7)


def align(x, a):
    """Round ``x`` up to a multiple of ``a`` (Python ints or integer arrays)."""
    return (x + a - 1) // a * a


def expand_rows(R: int, M: int, K: int, E_loc: int, A: int) -> int:
    """Static (worst-case) number of rows of an expand-layout dispatch output (docs/semantics.md, "Expand layout").

    ``align(R*M*min(K, E_loc) + (A-1)*E_loc, A)``.
    """
    return int(align(R * M * min(K, E_loc) + (A - 1) * E_loc, A))


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _owner_local(topk_idx, num_experts: int, E_loc: int):
    """(valid, owner rank or -1, local expert id or -1) of each top-k entry."""
    idx = jnp.asarray(topk_idx).astype(jnp.int32)
    valid = (idx >= 0) & (idx < num_experts)
    owner = jnp.where(valid, idx // E_loc, -1)
    local = jnp.where(valid, idx % E_loc, -1)
    return valid, owner, local


def master_positions(topk_idx, num_experts: int, num_ranks: int):
    """Master top-k position of every (token, destination rank).

    ``topk_idx``: ``[..., K]`` global expert ids (negative = masked).
    Returns ``[..., num_ranks]`` int32: the HIGHEST position ``k`` whose expert
    lives on that rank (DeepEP ``ptx::deduplicate`` keeps the highest lane,
    docs/semantics.md), or -1 if the token has no expert on it.
    """
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})")
    E_loc = num_experts // num_ranks
    _, owner, _ = _owner_local(topk_idx, num_experts, E_loc)
    K = owner.shape[-1]
    hits = owner[..., :, None] == jnp.arange(num_ranks, dtype=jnp.int32)  # [..., K, R]
    kk = jnp.arange(K, dtype=jnp.int32)[:, None]
    return jnp.max(jnp.where(hits, kk, -1), axis=-2).astype(jnp.int32)


def check_routing(topk_idx, num_experts: int) -> None:
    """Eagerly validate a routing tensor ``[..., K]`` (no-op for tracers).

    Raises ``ValueError`` on K > 32, on ids ``>= num_experts``, and on duplicate
    expert ids within one token (illegal, as in DeepEP).  Negative ids are
    masked entries and are always legal.
    """
    shape = tuple(np.shape(topk_idx))
    if len(shape) < 1:
        raise ValueError("topk_idx must have at least one dimension (the top-k axis)")
    K = shape[-1]
    if K > MAX_TOPK:
        raise ValueError(f"top-k = {K} exceeds the DeepEP limit of {MAX_TOPK}")
    if _is_tracer(topk_idx):
        return
    idx = np.asarray(topk_idx)
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"topk_idx must be an integer array, got {idx.dtype}")
    idx = idx.reshape(-1, K).astype(np.int64)
    bad = idx >= num_experts
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise ValueError(
            f"topk_idx holds expert id {int(idx[bad].max())} >= num_experts ({num_experts}) "
            f"(first offending token row {row}: {idx[row].tolist()})")
    if K > 1:
        s = np.sort(np.where(idx >= 0, idx, -np.arange(1, K + 1)[None, :] - 1), axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if dup.any():
            row = int(np.argmax(dup))
            raise ValueError(
                f"duplicate expert ids within one token are illegal; "
                f"first offending token row {row}: {idx[row].tolist()}")


def per_rank(result: Dict[str, Any], r: int) -> Dict[str, Any]:
    """Slice every (stacked, leading-R) entry of a dispatch result to rank ``r``."""
    return {k: (None if v is None else v[r]) for k, v in result.items()}


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@jax.custom_vjp
def _take_float_rows(table, idx):
    u = jax.lax.bitcast_convert_type(table, _BITS[np.dtype(table.dtype).itemsize])
    n = u.shape[0]
    inside = (idx < n).reshape(idx.shape + (1,) * (u.ndim - 1))
    return jax.lax.bitcast_convert_type(jnp.where(inside, u[jnp.minimum(idx, n - 1)], 0), table.dtype)


def _take_float_rows_fwd(table, idx):
    return _take_float_rows(table, idx), (table, idx)


def _take_float_rows_bwd(res, ct):
    table, idx = res
    g = jnp.zeros((table.shape[0] + 1,) + table.shape[1:], ct.dtype).at[idx].add(ct)
    return g[:-1].astype(table.dtype), None


_take_float_rows.defvjp(_take_float_rows_fwd, _take_float_rows_bwd)


def _take(table, idx):
    """Rows ``idx`` of ``table`` (axis 0), where ``idx == len(table)`` selects a zero row, moving bits. XLA:CPU on
    CPUs with AVX512-BF16 flushes bf16 subnormals to zero when it concatenates bf16 data (seen with a zero sentinel
    row appended), which would change values a copy must keep; gathering the bit patterns as unsigned integers and
    selecting the zero row with a mask is exact everywhere. Differentiable in ``table`` (cotangents scatter-add
    back)."""
    if not jnp.issubdtype(table.dtype, jnp.floating):
        return _append_row(table, 0)[idx]
    return _take_float_rows(table, idx)


def _append_row(a, fill):
    """Append one row of ``fill`` along axis 0 (the gather sentinel row)."""
    pad = jnp.full((1,) + tuple(a.shape[1:]), fill, dtype=a.dtype)
    return jnp.concatenate([a, pad], axis=0)


# --------------------------------------------------------------------------- #
# Engram
# --------------------------------------------------------------------------- #
def engram_lookup(shards, indices, *, mode: str = "fill", sf_table=None, sf_layout: str = "row"):
    """Reference Engram fetch (docs/semantics.md, "Engram"): gather of a row-sharded table by global id.

    shards: ``[R, num_entries, hidden]`` (any dtype, incl. float8_e4m3fn); rank r's
      shard is ``shards[r]``; global id ``g`` -> owner ``g // num_entries``, row
      ``g % num_entries``.
    indices: ``[T, E]`` integer global ids.  Negative id = padding -> zero row and
      zero sf.  Id ``>= R*num_entries``: ``mode="fill"`` -> zero row/sf;
      ``"clip"`` -> clipped to ``R*num_entries - 1``; ``"checked"`` -> same values
      as ``"fill"`` (the native op raises instead; a traced reference cannot).
    sf_table: None or ``[R*num_entries, P]`` float32/int32, the replicated scale
      table indexed by global id.
    sf_layout: ``"row"`` -> sf ``[T, E*P]``; ``"tma_col_major"`` -> the
      column-major, token-padded-to-4 layout materialised as ``[E*P, align(T, 4)]``
      with ``out[j, t] = sf_row[t, j]`` and zero padding columns.

    Returns ``(data [T, E*hidden], sf or None)``; row ``t`` of data is the
    concatenation over ``e`` of the looked-up rows.  The gather is bit-exact (no
    value conversion: NaN payloads are preserved) and differentiable in
    ``shards``.
    """
    if mode not in ENGRAM_MODES:
        raise ValueError(f"mode must be one of {ENGRAM_MODES}, got {mode!r}")
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {SF_LAYOUTS}, got {sf_layout!r}")
    shards = jnp.asarray(shards)
    indices = jnp.asarray(indices)
    if shards.ndim != 3:
        raise ValueError(f"shards must be [R, num_entries, hidden], got shape {shards.shape}")
    if indices.ndim != 2:
        raise ValueError(f"indices must be [T, E], got shape {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integer, got {indices.dtype}")
    R, Ne, H = shards.shape
    T, E = indices.shape
    total = R * Ne
    if total == 0:
        raise ValueError("the table is empty (R*num_entries == 0)")

    if sf_table is not None:
        sf_table = jnp.asarray(sf_table)
        if sf_table.ndim != 2 or sf_table.shape[0] != total:
            raise ValueError(
                f"sf_table must be [R*num_entries={total}, P], got shape {sf_table.shape}")
        if np.dtype(sf_table.dtype) not in _SF_DTYPES:
            raise ValueError(f"sf_table must be float32 or int32, got {sf_table.dtype}")
    return _engram_impl(shards, indices, sf_table, mode, sf_layout)


# The computational bodies are jitted with their static configuration so that an
# eager call compiles ONE executable instead of dispatching op by op; inside an
# outer jit / grad they are simply inlined.
@functools.partial(jax.jit, static_argnums=(3, 4))
def _engram_impl(shards, indices, sf_table, mode, sf_layout):
    R, Ne, H = shards.shape
    T, E = indices.shape
    total = R * Ne
    ids = indices.astype(jnp.int32)
    if mode == "clip":
        ids = jnp.minimum(ids, total - 1)
    valid = (ids >= 0) & (ids < total)
    safe = jnp.where(valid, ids, total).reshape(-1)  # `total` = appended zero row

    data = _take(shards.reshape(total, H), safe).reshape(T, E * H)
    if sf_table is None:
        return data, None
    P = sf_table.shape[1]
    sf_row = _take(sf_table, safe).reshape(T, E * P)
    if sf_layout == "row":
        return data, sf_row
    Tp = int(align(T, 4))
    sf_col = jnp.pad(sf_row.T, ((0, 0), (0, Tp - T)))
    return data, sf_col


# --------------------------------------------------------------------------- #
# MoE dispatch
# --------------------------------------------------------------------------- #
def _validate_ep(R: int, N: int, K: int, num_experts: int, M: int):
    if R < 1:
        raise ValueError("need at least one rank")
    if K < 1:
        raise ValueError("top-k must be >= 1")
    if K > MAX_TOPK:
        raise ValueError(f"top-k = {K} exceeds the DeepEP limit of {MAX_TOPK}")
    if num_experts < 1 or num_experts % R != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be a positive multiple of the number of ranks ({R})")
    if M < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {M}")
    if N > M:
        raise ValueError(
            f"per-rank token count N={N} exceeds max_tokens_per_rank={M}")


def ep_dispatch(x, topk_idx, topk_weights=None, *, num_experts: int, max_tokens_per_rank: int,
                expand: bool = False, expert_alignment: int = 1, zero_padding: bool = False,
                x_scales=None) -> Dict[str, Optional[jax.Array]]:
    """Reference DeepEP V2 direct-mode dispatch (docs/semantics.md, "MoE dispatch"), global view.

    Args:
      x: ``[R, N, H]`` (bf16 / f16 / f32 / float8_e4m3fn; copied bit-exactly).
      topk_idx: ``[R, N, K]`` integer global expert ids, negative = no expert.
      topk_weights: ``[R, N, K]`` float32 or None.
      num_experts: E (``E % R == 0``; expert ``g`` lives on rank ``g // E_loc`` as
        local expert ``g % E_loc``).
      max_tokens_per_rank: M (``N <= M``); ``src_gid = src_rank*M + t``.
      expand: expand (per-expert, GEMM-ready) layout instead of token rows.
      expert_alignment: A, per-expert segment alignment (counts and psums use it in
        both layouts).
      zero_padding: expand only; asks the native op to zero the alignment padding
        rows.  The reference always zeroes every undefined row, so it only
        changes ``recv_row_defined``.
      x_scales: ``[R, N, P]`` float32/int32 or None (copied like x).

    Returns a dict (every array has the rank on axis 0):
      recv_x: non-expand ``[R, R*M, H]``; expand ``[R, rows_exp, H]``.
      recv_x_scales: same rows, ``[..., P]``, or None.
      recv_topk_idx: non-expand ``[R, R*M, K]`` int32 (local expert id when that
        expert is on this rank, else -1); expand: None.
      recv_topk_weights: non-expand ``[R, R*M, K]`` f32 (the source row verbatim,
        all K positions); expand ``[R, rows_exp]`` f32 (weight of that (token, k));
        None when no weights.
      num_recv_tokens: ``[R]`` int32, deduplicated tokens received.
      num_expanded_rows: ``[R]`` int32; expand: ``sum_e align(count_e, A)``;
        non-expand: ``num_recv_tokens``.
      group_sizes: ``[R, E_loc]`` int32 ``align(count_e, A)``.
      psum_num_recv_tokens_per_rank: ``[R, R]`` int32 inclusive prefix sum over
        source ranks of deduplicated received tokens.
      psum_num_recv_tokens_per_expert: ``[R, E_loc]`` int32; non-expand: inclusive
        psum of aligned counts; expand: ``start[e] + count[e]``.
      num_unaligned_recv_tokens_per_expert: ``[R, E_loc]`` int32 (``count_e``).
      recv_src_metadata: ``[R, R*M, K+2]`` int32, one row per received token in
        canonical order (in BOTH layouts): ``[:,0] = src_gid``,
        ``[:,1] = src_rank*K + master_k``, ``[:,2+k]`` = expand: row of position k
        in the expanded ``recv_x`` or -1; non-expand: -1 (DeepEP leaves these
        uninitialised in non-expand mode — do not compare them there).
      recv_token_valid: ``[R, R*M]`` bool, token row ``i < num_recv_tokens``.
      recv_row_valid: ``[R, rows]`` bool, row of ``recv_x`` holds real data.
      recv_row_padding: ``[R, rows]`` bool, alignment-padding row (expand only).
      recv_row_defined: ``[R, rows]`` bool, rows whose content the native op must
        match: ``recv_row_valid | (recv_row_padding & zero_padding)``.
    """
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    if x.ndim != 3:
        raise ValueError(f"x must be [R, N, H], got shape {x.shape}")
    if topk_idx.ndim != 3 or topk_idx.shape[:2] != x.shape[:2]:
        raise ValueError(f"topk_idx must be [R, N, K] matching x {x.shape}, got {topk_idx.shape}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"topk_idx must be integer, got {topk_idx.dtype}")
    R, N, H = x.shape
    K = topk_idx.shape[-1]
    E, M, A = int(num_experts), int(max_tokens_per_rank), int(expert_alignment)
    _validate_ep(R, N, K, E, M)
    if A < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {A}")
    if zero_padding and not expand:
        raise ValueError("zero_padding requires expand=True")
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(
                f"topk_weights must have the shape of topk_idx {topk_idx.shape}, got {topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if x_scales is not None:
        x_scales = jnp.asarray(x_scales)
        if x_scales.ndim != 3 or x_scales.shape[:2] != (R, N):
            raise ValueError(f"x_scales must be [R, N, P], got shape {x_scales.shape}")
        if np.dtype(x_scales.dtype) not in _SF_DTYPES:
            raise ValueError(f"x_scales must be float32 or int32, got {x_scales.dtype}")
    check_routing(topk_idx, E)
    return _ep_dispatch_impl(x, topk_idx, topk_weights, x_scales, E, M, bool(expand), A,
                             bool(zero_padding))


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8))
def _ep_dispatch_impl(x, topk_idx, topk_weights, x_scales, E, M, expand, A, zero_padding):
    R, N, H = x.shape
    K = topk_idx.shape[-1]
    E_loc = E // R
    T = R * N                      # flat source tokens, flat id = s*N + t
    rows_ne = R * M
    i32 = jnp.int32
    ranks = jnp.arange(R, dtype=i32)
    tok = jnp.arange(T, dtype=i32)
    src_rank_of_tok = tok // N if N > 0 else tok
    gid_of_tok = src_rank_of_tok * M + (tok % N if N > 0 else tok)
    kpos = jnp.arange(K, dtype=i32)

    valid, owner, local = _owner_local(topk_idx.reshape(T, K), E, E_loc)      # [T, K]
    hits = owner[:, :, None] == ranks[None, None, :]                          # [T, K, R]
    is_dest = hits.any(axis=1)                                                # [T, R]
    master = jnp.max(jnp.where(hits, kpos[None, :, None], -1), axis=1)        # [T, R]

    # ---- token rows (canonical: flat order s*N+t == src_gid order) ----------
    pos = jnp.cumsum(is_dest.astype(i32), axis=0) - 1                         # [T, R]
    num_recv = jnp.sum(is_dest, axis=0, dtype=i32)                            # [R]
    tgt = jnp.where(is_dest, pos, rows_ne)                                    # OOB -> dropped
    src_of_row = jnp.full((R, rows_ne), T, i32).at[
        jnp.broadcast_to(ranks[None, :], (T, R)), tgt].set(
        jnp.broadcast_to(tok[:, None], (T, R)), mode="drop")                 # [R, rows_ne], T = none
    token_valid = src_of_row < T

    def gather_tok_rank(per_tok_rank, fill):
        """[T, R, ...] per (token, destination) -> [R, rows_ne, ...] per token row."""
        ext = _append_row(per_tok_rank, fill)
        return ext[src_of_row, ranks[:, None]]

    meta0 = _append_row(gid_of_tok, -1)[src_of_row]                            # [R, rows_ne]
    meta1 = gather_tok_rank(src_rank_of_tok[:, None] * K + master, -1)        # [R, rows_ne]

    # ---- per-expert counts / psums (both layouts) ---------------------------
    col = jnp.where(valid, owner * E_loc + local, E)                          # [T, K]
    onehot = jnp.zeros((T, E + 1), i32).at[tok[:, None], col].add(1)[:, :E]   # [T, E]
    count_g = jnp.sum(onehot, axis=0, dtype=i32)                              # [E]
    count = count_g.reshape(R, E_loc)
    aligned = align(count, A)
    start = jnp.cumsum(aligned, axis=1, dtype=i32) - aligned                  # exclusive
    counts_rank = is_dest.reshape(R, N, R).sum(axis=1, dtype=i32).T           # [dst, src]
    psum_rank = jnp.cumsum(counts_rank, axis=1, dtype=i32)

    out: Dict[str, Optional[jax.Array]] = {}
    x_flat = x.reshape(T, H)                    # row T of _take = the zero sentinel row
    sc_flat = None if x_scales is None else x_scales.reshape(T, -1)

    if not expand:
        local_on = jnp.where(hits, local[:, :, None], -1).transpose(0, 2, 1)  # [T, R, K]
        out["recv_x"] = _take(x_flat, src_of_row)
        out["recv_x_scales"] = None if sc_flat is None else _take(sc_flat, src_of_row)
        out["recv_topk_idx"] = gather_tok_rank(local_on, -1)
        out["recv_topk_weights"] = (None if topk_weights is None else
                                    _append_row(topk_weights.reshape(T, K), 0)[src_of_row])
        meta_k = jnp.full((R, rows_ne, K), -1, i32)
        out["num_recv_tokens"] = num_recv
        out["num_expanded_rows"] = num_recv
        out["psum_num_recv_tokens_per_expert"] = jnp.cumsum(aligned, axis=1, dtype=i32)
        row_valid = token_valid
        row_padding = jnp.zeros_like(token_valid)
    else:
        rows_e = expand_rows(R, M, K, E_loc, A)
        excl = jnp.cumsum(onehot, axis=0, dtype=i32) - onehot                 # [T, E]
        rank_in_e = jnp.take_along_axis(excl, jnp.where(valid, col, 0), axis=1)  # [T, K]
        exp_row = jnp.where(valid, start[jnp.maximum(owner, 0), jnp.maximum(local, 0)] + rank_in_e, -1)
        flat_tgt = jnp.where(valid, owner * rows_e + exp_row, R * rows_e)
        entry = tok[:, None] * K + kpos[None, :]                             # [T, K]
        src_entry = jnp.full((R * rows_e,), T * K, i32).at[flat_tgt.reshape(-1)].set(
            entry.reshape(-1), mode="drop").reshape(R, rows_e)               # T*K = none
        src_tok = src_entry // K                                              # none -> T
        out["recv_x"] = _take(x_flat, src_tok)
        out["recv_x_scales"] = None if sc_flat is None else _take(sc_flat, src_tok)
        out["recv_topk_idx"] = None
        out["recv_topk_weights"] = (None if topk_weights is None else
                                    _append_row(topk_weights.reshape(T * K), 0)[src_entry])
        exp_on = jnp.where(hits, exp_row[:, :, None], -1).transpose(0, 2, 1)  # [T, R, K]
        meta_k = gather_tok_rank(exp_on, -1)
        num_exp = jnp.sum(aligned, axis=1, dtype=i32)
        out["num_recv_tokens"] = num_recv
        out["num_expanded_rows"] = num_exp
        out["psum_num_recv_tokens_per_expert"] = start + count
        row_valid = src_entry < T * K
        row_padding = (jnp.arange(rows_e, dtype=i32)[None, :] < num_exp[:, None]) & ~row_valid

    out["group_sizes"] = aligned.astype(i32)
    out["psum_num_recv_tokens_per_rank"] = psum_rank
    out["num_unaligned_recv_tokens_per_expert"] = count.astype(i32)
    out["recv_src_metadata"] = jnp.concatenate(
        [meta0[..., None], meta1[..., None], meta_k], axis=-1).astype(i32)
    out["recv_token_valid"] = token_valid
    out["recv_row_valid"] = row_valid
    out["recv_row_padding"] = row_padding
    out["recv_row_defined"] = row_valid | (row_padding & bool(zero_padding))
    return out


# --------------------------------------------------------------------------- #
# MoE combine
# --------------------------------------------------------------------------- #
_NEG_ZERO = -0.0  # IEEE additive identity: -0.0 + v == v bit-exactly for every v


def _as_bias_tuple(bias) -> Tuple[jax.Array, ...]:
    if bias is None:
        return ()
    if isinstance(bias, (tuple, list)):
        if len(bias) > 2:
            raise ValueError(f"at most two bias tensors are supported, got {len(bias)}")
        return tuple(jnp.asarray(b) for b in bias)
    return (jnp.asarray(bias),)


def ep_combine(y, dispatch_result, topk_idx, *, num_experts: int, max_tokens_per_rank: int,
               expand: bool, topk_weights=None, bias=None):
    """Reference DeepEP V2 direct-mode combine (docs/semantics.md, "MoE combine"), global view.

    Args:
      y: ``[R, rows, H]`` bf16 in the receive layout of ``dispatch_result``
        (non-expand ``rows = R*M``; expand ``rows = rows_exp``).
      dispatch_result: the dict returned by :func:`ep_dispatch` (only
        ``recv_src_metadata`` and ``num_recv_tokens`` are read, so a native dispatch
        handle with the same fields works too, whatever its row order).
      topk_idx: ``[R, N, K]`` the ORIGINAL per-rank routing.
      topk_weights: None, non-expand ``[R, R*M, K]`` f32, expand ``[R, rows_exp]`` f32.
      bias: None, one ``[R, N, H]`` bf16 array, or a tuple of two.

    Numerics (bit-exact contract; combine is an UNWEIGHTED sum):
      * expert rank d, received token row i: non-expand sends ``y[d, i]`` as is;
        expand sends ``bf16(sum_f32 over valid local k ascending of y[d, row(i,k)])``
        (one rounding; a single valid k is therefore sent unchanged).
      * source rank s, token t: ``acc = f32(b0) (+ f32(b1))``, then for each
        destination rank of t in ascending order of its master position:
        ``acc += f32(row from d)``; ``out = bf16(acc)``.  Every fp32 sum is a left
        fold over its terms (equivalently: accumulator initialised to -0.0, so a
        lone -0.0 term stays -0.0).  A token with no expert and no bias gives +0.0.
      * combined_topk_weights ``[R, N, K]`` f32: position k = the weight of
        (token, k) on the rank owning expert k (non-expand ``w[d, i, k]``, expand
        ``w[d, row(i,k)]``), 0 where ``topk_idx < 0``.

    Returns ``(combined_x [R, N, H] bf16, combined_topk_weights or None)``.
    """
    y = jnp.asarray(y)
    topk_idx = jnp.asarray(topk_idx)
    if y.ndim != 3:
        raise ValueError(f"y must be [R, rows, H], got shape {y.shape}")
    if y.dtype != jnp.bfloat16:
        raise ValueError(f"combine input must be bfloat16, got {y.dtype}")
    if topk_idx.ndim != 3 or topk_idx.shape[0] != y.shape[0]:
        raise ValueError(f"topk_idx must be [R, N, K] with R={y.shape[0]}, got {topk_idx.shape}")
    R, rows, H = y.shape
    _, N, K = topk_idx.shape
    E, M = int(num_experts), int(max_tokens_per_rank)
    _validate_ep(R, N, K, E, M)
    check_routing(topk_idx, E)
    E_loc = E // R
    rows_ne = R * M
    if not expand and rows != rows_ne:
        raise ValueError(f"non-expand combine needs y with R*M={rows_ne} rows, got {rows}")
    meta = jnp.asarray(dispatch_result["recv_src_metadata"])
    if meta.shape != (R, rows_ne, K + 2):
        raise ValueError(
            f"dispatch_result['recv_src_metadata'] must be {(R, rows_ne, K + 2)}, got {meta.shape}")
    num_recv = jnp.asarray(dispatch_result["num_recv_tokens"])
    if num_recv.shape != (R,):
        raise ValueError(f"dispatch_result['num_recv_tokens'] must be [R={R}], got {num_recv.shape}")
    biases = _as_bias_tuple(bias)
    for b in biases:
        if b.shape != (R, N, H) or b.dtype != jnp.bfloat16:
            raise ValueError(f"bias must be bf16 [R, N, H]={(R, N, H)}, got {b.dtype} {b.shape}")
    if topk_weights is not None:
        topk_weights = jnp.asarray(topk_weights)
        want = (R, rows) if expand else (R, rows_ne, K)
        if topk_weights.shape != want:
            raise ValueError(f"topk_weights must be {want} for expand={expand}, got {topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    return _ep_combine_impl(y, meta, num_recv, topk_idx, topk_weights, biases, E, M, bool(expand))


@functools.partial(jax.jit, static_argnums=(6, 7, 8))
def _ep_combine_impl(y, meta, num_recv, topk_idx, topk_weights, biases, E, M, expand):
    R, rows, H = y.shape
    _, N, K = topk_idx.shape
    E_loc = E // R
    rows_ne = R * M
    num_recv = num_recv.astype(jnp.int32)
    i32, f32 = jnp.int32, jnp.float32
    ranks = jnp.arange(R, dtype=i32)
    row_ids = jnp.arange(rows_ne, dtype=i32)
    token_valid = row_ids[None, :] < num_recv[:, None]                        # [R, rows_ne]

    # ---- expert side: what each received token row sends back --------------
    yf = _bf16_round(y.astype(f32))  # rounding kept even when y was computed in f32 by the caller's jit
    if not expand:
        sent = yf                                                             # [R, rows_ne, H]
    else:
        acc = jnp.full((R, rows_ne, H), _NEG_ZERO, f32)
        for k in range(K):
            r = meta[:, :, 2 + k]
            ok = token_valid & (r >= 0)
            v = yf[ranks[:, None], jnp.clip(r, 0, rows - 1)]
            acc = acc + jnp.where(ok[..., None], v, _NEG_ZERO)
        sent = _bf16_round(acc)  # one rounding per reduction level

    # ---- source side: token (s, t) -> its row on rank d ---------------------
    gid = meta[:, :, 0]
    s_of = jnp.where(token_valid, gid // M, R)                                # OOB -> dropped
    t_of = jnp.where(token_valid, gid % M, 0)
    d_of = jnp.broadcast_to(ranks[:, None], (R, rows_ne))
    row_of = jnp.full((R, M, R), -1, i32).at[s_of, t_of, d_of].set(
        jnp.broadcast_to(row_ids[None, :], (R, rows_ne)), mode="drop")[:, :N]  # [R, N, R]

    valid, owner, _ = _owner_local(topk_idx, E, E_loc)                        # [R, N, K]
    master = master_positions(topk_idx, E, R)                                 # [R, N, R]
    own = jnp.maximum(owner, 0)
    my_master = jnp.take_along_axis(master, own, axis=2)                      # [R, N, K]
    kk = jnp.arange(K, dtype=i32)
    is_master = valid & (my_master == kk[None, None, :])
    row_k = jnp.take_along_axis(row_of, own, axis=2)                          # [R, N, K] row on owner
    row_k = jnp.where(valid, row_k, -1)
    row_safe = jnp.clip(row_k, 0, rows_ne - 1)

    acc = jnp.full((R, N, H), _NEG_ZERO, f32)
    for b in biases:
        acc = acc + _bf16_round(b.astype(f32))
    for k in range(K):  # ascending position == ascending master position
        v = sent[own[:, :, k], row_safe[:, :, k]]                             # [R, N, H]
        acc = acc + jnp.where(is_master[:, :, k, None], v, _NEG_ZERO)
    has_term = jnp.any(valid, axis=-1) if not biases else jnp.ones((R, N), bool)
    combined_x = _bf16_round(jnp.where(has_term[..., None], acc, 0.0)).astype(jnp.bfloat16)

    if topk_weights is None:
        return combined_x, None
    if not expand:
        w = topk_weights[own, row_safe, kk[None, None, :]]
    else:
        erow = meta[own, row_safe, 2 + kk[None, None, :]]
        w = topk_weights[own, jnp.clip(erow, 0, rows - 1)]
    combined_w = jnp.where(valid, w, 0.0).astype(f32)
    return combined_x, combined_w
