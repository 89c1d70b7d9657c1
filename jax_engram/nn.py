"""Flax NNX modules on jax_engram (``pip install jax-engram[nn]``): :class:`EngramMemory` and :class:`MoE`.

Both are called on global arrays (tokens sharded along the batch axis over the context's mesh axis) and open
their own ``shard_map`` inside: drop them into a model as any other NNX layer::

    ctx = jax_engram.init(mesh, "ep")
    mem = EngramMemory(hidden=512, ctx=ctx, memory_dim=64, buckets_per_head=1 << 16, rngs=nnx.Rngs(0))
    moe = MoE(hidden=512, ffn=1024, num_experts=4 * ctx.num_ranks, top_k=2, ctx=ctx, rngs=nnx.Rngs(1))
    h = mem(x, token_ids)           # x [B, S, 512], token_ids int [B, S]; B a multiple of the ranks
    y = h + moe(h)

Prefetch: ``pending = mem.prefetch(token_ids)`` at the start of the step (the ids need only the tokens), then
``mem(x, pending=pending)`` at the layer; the reads run while the layers before it compute. Both also work inside
your own ``shard_map`` over the context's axis (local shapes, no second shard_map) and in a model jitted as a
whole (``nnx.jit``, ``nnx.value_and_grad``)::

    def __call__(self, token_ids):
        pending = []
        for m in self.memories:                                    # every Engram layer, at step start, in order
            pending.append(m.prefetch(token_ids, after=pending[-1] if pending else None))
        x = je.start_before(self.embed(token_ids), *pending)       # the fetches are issued before the blocks
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.engram_at:
                x = self.memories[self.engram_at.index(i)](x, pending=pending[self.engram_at.index(i)])

Gradients flow to x and to every ``nnx.Param``: the router and the Engram gate projections are replicated,
the experts' ``w_up`` / ``w_down`` are sharded over the EP axis (rank r holds experts r*E_loc..). The Engram
table is memory, not a parameter: it lives in jax_engram's symmetric windows (``placement="host"``: host
memory, ``"device"``: HBM), is written at construction (or with :meth:`EngramMemory.write_table`) and is
read by id; no gradient reaches it. Construct modules eagerly (not under ``nnx.eval_shape``): the table is a
collective allocation and write.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("jax_engram.nn needs Flax (NNX): pip install 'jax-engram[nn]' (or pip install flax)") from e

from jax_engram import layers as L
from jax_engram.context import AnyContext
from jax_engram.engram import EngramPending, EngramTable

__all__ = ["EngramMemory", "MoE"]


def _seed(rngs: nnx.Rngs) -> int:
    return int(jax.random.randint(rngs.params(), (), 0, np.iinfo(np.int32).max))


class EngramMemory(nnx.Module):
    """Engram memory: hashed n-gram lookup in a table sharded over the context's ranks, gated into the hidden
    state (see :mod:`jax_engram.layers` for the math).

    Args:
      hidden: H, the model width.
      ctx: the context from :func:`jax_engram.init` (the EP group the table is sharded over; one mesh axis or
        ``("node", "gpu")``).
      memory_dim: elements per table row (each head's embedding width).
      buckets_per_head: rows each (order, hash head) addresses; the table has
        ``buckets_per_head * hashing.num_heads`` rows (rounded up to a multiple of the ranks).
      hashing: n-gram orders and hash heads (default 2- and 3-grams, 4 heads each).
      placement: ``"host"`` (host memory, read over PCIe/C2C on GPUs) or ``"device"`` (HBM).
      table_dtype: bfloat16, float16, float32 or float8_e4m3fn (FP8 rows with per-block scale factors: the
        module quantizes the rows it writes with :func:`jax_engram.layers.engram_quantize`, and the layer scales
        the rows it reads back).
      num_sf_packs: scale-factor packs per row of an FP8 table (default 1: one float32 scale per row, or with
        ``sf_dtype=int32`` four UE8M0 exponents, one per quarter row); 0 otherwise.
      sf_dtype: float32 scales or int32 packs of UE8M0 exponents (FP8 tables).
      table_init_scale: the initial rows are normal(0, table_init_scale) (ignored with ``table_rows``).
      table_rows: optional initial rows [num_rows, memory_dim] (host array, the same on every process).
      rngs: ``nnx.Rngs`` for the parameters and the initial table.

    Call: ``mem(x, token_ids)`` with x [B, S, H], token_ids int [B, S] -> [B, S, H] of x's dtype; or
    ``mem(x, pending=mem.prefetch(token_ids))`` (the lookup started earlier in the same jitted program).
    Decode: ``ids, state = mem.decode_ids(state, new_token_ids)`` then ``mem(x, pending=mem.prefetch(ids=ids[:,
    None]))`` with x [B, 1, H] (state from :func:`jax_engram.layers.engram_decode_init`).
    """

    def __init__(self, hidden: int, *, ctx: AnyContext, memory_dim: int = 64, buckets_per_head: int = 1 << 14,
                 hashing: L.EngramHashing = L.EngramHashing(), placement: Literal["host", "device"] = "host",
                 table_dtype: Any = jnp.bfloat16, num_sf_packs: Optional[int] = None, sf_dtype: Any = np.float32,
                 table_init_scale: float = 1.0, table_rows: Optional[np.ndarray] = None, rngs: nnx.Rngs):
        self.ctx = ctx
        self.hashing = hashing
        R = ctx.num_ranks
        rows = buckets_per_head * hashing.num_heads
        num_entries = -(-rows // R)
        if num_sf_packs is None:
            num_sf_packs = 1 if np.dtype(table_dtype) == np.dtype(jnp.float8_e4m3fn) else 0
        self.table = EngramTable(num_entries, memory_dim, table_dtype, ctx=ctx, placement=placement,
                                 num_sf_packs=num_sf_packs, sf_dtype=sf_dtype)
        if table_rows is None:
            rng = np.random.default_rng(_seed(rngs))
            table_rows = rng.standard_normal((R * num_entries, memory_dim), np.float32) * table_init_scale
        self.write_table(table_rows)
        p = L.init_engram_params(rngs.params(), hidden=hidden, memory_dim=memory_dim, num_heads=hashing.num_heads)
        self.w_key = nnx.Param(L.put_global(p["w_key"], ctx, P()))
        self.w_value = nnx.Param(L.put_global(p["w_value"], ctx, P()))

    def write_table(self, rows: np.ndarray | jax.Array, sf: np.ndarray | jax.Array | None = None) -> None:
        """Collective: replace the table's rows ([table.total_entries, memory_dim]; a host array is cast to the
        table's dtype; fewer rows are padded with zeros). FP8 tables: give the rows as numbers (any float dtype;
        quantized here with :func:`jax_engram.layers.engram_quantize`), or already quantized float8_e4m3fn rows
        with their scale factors ``sf`` [table.total_entries, num_sf_packs]."""
        t = self.table
        if np.ndim(rows) != 2 or np.shape(rows)[1] != t.hidden:
            raise ValueError(f"EngramMemory.write_table: rows must be [num_rows, memory_dim={t.hidden}], got "
                             f"{np.shape(rows)}")
        if not isinstance(rows, jax.Array) and np.shape(rows)[0] < t.total_entries:
            rows = np.asarray(rows)
            rows = np.concatenate([rows, np.zeros((t.total_entries - rows.shape[0],) + rows.shape[1:], rows.dtype)])
        if t.num_sf_packs and sf is None:
            if np.dtype(rows.dtype) == np.dtype(jnp.float8_e4m3fn):
                raise ValueError("EngramMemory.write_table: float8_e4m3fn rows need their scale factors sf "
                                 f"[{t.total_entries}, {t.num_sf_packs}] (or give the rows as numbers)")
            rows, sf = L.engram_quantize(np.asarray(rows, np.float32), num_sf_packs=t.num_sf_packs,
                                         sf_dtype=t.sf_dtype)
            rows, sf = np.asarray(rows), np.asarray(sf)
        elif sf is not None and not t.num_sf_packs:
            raise ValueError("EngramMemory.write_table: this table has no scale factors (num_sf_packs=0)")
        if not isinstance(rows, jax.Array):
            rows = np.asarray(rows).astype(t.dtype)
        jax.block_until_ready(t.write_global(rows, sf))

    def prefetch(self, token_ids: Optional[jax.Array] = None, *, ids: Optional[jax.Array] = None,
                 mode: L.EngramMode = "fill",
                 after: EngramPending | L.GlobalEngramPending | None = None) -> EngramPending | L.GlobalEngramPending:
        """Start this layer's lookups: :func:`jax_engram.layers.engram_prefetch` on the module's table and hashing
        (token_ids int [B, S], or ids int32 [B, S, num_heads]); pass the result to ``__call__(x, pending=)`` in the
        same jitted program. ``after``: an earlier layer's prefetch, issued before this one (rows in layer
        order)."""
        return L.engram_prefetch(self.table, token_ids, ids=ids, hashing=self.hashing, mode=mode, after=after)

    def decode_ids(self, state: L.EngramDecodeState, new_token_ids: jax.Array
                   ) -> tuple[jax.Array, L.EngramDecodeState]:
        """:func:`jax_engram.layers.engram_decode_ids` with this module's hashing and table: new_token_ids int [B]
        -> (ids int32 [B, num_heads], the next state)."""
        return L.engram_decode_ids(state, new_token_ids, hashing=self.hashing, total_entries=self.table.total_entries)

    def __call__(self, x: jax.Array, token_ids: Optional[jax.Array] = None, *,
                 pending: EngramPending | L.GlobalEngramPending | None = None) -> jax.Array:
        params = {"w_key": self.w_key[...], "w_value": self.w_value[...]}
        return L.engram_layer(params, x, token_ids, table=self.table, hashing=self.hashing, pending=pending)


class MoE(nnx.Module):
    """Expert-parallel mixture of experts: softmax router, top-k, expand dispatch, ``act(x W_up) W_down`` per
    expert with ``jax.lax.ragged_dot``, routing-weighted combine.

    Args:
      hidden, ffn: model width and expert intermediate width.
      num_experts: a multiple of ``ctx.num_ranks`` (each rank holds num_experts / ranks).
      top_k: experts per token.
      ctx: the context from :func:`jax_engram.init` (the EP group; one mesh axis or ``("node", "gpu")``).
      expert_alignment: rows per expert segment are padded to a multiple of it.
      activation: the expert nonlinearity (default gelu).
      param_dtype: dtype of the parameters (the GEMMs run in float32).
      rngs: ``nnx.Rngs``.

    Parameters: ``router`` [hidden, num_experts] replicated; ``w_up`` [num_experts, hidden, ffn] and
    ``w_down`` [num_experts, ffn, hidden] sharded over the EP axis.
    Call: ``moe(x)`` with x [B, ..., hidden] (B a multiple of the ranks) -> same shape and dtype.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *, ctx: AnyContext,
                 expert_alignment: int = 8, activation: L.Activation = jax.nn.gelu, param_dtype: Any = jnp.float32,
                 rngs: nnx.Rngs):
        if num_experts % ctx.num_ranks:
            raise ValueError(f"MoE: num_experts={num_experts} must be a multiple of the {ctx.num_ranks} ranks")
        self.ctx = ctx
        self.top_k = top_k
        self.expert_alignment = expert_alignment
        self.activation = activation
        p = L.init_moe_params(rngs.params(), hidden=hidden, ffn=ffn, num_experts=num_experts, dtype=param_dtype)
        specs = L.moe_param_specs(p, ctx)
        self.router = nnx.Param(L.put_global(p["router"], ctx, specs["router"]))
        self.w_up = nnx.Param(L.put_global(p["w_up"], ctx, specs["w_up"]))
        self.w_down = nnx.Param(L.put_global(p["w_down"], ctx, specs["w_down"]))

    def __call__(self, x: jax.Array) -> jax.Array:
        params = {"router": self.router.value, "w_up": self.w_up.value, "w_down": self.w_down.value}
        return L.moe_layer(params, x, ctx=self.ctx, top_k=self.top_k, expert_alignment=self.expert_alignment,
                           activation=self.activation)
