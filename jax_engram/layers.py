"""Functional layers on jax_engram's ops: an Engram memory (hashed n-gram lookup + gated add) and an
expert-parallel MoE (router, top-k, expand dispatch, expert GEMMs with ``jax.lax.ragged_dot``, combine).

Two levels:

* Global (call on global arrays, inside or outside ``jax.jit``; each opens its own ``jax.shard_map`` over the
  context's mesh axis): :func:`engram_layer`, :func:`moe_layer`.
* Per rank (call inside your own ``shard_map`` over ``ctx.axis_name``, local shapes): :func:`engram_local`,
  :func:`moe_local` and their pieces (:func:`engram_ids`, :func:`engram_gate_add`, :func:`route`,
  :func:`moe_experts`). :func:`engram_layer` called inside such a ``shard_map`` is :func:`engram_local`.

Prefetch: :func:`engram_prefetch` starts an Engram layer's lookups from the token ids alone (at the start of the
step); the layer consumes them with ``pending=`` and waits after its input, so the work before the layer
overlaps the reads (GPU). Works per rank and on global arrays, under ``jax.grad``. The decode form
(:class:`EngramDecodeState`, :func:`engram_decode_init`, :func:`engram_decode_ids`) gives the ids of each
sequence's newest token from a small carried state, for inference loops.

Pure-JAX twins on the global view (:func:`engram_layer_reference`, :func:`moe_layer_reference`) run the same
math on :mod:`jax_engram.reference`, for checks.

Engram (as in DeepSeek's Engram): for every token t and every n-gram order n (default 2 and 3) the ids of
tokens t-n+1..t are hashed by ``heads_per_order`` independent hash heads; every (order, head) pair is one
"head" with its own buckets of one table row each. Head h's bucket b is global row ``b * num_heads + h``
(interleaved, so every head's rows are spread over all ranks of the table). Positions with fewer than n
tokens before them read nothing (id -1: a zero row). The rows of a token's heads, concatenated, form its
memory vector m [num_heads * memory_dim]; with key k = m W_key and value v = m W_value (both [.., hidden]),
the layer returns ``hidden + sigmoid(<rms(hidden), rms(k)> / sqrt(hidden)) * v``.

MoE: softmax router, top-k, weights renormalised over the top-k; expand dispatch (rows grouped per local
expert, ``expert_alignment`` per segment), ``act(x W_up[e]) W_down[e]`` per segment with
``jax.lax.ragged_dot``, rows scaled by their routing weight, combine (an unweighted sum). Gradients flow to
x, the router and the experts (dispatch and combine are differentiable). Expert weights are sharded over the
EP axis: ``w_up`` [num_experts, hidden, ffn] and ``w_down`` [num_experts, ffn, hidden], rank r holding experts
``r*E_loc .. (r+1)*E_loc - 1``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_engram import _jax_private, ep as _ep
from jax_engram.config import EngramConfig
from jax_engram.context import AnyContext
from jax_engram.engram import EngramPending, EngramTable

__all__ = ["EngramHashing", "engram_ids", "engram_gate_add", "engram_local", "engram_layer",
           "engram_layer_reference", "engram_prefetch", "start_before", "GlobalEngramPending", "engram_dequantize",
           "engram_quantize",
           "EngramDecodeState", "engram_decode_init", "engram_decode_ids", "route", "moe_experts", "moe_local",
           "moe_layer", "moe_layer_reference",
           "init_moe_params", "init_engram_params", "put_global", "batch_spec", "moe_param_specs"]

Params = Mapping[str, jax.Array]
Activation = Callable[[jax.Array], jax.Array]
EngramMode = Literal["fill", "clip", "checked"]


# ---------------------------------------------------------------------------------------------- Engram
@dataclasses.dataclass(frozen=True)
class EngramHashing:
    """How token n-grams become global table ids.

    orders: the n-gram orders (default 2- and 3-grams). heads_per_order: independent hash heads per order.
    seed: mixes every hash (two layers with different seeds read different rows for the same n-gram).
    """

    orders: tuple[int, ...] = (2, 3)
    heads_per_order: int = 4
    seed: int = 0

    def __post_init__(self):
        if not self.orders or any(int(n) < 1 for n in self.orders):
            raise ValueError(f"EngramHashing: orders must be positive n-gram orders, got {self.orders!r}")
        if self.heads_per_order < 1:
            raise ValueError(f"EngramHashing: heads_per_order must be >= 1, got {self.heads_per_order}")
        object.__setattr__(self, "orders", tuple(int(n) for n in self.orders))

    @property
    def num_heads(self) -> int:
        """Ids per token: one per (order, hash head)."""
        return len(self.orders) * self.heads_per_order

    def buckets_per_head(self, total_entries: int) -> int:
        """Rows each head can address in a table of ``total_entries`` rows."""
        b = total_entries // self.num_heads
        if b < 1:
            raise ValueError(f"EngramHashing: a table of {total_entries} rows is too small for {self.num_heads} heads")
        return b


def _mix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (uint32 in, uint32 out, wrapping arithmetic)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash_ids(prev: Callable[[int], jax.Array], valid: Callable[[int], jax.Array], shape: tuple[int, ...], *,
              hashing: EngramHashing, total_entries: int) -> jax.Array:
    """The hash of :func:`engram_ids`, shared with the decode form so that both give the same ids bit for bit.
    prev(i): uint32 [*shape], token t-i of every position t (i = 0 .. max order - 1); valid(n): bool mask
    (broadcastable to shape) of the positions with at least n-1 tokens before them."""
    buckets = hashing.buckets_per_head(total_entries)
    out = []
    head = 0
    for n in hashing.orders:
        for j in range(hashing.heads_per_order):
            salt = (hashing.seed * 0x9E3779B1 + n * 0x85EBCA77 + j * 0xC2B2AE3D + 1) & 0xFFFFFFFF
            h = jnp.full(shape, salt, jnp.uint32)
            for i in range(n):
                h = _mix32(h ^ (prev(i) + jnp.uint32((0x9E3779B9 * (i + 1)) & 0xFFFFFFFF)))
            gid = (h % jnp.uint32(buckets)).astype(jnp.int32) * hashing.num_heads + head
            out.append(jnp.where(valid(n), gid, -1))
            head += 1
    return jnp.stack(out, axis=-1)


def engram_ids(token_ids: jax.Array, *, hashing: EngramHashing, total_entries: int) -> jax.Array:
    """Global table ids of every token's hashed n-grams.

    token_ids: int [B, S] (sequences along the last axis; any integer dtype). Returns int32
    [B, S, hashing.num_heads], order-major (all heads of orders[0] first); -1 where a position has fewer than
    n-1 tokens before it in its sequence (padding: a zero row).
    """
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 2 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"engram_ids: token_ids must be integer [batch, seq], got {token_ids.dtype} "
                         f"{token_ids.shape}")
    tok = token_ids.astype(jnp.uint32)
    pos = jnp.arange(token_ids.shape[1])[None, :]
    # prev(i)[:, t] = token t - i (garbage where t < i: masked by valid)
    return _hash_ids(lambda i: jnp.roll(tok, i, axis=1) if i else tok, lambda n: pos >= n - 1, tok.shape,
                     hashing=hashing, total_entries=total_entries)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["history", "length"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class EngramDecodeState:
    """What an inference loop carries to compute Engram ids one token at a time (a frozen pytree).

    history: uint32 [B, K], the last K = max(hashing.orders) - 1 token ids of every sequence, newest last (the
    token ids as :func:`engram_ids` hashes them: converted to uint32). length: int32 [B], tokens seen so far,
    capped at K (a new token has n-1 predecessors for order n iff ``length >= n - 1``).
    Make one with :func:`engram_decode_init`; advance it with :func:`engram_decode_ids`.
    """

    history: jax.Array
    length: jax.Array


def _decode_depth(hashing: EngramHashing) -> int:
    return max(hashing.orders) - 1


def engram_decode_init(prompt: int | jax.Array, *, hashing: EngramHashing,
                       lengths: Optional[jax.Array] = None) -> EngramDecodeState:
    """The decode state before the first generated token.

    prompt: the batch size B (no prompt), or the prompt token ids int [B, S] whose ids the caller computed with
    :func:`engram_ids` (a prefill). lengths: optional int [B], the real length of each prompt (right padding
    after it; default S for every sequence). Returns an :class:`EngramDecodeState` whose next
    :func:`engram_decode_ids` gives the ids of position ``lengths`` (or S).

    Inside ``shard_map``, a state made from the batch size is the same on every rank while the states after it
    depend on each rank's tokens: mark it varying before carrying it through ``jax.lax.scan``
    (``jax.lax.pcast(state, axis, to="varying")``); a state made from a per-rank prompt already is.
    """
    K = _decode_depth(hashing)
    if isinstance(prompt, (int, np.integer)) and not isinstance(prompt, bool):
        return EngramDecodeState(jnp.zeros((int(prompt), K), jnp.uint32), jnp.zeros((int(prompt),), jnp.int32))
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"engram_decode_init: prompt must be the batch size or integer token ids [batch, seq], got "
                         f"{prompt.dtype} {prompt.shape}")
    B, S = prompt.shape
    n = jnp.full((B,), S, jnp.int32) if lengths is None else jnp.minimum(jnp.asarray(lengths, jnp.int32), S)
    pos = n[:, None] - K + jnp.arange(K, dtype=jnp.int32)[None, :]          # [B, K]: the last K positions
    tok = jnp.take_along_axis(prompt.astype(jnp.uint32), jnp.clip(pos, 0, max(S - 1, 0)), axis=1) if S else \
        jnp.zeros((B, K), jnp.uint32)
    return EngramDecodeState(jnp.where(pos >= 0, tok, jnp.uint32(0)), jnp.minimum(n, K))


def engram_decode_ids(state: EngramDecodeState, new_token_ids: jax.Array, *, hashing: EngramHashing,
                      total_entries: int) -> tuple[jax.Array, EngramDecodeState]:
    """The decode form of :func:`engram_ids`: the ids of each sequence's newest token from its last n-1 tokens.

    state: the :class:`EngramDecodeState` (history [B, K], length [B]); new_token_ids: int [B]. Returns
    ``(ids int32 [B, hashing.num_heads], the state after the new token)``; ids equal, bit for bit, the row of
    :func:`engram_ids` of the whole sequence at the new token's position. Prefetch them with
    ``engram_prefetch(table, ids=ids[:, None])`` (one position per sequence).
    """
    K = _decode_depth(hashing)
    new = jnp.asarray(new_token_ids)
    if new.ndim != 1 or not jnp.issubdtype(new.dtype, jnp.integer):
        raise ValueError(f"engram_decode_ids: new_token_ids must be integer [batch], got {new.dtype} {new.shape}")
    if state.history.shape != (new.shape[0], K):
        raise ValueError(f"engram_decode_ids: state.history is {state.history.shape}, expected [batch, "
                         f"max(orders) - 1] = [{new.shape[0]}, {K}] for {hashing}")
    tok = new.astype(jnp.uint32)
    hist = state.history
    ids = _hash_ids(lambda i: hist[:, K - i] if i else tok, lambda n: state.length >= n - 1, tok.shape,
                    hashing=hashing, total_entries=total_entries)
    history = jnp.concatenate([hist[:, 1:], tok[:, None]], axis=1) if K else hist
    return ids, EngramDecodeState(history, jnp.minimum(state.length + 1, K).astype(jnp.int32))


def _rms(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def engram_gate_add(params: Params, hidden: jax.Array, memory: jax.Array) -> jax.Array:
    """The gated add: ``hidden + sigmoid(<rms(hidden), rms(m W_key)> / sqrt(H)) * (m W_value)`` (f32 math).

    params: ``w_key``, ``w_value`` float [M, H]. hidden [..., H]; memory [..., M] (M = num_heads*memory_dim).
    Returns [..., H] of hidden's dtype.
    """
    h = hidden.astype(jnp.float32)
    m = memory.astype(jnp.float32)
    k = m @ params["w_key"].astype(jnp.float32)
    v = m @ params["w_value"].astype(jnp.float32)
    gate = jax.nn.sigmoid(jnp.sum(_rms(h) * _rms(k), axis=-1, keepdims=True) / math.sqrt(h.shape[-1]))
    return (h + gate * v).astype(hidden.dtype)


def _check_gate(params: Params, hidden_size: int, memory_dim: int, hashing: EngramHashing, where: str) -> None:
    """The gate's projections must read num_heads rows of memory_dim elements each (a clear error instead of a
    shape mismatch deep inside dot_general)."""
    m = hashing.num_heads * memory_dim
    for k in ("w_key", "w_value"):
        w = params[k]
        if tuple(w.shape) != (m, hidden_size):
            raise ValueError(
                f"{where}: params[{k!r}] is {list(w.shape)} but the table's rows need [num_heads * memory_dim, "
                f"hidden] = [{hashing.num_heads} * {memory_dim}, {hidden_size}] = [{m}, {hidden_size}] (a gate made "
                f"for memory_dim {w.shape[0] / hashing.num_heads:g} does not fit a table of memory_dim {memory_dim}; "
                "init_engram_params(memory_dim=table.hidden, num_heads=hashing.num_heads))")


def _dequantize(data: jax.Array, sf: Optional[jax.Array], memory_dim: int, sf_dtype: Any) -> jax.Array:
    """data [..., I*d] with sf [..., I*P] (or None) -> the rows as numbers (float32 when scaled)."""
    if sf is None:
        return data
    lead = data.shape[:-1]
    I = data.shape[-1] // memory_dim
    P_ = sf.shape[-1] // I
    if np.dtype(sf_dtype) == np.dtype(np.int32):  # packed UE8M0x4: byte k of pack p scales block 4p+k by 2^(e-127)
        e = jax.lax.bitcast_convert_type(sf, jnp.uint8).reshape(lead + (I, 4 * P_)).astype(jnp.uint32)
        scale = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
        blocks = 4 * P_
    else:
        scale, blocks = sf.astype(jnp.float32).reshape(lead + (I, P_)), P_
    if memory_dim % blocks:
        raise ValueError(f"jax_engram Engram layer: {blocks} scale blocks per row do not divide memory_dim "
                         f"{memory_dim}")
    x = data.astype(jnp.float32).reshape(lead + (I, blocks, memory_dim // blocks)) * scale[..., None]
    return x.reshape(data.shape)


_FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def engram_quantize(rows: jax.Array | np.ndarray, *, num_sf_packs: int, sf_dtype: Any = np.float32
                    ) -> tuple[jax.Array, jax.Array]:
    """Rows as an FP8 Engram table stores them, the inverse of :func:`engram_dequantize` up to FP8 rounding.

    rows [N, memory_dim] (any float dtype). Each row is cut into blocks that share one scale: ``num_sf_packs``
    blocks with float32 scales (``amax / 448``), or ``4 * num_sf_packs`` blocks with int32 packs of UE8M0 exponents
    (the power of two at or above ``amax / 448``). Returns ``(float8_e4m3fn [N, memory_dim], sf [N, num_sf_packs]
    of sf_dtype)`` for ``EngramTable.write_global(rows, sf)``. An all-zero block gets the scale 1.
    """
    x = jnp.asarray(rows, jnp.float32)
    if x.ndim != 2 or num_sf_packs < 1:
        raise ValueError(f"engram_quantize: rows must be [num_rows, memory_dim] and num_sf_packs >= 1, got "
                         f"{x.shape} and {num_sf_packs}")
    packed = np.dtype(sf_dtype) == np.dtype(np.int32)
    if not packed and np.dtype(sf_dtype) != np.dtype(np.float32):
        raise TypeError(f"engram_quantize: sf_dtype must be float32 or int32 (packed UE8M0x4), got {sf_dtype!r}")
    n, d = x.shape
    blocks = 4 * num_sf_packs if packed else num_sf_packs
    if d % blocks:
        raise ValueError(f"engram_quantize: {blocks} scale blocks per row do not divide memory_dim {d}")
    xb = x.reshape(n, blocks, d // blocks)
    need = jnp.max(jnp.abs(xb), axis=-1) / _FP8_MAX                        # [n, blocks]: the smallest scale
    if packed:
        m, e = jnp.frexp(need)                                              # need = m * 2**e, m in [0.5, 1)
        e = jnp.where(m == 0.5, e - 1, e)                                   # 2**e: the power of two at or above
        biased = jnp.where(need > 0, jnp.clip(e + 127, 1, 254), 127).astype(jnp.uint32)
        scale = jax.lax.bitcast_convert_type(biased << 23, jnp.float32)
        sf = jax.lax.bitcast_convert_type(biased.astype(jnp.uint8).reshape(n, num_sf_packs, 4), jnp.int32)
    else:
        scale = jnp.where(need > 0, need, 1.0)
        sf = scale
    q = jnp.clip(xb / scale[..., None], -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn).reshape(n, d)
    return q, sf.reshape(n, num_sf_packs)


def engram_dequantize(data: jax.Array, sf: Optional[jax.Array], *, table: EngramTable) -> jax.Array:
    """The Engram layer's view of looked-up rows: data [..., I*memory_dim] as is without scale factors; with
    them (sf [..., I*P], "row" layout), float32 rows scaled per block: P float32 scales per row, each for
    memory_dim/P consecutive elements, or int32 packs of four UE8M0 exponents (byte k of pack p scales block
    4p+k by 2**(e-127); 4P blocks per row). Returns [..., I*memory_dim]."""
    return _dequantize(data, sf, table.hidden, table.sf_dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pending"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GlobalEngramPending:
    """What :func:`engram_prefetch` returns outside ``shard_map`` (a frozen pytree): every rank's
    :class:`jax_engram.EngramPending` as global arrays, each sharded along its first axis like the batch
    (:func:`batch_spec`). Pass it to :func:`engram_layer` (or ``EngramMemory.__call__``) in the same jitted
    program; inside your own ``shard_map`` it can be passed in with ``in_specs=batch_spec(ctx)`` (every leaf)
    and given to :func:`engram_local`. Do not read its fields."""

    pending: EngramPending


def start_before(x: Any, *pending: EngramPending | GlobalEngramPending) -> Any:
    """``x`` unchanged (any pytree), with the fetches of ``pending`` started before anything that consumes it.

    A fetch depends only on its ids, so XLA may otherwise schedule it anywhere before its wait, e.g. right
    before the wait, and nothing overlaps. Call it at step start on the first layer's input::

        pending = [engram_prefetch(t, token_ids) for t in tables]   # every Engram layer's lookups
        x = start_before(x, *pending)                                # issued before layer 0 runs

    Free at run time (an optimization barrier over ``x`` and the fetches' status words); differentiable in ``x``.
    """
    status = tuple((p.pending if isinstance(p, GlobalEngramPending) else p).status for p in pending)
    if not status:
        return x
    x, _ = jax.lax.optimization_barrier((x, status))
    return x


def _inside_shard_map(ctx: AnyContext) -> bool:
    """True inside shard_map over the context's axis (local shapes), False outside any shard_map over it."""
    try:
        jax.lax.axis_size(ctx.axis_name)
    except NameError:
        return False
    return True


def _to_global(p: EngramPending) -> GlobalEngramPending:
    # Every leaf gets a leading per-rank axis to leave the shard_map. A table without scale factors has an empty
    # sf buffer that nothing reads or writes: it travels as one placeholder element (XLA:CPU fails to compile an
    # empty buffer crossing shard_map into the aliasing wait) and is made again on the way in.
    sf = p.sf if p.has_sf else jnp.zeros((1,), p.sf.dtype)
    return GlobalEngramPending(dataclasses.replace(p, sf=sf, status=p.status.reshape(1)))


def _local_pending(p: Any, where: str) -> EngramPending:
    if isinstance(p, GlobalEngramPending):  # passed into a shard_map: this rank's slice of every leaf
        if p.pending.status.shape != (1,):
            raise ValueError(f"{where}: this GlobalEngramPending is not a per-rank slice; pass it into your "
                             "shard_map with in_specs=batch_spec(ctx) for every leaf, or call the layer outside "
                             "shard_map")
        q = p.pending
        sf = q.sf if q.has_sf else jnp.zeros((0,), q.sf.dtype)
        return dataclasses.replace(q, sf=sf, status=q.status.reshape(()))
    if not isinstance(p, EngramPending):
        raise TypeError(f"{where}: pending must be what engram_prefetch returned, got {type(p).__name__}")
    return p


def engram_prefetch(table: EngramTable, token_ids: Optional[jax.Array] = None, *,
                    hashing: EngramHashing = EngramHashing(), ids: Optional[jax.Array] = None,
                    mode: EngramMode = "fill",
                    after: jax.Array | EngramPending | GlobalEngramPending | None = None,
                    config: Optional[EngramConfig] = None) -> EngramPending | GlobalEngramPending:
    """Start an Engram layer's lookups (call it at the start of the step; consume the result at the layer with
    ``engram_layer(..., pending=)`` / ``engram_local(..., pending=)``, in the same jitted program).

    Give exactly one of token_ids int [B, S] (hashed by :func:`engram_ids`) or ids int32 [B, S, num_heads]
    (precomputed global ids, e.g. from :func:`engram_decode_ids` as ``ids[:, None]``). Inside ``shard_map``
    over ``table.ctx``'s axis the shapes are this rank's and the result is the rank's
    :class:`jax_engram.EngramPending` (``table.fetch(..., overlap=True)``); outside, they are global arrays
    sharded (or shardable) along B like :func:`engram_layer`'s, and the result is a
    :class:`GlobalEngramPending`. ``mode``: out-of-range ids (``EngramTable.fetch``). ``config``: overrides the
    table's :class:`jax_engram.EngramConfig`. The reads need nothing but the token ids, so XLA can start them
    before any layer runs; on GPU they run beside the work until the wait.

    ``after``: issue these reads after another op. Another prefetch (what ``engram_prefetch`` returned, in or out
    of ``shard_map``): a context's fetches run one after another in the order they are issued, so prefetching
    each layer ``after=`` the previous layer's makes the rows arrive in layer order whatever order XLA would
    otherwise pick (a layer's wait then never waits for a later layer's rows). Inside ``shard_map`` also any
    array, e.g. the ``done`` of a ``table.write`` in the same program. It only orders; nothing is waited for.
    """
    where = "jax_engram.layers.engram_prefetch"
    if (token_ids is None) == (ids is None):
        raise TypeError(f"{where}: give exactly one of token_ids [B, S] or ids [B, S, num_heads]")
    if isinstance(after, (EngramPending, GlobalEngramPending)):
        after = _local_pending(after, where).status if _inside_shard_map(table.ctx) else after
    if _inside_shard_map(table.ctx):
        if ids is None:
            ids = engram_ids(token_ids, hashing=hashing, total_entries=table.total_entries)
        ids = jnp.asarray(ids)
        if ids.ndim != 3:
            raise ValueError(f"{where}: ids must be [batch, seq, ids_per_token], got shape {ids.shape}")
        B, S, I = ids.shape
        return table.fetch(ids.reshape(B * S, I), after=after, mode=mode, overlap=True, config=config)
    if after is not None and not isinstance(after, GlobalEngramPending):
        raise ValueError(f"{where}: outside shard_map, after= takes another prefetch (a GlobalEngramPending); an "
                         f"array orders per-rank ops and is only accepted inside shard_map over "
                         f"{table.ctx.axis_name!r}")
    if not _jax_private.tracing():
        # Eagerly, the pending buffers would leave a finished program while (GPU) the reads still fill them.
        raise RuntimeError(f"{where}: call it inside the jitted step that also runs the layer consuming it "
                           "(jax.jit / nnx.jit), not eagerly: a pending lookup lives within one program")
    fn = _prefetch_fn(table, hashing, mode, config, ids is not None, after is not None)
    x = ids if token_ids is None else token_ids
    return fn(x, after.pending.status) if after is not None else fn(x)


@functools.lru_cache(maxsize=64)
def _prefetch_fn(table: EngramTable, hashing: EngramHashing, mode: str, config: Optional[EngramConfig],
                 from_ids: bool, ordered: bool):
    bs = _batch_spec(table.ctx)

    def body(x, *prev_status):
        kw = dict(ids=x) if from_ids else dict(token_ids=x)
        after = prev_status[0] if prev_status else None  # the previous prefetch's status: issued after it
        return _to_global(engram_prefetch(table, hashing=hashing, mode=mode, config=config, after=after,
                                          **kw))  # type: ignore

    return jax.jit(jax.shard_map(body, mesh=table.ctx.mesh, in_specs=(bs, bs) if ordered else (bs,),
                                 out_specs=bs))


def engram_local(params: Params, hidden: jax.Array, token_ids: Optional[jax.Array] = None, *, table: EngramTable,
                 hashing: EngramHashing = EngramHashing(), mode: EngramMode = "fill",
                 after: Optional[jax.Array] = None,
                 pending: EngramPending | GlobalEngramPending | None = None) -> jax.Array:
    """Per-rank Engram layer (inside ``shard_map`` over ``table.ctx``'s axis).

    hidden [B, S, H] (this rank's sequences). Give exactly one of token_ids int [B, S] (lookup here, with
    ``mode`` and ``after``, which orders it after another jax_engram op) or ``pending``, this rank's
    :func:`engram_prefetch` of the same [B, S] positions (its wait is ordered after ``hidden``: the work that
    produced hidden overlaps the reads). FP8 tables: rows are scaled by their scale factors
    (:func:`engram_dequantize`). Returns [B, S, H] of hidden's dtype; differentiable in params and hidden.
    """
    where = "jax_engram.layers.engram_local"
    B, S, H = hidden.shape
    _check_gate(params, H, table.hidden, hashing, where)
    if (token_ids is None) == (pending is None):
        raise TypeError(f"{where}: give exactly one of token_ids or pending")
    if pending is None:
        ids = engram_ids(token_ids, hashing=hashing, total_entries=table.total_entries)
        data, sf = table.lookup(ids.reshape(B * S, hashing.num_heads), after=after, mode=mode)
    else:
        if after is not None or mode != "fill":
            raise ValueError(f"{where}: mode and after apply to the lookup from token_ids; a pending lookup took "
                             "them at engram_prefetch")
        pend = _local_pending(pending, where)
        want = (B * S, hashing.num_heads * table.hidden)
        if tuple(pend.data.shape) != want:
            raise ValueError(f"{where}: the pending lookup has {pend.data.shape[0]} positions of "
                             f"{pend.data.shape[1]} elements, the layer needs [B*S, num_heads*memory_dim] = "
                             f"{list(want)} (hidden {list(hidden.shape)}); prefetch the same tokens with the same "
                             "hashing and table")
        data, sf = table.wait(pend, after=hidden)
    mem = _dequantize(data.reshape(B, S, -1), None if sf is None else sf.reshape(B, S, -1), table.hidden,
                      table.sf_dtype)
    return engram_gate_add(params, hidden, mem)


def _axis(ctx) -> Any:
    return ctx.axis_name


def _batch_spec(ctx) -> P:
    """Tokens are sharded along the batch over every mesh axis, the context's last: each EP group (one per
    position on the other axes, e.g. data-parallel replicas) gets its own slice of the batch."""
    ax = ctx.axis_name
    own = tuple(ax) if isinstance(ax, (tuple, list)) else (ax,)
    others = tuple(a for a in ctx.mesh.axis_names if a not in own)
    axes = others + own
    return P(axes if len(axes) > 1 else axes[0])


def engram_layer(params: Params, hidden: jax.Array, token_ids: Optional[jax.Array] = None, *, table: EngramTable,
                 hashing: EngramHashing = EngramHashing(), mode: EngramMode = "fill",
                 pending: GlobalEngramPending | EngramPending | None = None) -> jax.Array:
    """Engram layer on global arrays: hidden [B, S, H] and token_ids int [B, S], both sharded (or shardable)
    along B over the mesh (the context's axis last; B a multiple of the mesh's devices); params ``w_key`` / ``w_value``
    [num_heads*table.hidden, H] replicated. Instead of token_ids, ``pending``: what :func:`engram_prefetch`
    returned for the same tokens at the start of the step (the wait is ordered after ``hidden``). Returns hidden
    after the gated add, [B, S, H], sharded like it. Differentiable in params and hidden (the table is memory,
    not a parameter: no gradient reaches it).

    Inside your own ``shard_map`` over ``table.ctx``'s axis this is :func:`engram_local` (local shapes, no
    second shard_map)."""
    if _inside_shard_map(table.ctx):
        return engram_local(params, hidden, token_ids, table=table, hashing=hashing, mode=mode, pending=pending)
    where = "jax_engram.engram_layer"
    if (token_ids is None) == (pending is None):
        raise TypeError(f"{where}: give exactly one of token_ids or pending")
    if pending is not None:
        if isinstance(pending, EngramPending):
            raise TypeError(f"{where}: this EngramPending is one rank's (from table.fetch or engram_prefetch inside "
                            "shard_map); outside shard_map pass what engram_prefetch returns there "
                            "(a GlobalEngramPending)")
        if not isinstance(pending, GlobalEngramPending):
            raise TypeError(f"{where}: pending must be what engram_prefetch returned, got {type(pending).__name__}")
        if mode != "fill":
            raise ValueError(f"{where}: mode applies to the lookup from token_ids; a pending lookup took it at "
                             "engram_prefetch")
    _check_gate(params, hidden.shape[-1], table.hidden, hashing, where)
    fn = _engram_fn(table, hashing, mode, tuple(params), pending is not None)
    return fn(dict(params), hidden, token_ids if pending is None else pending)


@functools.lru_cache(maxsize=64)
def _engram_fn(table: EngramTable, hashing: EngramHashing, mode: str, keys: tuple[str, ...], prefetched: bool):
    # jit around the shard_map: inlined under an outer jit, and an eager call runs one compiled program (op by op,
    # the fetch/wait pair would be compiled apart). Cached so that eager calls do not retrace.
    ctx = table.ctx
    bs = _batch_spec(ctx)

    def body(p, h, t):
        if prefetched:
            return engram_local(p, h, table=table, hashing=hashing, pending=t)
        return engram_local(p, h, t, table=table, hashing=hashing, mode=mode)  # type: ignore[arg-type]

    return jax.jit(jax.shard_map(body, mesh=ctx.mesh, in_specs=({k: P() for k in keys}, bs, bs), out_specs=bs))


def engram_layer_reference(params: Params, hidden: jax.Array, token_ids: jax.Array, *, table_rows: jax.Array,
                           num_ranks: int, hashing: EngramHashing = EngramHashing(),
                           sf_rows: Optional[jax.Array] = None) -> jax.Array:
    """Global-view pure-JAX twin of :func:`engram_layer` (the lookup by :func:`jax_engram.reference.engram_lookup`).

    table_rows: the whole table [num_ranks*num_entries, memory_dim] as written; sf_rows: its scale factors
    [num_ranks*num_entries, P] (float32 or packed int32, see :func:`engram_dequantize`) or None. Shapes as
    :func:`engram_layer`.
    """
    from jax_engram import reference as ref

    B, S, H = hidden.shape
    total, d = table_rows.shape
    _check_gate(params, H, d, hashing, "jax_engram.layers.engram_layer_reference")
    ids = engram_ids(token_ids, hashing=hashing, total_entries=total)
    data, sf = ref.engram_lookup(jnp.asarray(table_rows).reshape(num_ranks, total // num_ranks, d),
                                 ids.reshape(B * S, hashing.num_heads), sf_table=sf_rows)
    mem = _dequantize(data.reshape(B, S, -1), None if sf is None else sf.reshape(B, S, -1), d,
                      None if sf_rows is None else jnp.asarray(sf_rows).dtype)
    return engram_gate_add(params, hidden, mem)


# ------------------------------------------------------------------------------------------------- MoE
def route(router: jax.Array, x: jax.Array, top_k: int, num_tokens: Optional[jax.Array] = None
          ) -> tuple[jax.Array, jax.Array]:
    """Softmax router, top-k, weights renormalised over the top-k.

    router [H, num_experts]; x [..., N, H]. Returns ``(topk_idx int32 [..., N, top_k], topk_weights float32
    [..., N, top_k])``; tokens at positions >= num_tokens (padding; int32 [...] or None) route nowhere (-1, 0).
    """
    probs = jax.nn.softmax(x.astype(jnp.float32) @ router.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    if num_tokens is not None:
        real = (jnp.arange(x.shape[-2]) < jnp.asarray(num_tokens)[..., None])[..., None]
        idx = jnp.where(real, idx, -1)
        w = jnp.where(real, w, 0.0)
    return idx.astype(jnp.int32), w


def moe_experts(recv_x: jax.Array, w_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array, *,
                activation: Activation = jax.nn.gelu) -> jax.Array:
    """The local experts on an expand layout: ``act(x @ w_up[e]) @ w_down[e]`` per segment (f32 math).

    recv_x [rows, H]; w_up [E_loc, H, F]; w_down [E_loc, F, H]; group_sizes int32 [E_loc] (rows per expert,
    alignment included; rows past their sum are left unspecified by ragged_dot). Returns float32 [rows, H].
    """
    h = jax.lax.ragged_dot(recv_x.astype(jnp.float32), w_up.astype(jnp.float32), group_sizes)
    return jax.lax.ragged_dot(activation(h), w_down.astype(jnp.float32), group_sizes)


def moe_local(params: Params, x: jax.Array, *, ctx: AnyContext, top_k: int, expert_alignment: int = 8,
              activation: Activation = jax.nn.gelu, max_tokens_per_rank: Optional[int] = None,
              num_tokens: Optional[jax.Array] = None, after: Optional[jax.Array] = None) -> jax.Array:
    """Per-rank MoE layer (inside ``shard_map`` over ``ctx``'s axis).

    params: ``router`` [H, num_experts] (replicated), ``w_up`` [E_loc, H, F], ``w_down`` [E_loc, F, H] (this
    rank's experts). x [N, H] (bf16, f16 or f32; the combine runs in x's dtype, so use bf16 on GPUs).
    max_tokens_per_rank: static bound (default N). num_tokens: real tokens (int32 [], the rest is padding).
    after: orders the dispatch after another jax_engram op (its ``done``). Returns [N, H] of x's dtype.
    """
    num_experts = params["router"].shape[-1]
    idx, w = route(params["router"], x, top_k, num_tokens)
    res = _ep.dispatch(x, idx, w, ctx=ctx, num_experts=num_experts,
                       max_tokens_per_rank=x.shape[0] if max_tokens_per_rank is None else max_tokens_per_rank,
                       expand=True, expert_alignment=expert_alignment, zero_padding=True, after=after)
    y = moe_experts(res.recv_x, params["w_up"], params["w_down"], res.group_sizes, activation=activation)
    y = y * res.recv_topk_weights[:, None]  # combine is an unweighted sum: the routing weights apply here
    return _ep.combine(y.astype(x.dtype), res.handle).combined_x


_MOE_SPECS = {"router": P(), "w_up": "ep", "w_down": "ep"}


def _moe_specs(params: Params, ax) -> dict:
    return {k: (P(ax) if _MOE_SPECS.get(k) == "ep" else P()) for k in params}


def moe_layer(params: Params, x: jax.Array, *, ctx: AnyContext, top_k: int, expert_alignment: int = 8,
              activation: Activation = jax.nn.gelu) -> jax.Array:
    """Expert-parallel MoE layer on global arrays.

    params: ``router`` [H, num_experts] replicated, ``w_up`` [num_experts, H, F] and ``w_down``
    [num_experts, F, H] sharded along the expert axis over ``ctx``'s axis (replicated over the mesh's other
    axes). x [B, ..., H] sharded (or shardable) along B over the mesh, the context's axis last (B a multiple of
    the mesh's devices: every EP group gets its own slice). Returns [B, ..., H] of x's dtype,
    sharded like x. Differentiable in params and x.
    """
    return _moe_fn(ctx, top_k, expert_alignment, activation, tuple(params))(dict(params), x)


@functools.lru_cache(maxsize=64)
def _moe_fn(ctx: AnyContext, top_k: int, expert_alignment: int, activation: Activation, keys: tuple[str, ...]):
    ax = _axis(ctx)

    def body(p, xl):
        shape = xl.shape
        out = moe_local(p, xl.reshape(-1, shape[-1]), ctx=ctx, top_k=top_k, expert_alignment=expert_alignment,
                        activation=activation)
        return out.reshape(shape)

    specs = {k: (P(ax) if _MOE_SPECS.get(k) == "ep" else P()) for k in keys}
    bs = _batch_spec(ctx)
    return jax.jit(jax.shard_map(body, mesh=ctx.mesh, in_specs=(specs, bs), out_specs=bs))


def moe_layer_reference(params: Params, x: jax.Array, *, num_ranks: int, top_k: int, expert_alignment: int = 8,
                        activation: Activation = jax.nn.gelu) -> jax.Array:
    """Global-view pure-JAX twin of :func:`moe_layer`. bfloat16 x: on :mod:`jax_engram.reference` (same
    numerics: the same dispatch layout, f32 GEMMs, bf16 combine sums). Other dtypes: the textbook dense
    definition ``out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t])`` (f32 math; equal up to summation order).
    Shapes as :func:`moe_layer` (params global)."""
    from jax_engram import reference as ref

    shape = x.shape
    R, H = num_ranks, shape[-1]
    xr = x.reshape(R, -1, H)
    M = xr.shape[1]
    num_experts = params["router"].shape[-1]
    E_loc = num_experts // R
    idx, w = route(params["router"], xr, top_k)
    if x.dtype != jnp.bfloat16:
        xf = xr.astype(jnp.float32)
        h = activation(jnp.einsum("rnh,ehf->rnef", xf, params["w_up"].astype(jnp.float32)))
        y = jnp.einsum("rnef,efh->rneh", h, params["w_down"].astype(jnp.float32))  # every expert, every token
        sel = jax.nn.one_hot(idx, num_experts, dtype=jnp.float32)  # [R, N, K, E]
        return jnp.einsum("rnke,rnk,rneh->rnh", sel, w, y).astype(x.dtype).reshape(shape)
    d = ref.ep_dispatch(xr, idx, w, num_experts=num_experts, max_tokens_per_rank=M, expand=True,
                        expert_alignment=expert_alignment, zero_padding=True)
    w_up = params["w_up"].reshape((R, E_loc) + params["w_up"].shape[1:])
    w_down = params["w_down"].reshape((R, E_loc) + params["w_down"].shape[1:])
    y = jax.vmap(lambda a, b, c, g: moe_experts(a, b, c, g, activation=activation))(
        d["recv_x"], w_up, w_down, d["group_sizes"])
    y = y * d["recv_topk_weights"][..., None]
    out, _ = ref.ep_combine(y.astype(x.dtype), d, idx, num_experts=num_experts, max_tokens_per_rank=M,
                            expand=True)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------- parameters
def init_moe_params(key: jax.Array, *, hidden: int, ffn: int, num_experts: int,
                    dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    """Global MoE parameters (host-side values; place them with :func:`put_global`): ``router``
    [hidden, num_experts], ``w_up`` [num_experts, hidden, ffn], ``w_down`` [num_experts, ffn, hidden]."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "router": (jax.random.normal(k1, (hidden, num_experts)) / math.sqrt(hidden)).astype(dtype),
        "w_up": (jax.random.normal(k2, (num_experts, hidden, ffn)) / math.sqrt(hidden)).astype(dtype),
        "w_down": (jax.random.normal(k3, (num_experts, ffn, hidden)) / math.sqrt(ffn)).astype(dtype),
    }


def init_engram_params(key: jax.Array, *, hidden: int, memory_dim: int, num_heads: int,
                       dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    """Engram gate parameters: ``w_key``, ``w_value`` [num_heads*memory_dim, hidden]."""
    k1, k2 = jax.random.split(key)
    m = num_heads * memory_dim
    return {"w_key": (jax.random.normal(k1, (m, hidden)) / math.sqrt(m)).astype(dtype),
            "w_value": (jax.random.normal(k2, (m, hidden)) / math.sqrt(m)).astype(dtype)}


def put_global(a: Any, ctx: AnyContext, spec: P) -> jax.Array:
    """A host value that every process holds in full -> a global jax.Array on ``ctx.mesh`` with ``spec``
    (works with several processes, where ``jax.device_put`` of a host array cannot address remote devices)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return a
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, NamedSharding(ctx.mesh, spec), lambda idx: a[idx])


def batch_spec(ctx: AnyContext) -> P:
    """The PartitionSpec of the batch axis the global layers expect: every mesh axis, the context's last."""
    return _batch_spec(ctx)


def moe_param_specs(params: Params, ctx: AnyContext) -> dict[str, P]:
    """The PartitionSpecs :func:`moe_layer` expects: experts over ``ctx``'s axis, the router replicated."""
    return _moe_specs(params, _axis(ctx))
