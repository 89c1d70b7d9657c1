"""The EP ops' types and layout figures, shared by the flat and the hierarchical paths: the static
configuration of a dispatch (``DispatchConfig``, the handle's aux data), the result pytrees (``EPHandle``,
``DispatchResult``, ``CombineResult``) and the figures of the native layout header. Public names are re-exported
by :mod:`jax_engram.ep`."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_engram import _ffi
from jax_engram.config import EPConfig

X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
SF_DTYPES = (jnp.float32, jnp.int32)
COMBINE_DTYPES = (jnp.bfloat16, jnp.float32)


# ------------------------------------------------------------------------------------------- layout figures
# Every figure and limit comes from the native layout header (ffi/include/jax_engram/ep_layout.h) through the CPU
# module, which is always built; nothing here computes its own copy.
_layout = _ffi.native("cpu")
MAX_TOPK: int = _layout.ep_limits["max_topk"]
MAX_LOCAL_EXPERTS: int = _layout.ep_limits["max_local_experts"]
MAX_EXPERTS: int = _layout.ep_limits["max_experts"]
BAD_DUPLICATE_EXPERT: int = _layout.ep_bad_kinds["duplicate_expert"]  # EpBadKind of a routing record
BAD_EXPERT_RANGE: int = _layout.ep_bad_kinds["expert_range"]


def local_dispatch_scratch_words(num_tokens: int, topk: int, num_experts: int) -> int:
    """int32 words of the one-rank dispatch call's scratch (ep_local_dispatch_scratch_words; 0: none)."""
    return int(_layout.ep_local_dispatch_scratch_words(num_tokens, topk, num_experts))


def expand_rows(R: int, M: int, K: int, E_loc: int, A: int) -> int:
    """Rows of the expand receive layout: ``align(R*M*min(K,E_loc) + (A-1)*E_loc, A)`` (ep_rows_expand)."""
    return int(_layout.ep_rows(True, R, M, K, E_loc, A))


def dispatch_staging_bytes(R: int, M: int, K: int, E: int, hidden_bytes: int, num_scales: int,
                           push: bool = False) -> int:
    """Bytes of a dispatch staging region (EpDispatchLayout::total_bytes in ep_layout.h); ``push`` is the CUDA
    protocol (inbox slots on the receiver instead of staged rows on the sender)."""
    return int(_layout.ep_dispatch_bytes(R, M, K, E, hidden_bytes, num_scales, bool(push)))


def combine_staging_bytes(R: int, M: int, K: int, hidden_bytes: int, push: bool = False) -> int:
    """Bytes of a combine staging region (EpCombineLayout::total_bytes in ep_layout.h)."""
    return int(_layout.ep_combine_bytes(R, M, K, hidden_bytes, bool(push)))


# --------------------------------------------------------------------------------------------- pytrees
@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Static configuration of a dispatch (aux data of its handle)."""

    ctx: Any
    num_ranks: int
    num_experts: int
    max_tokens_per_rank: int
    num_tokens: int
    topk: int
    expand: bool
    expert_alignment: int
    num_sms: int
    ep: EPConfig = EPConfig()

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows(self) -> int:
        return int(_layout.ep_rows(self.expand, self.num_ranks, self.max_tokens_per_rank, self.topk,
                                   self.num_local_experts, self.expert_alignment))

    @property
    def token_rows(self) -> int:
        return self.num_ranks * self.max_tokens_per_rank

    def attrs(self) -> dict:
        """The attributes every EP op of this config passes (EpDispatchAttrs / EpCombineAttrs in ep_bindings.h)."""
        return dict(num_experts=self.num_experts, max_tokens_per_rank=self.max_tokens_per_rank,
                    expand=int(self.expand), num_sms=self.num_sms)

    def dispatch_attrs(self, copy_pieces: int, zero_padding: bool) -> dict:
        return dict(self.attrs(), expert_alignment=self.expert_alignment, zero_padding=int(zero_padding),
                    copy_pieces=copy_pieces, stage_warps=self.ep.dispatch_stage_warps or 0)

    def combine_attrs(self) -> dict:
        return dict(self.attrs(), stage_warps=self.ep.combine_stage_warps or 0)


HANDLE_FIELDS = ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_row", "topk_idx",
                  "num_recv_tokens", "group_sizes", "recv_topk_idx", "done")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(HANDLE_FIELDS), meta_fields=["config"])
@dataclasses.dataclass(frozen=True, repr=False)
class EPHandle:
    """What combine and cached dispatch need to reverse / replay a dispatch: a frozen pytree (device arrays
    are leaves, the static configuration ``config`` is aux data). Per rank (inside ``shard_map``), with R
    ranks, M = max_tokens_per_rank, N tokens of this rank, K = top-k, E_loc = num_experts / R:

    * ``psum_num_recv_tokens_per_rank`` int32 [R]: inclusive prefix sum of tokens received per source rank.
    * ``psum_num_recv_tokens_per_expert`` int32 [E_loc]: non-expand, inclusive prefix sum of the aligned
      counts; expand, ``start[e] + count[e]``.
    * ``num_unaligned_recv_tokens_per_expert`` int32 [E_loc].
    * ``recv_src_metadata`` int32 [R*M, K+2]: ``[:, 0]`` source global id ``src_rank*M + t``, ``[:, 1]``
      ``src_rank*K + master_k``, ``[:, 2+k]`` expand row of top-k position k, or -1.
    * ``dst_row`` int32 [N, R]: row of my token t in rank d's non-expand layout, or -1 (DeepEP's dst slot).
    * ``topk_idx`` int32 [N, K]; ``num_recv_tokens`` int32 []; ``group_sizes`` int32 [E_loc];
      ``recv_topk_idx`` int32 [R*M, K] (non-expand) or None (expand).
    * ``done`` float32 []: orders the next EP op after this dispatch (its ``after=``).
    """

    psum_num_recv_tokens_per_rank: jax.Array
    psum_num_recv_tokens_per_expert: jax.Array
    num_unaligned_recv_tokens_per_expert: jax.Array
    recv_src_metadata: jax.Array
    dst_row: jax.Array
    topk_idx: jax.Array
    num_recv_tokens: jax.Array
    group_sizes: jax.Array
    recv_topk_idx: Optional[jax.Array]
    done: jax.Array
    config: DispatchConfig

    def replace(self, **changes: Any) -> "EPHandle":
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    # DeepEP-style accessors
    dst_slot = property(lambda self: self.dst_row)
    do_expand = property(lambda self: self.config.expand)
    num_experts = property(lambda self: self.config.num_experts)
    expert_alignment = property(lambda self: self.config.expert_alignment)
    num_max_tokens_per_rank = property(lambda self: self.config.max_tokens_per_rank)
    num_sms = property(lambda self: self.config.num_sms)
    ctx = property(lambda self: self.config.ctx)

    def __repr__(self) -> str:
        c = self.config
        return (f"EPHandle(ranks={c.num_ranks}, num_experts={c.num_experts}, max_tokens_per_rank="
                f"{c.max_tokens_per_rank}, num_tokens={c.num_tokens}, topk={c.topk}, expand={c.expand}, "
                f"expert_alignment={c.expert_alignment})")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                                "num_recv_tokens", "group_sizes", "handle", "done"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """What :func:`dispatch` returns (a frozen pytree). Per rank, rows = the receive layout's static row count
    (non-expand ``R*M``, expand :func:`expand_rows`), H hidden, P scale packs, K top-k, E_loc local experts:

    * ``recv_x`` [rows, H] of x's dtype; ``recv_x_scales`` [rows, P] or None (no ``x_scales``).
    * ``recv_topk_idx`` int32 [R*M, K] local expert ids (non-expand; -1 = not on this rank) or None (expand).
    * ``recv_topk_weights`` float32 (non-expand [R*M, K], expand [rows]) or None (no ``topk_weights``).
    * ``num_recv_tokens`` int32 []: real rows (non-expand) / real (token, k) rows (expand).
    * ``group_sizes`` int32 [E_loc]: rows per local expert, alignment included (``jax.lax.ragged_dot``).
    * ``handle``: the :class:`EPHandle` for :func:`combine` and cached dispatch.
    * ``done`` float32 []: orders a later EP op after this one (its ``after=``).
    """

    recv_x: jax.Array
    recv_x_scales: Optional[jax.Array]
    recv_topk_idx: Optional[jax.Array]
    recv_topk_weights: Optional[jax.Array]
    num_recv_tokens: jax.Array
    group_sizes: jax.Array
    handle: EPHandle
    done: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["combined_x", "combined_topk_weights", "done"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CombineResult:
    """What :func:`combine` returns (a frozen pytree), per rank with N tokens, H hidden, K top-k:

    * ``combined_x`` [N, H] of y's dtype: the reduced expert outputs of every token.
    * ``combined_topk_weights`` float32 [N, K] or None (no ``topk_weights`` passed).
    * ``done`` float32 []: orders a later EP op after this combine (its ``after=``).
    """

    combined_x: jax.Array
    combined_topk_weights: Optional[jax.Array]
    done: jax.Array


