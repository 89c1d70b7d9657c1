"""The EP guard: the small native call that keeps the kernels' contract on paths that run no EP kernel (the
one-rank path, :mod:`jax_engram._ep_local`) and reports a group's routing records (:mod:`jax_engram._ep_args`), and
the rule that picks the one-rank path. Below both: it needs only :mod:`jax_engram._call`."""
from __future__ import annotations

from jax_engram import _call


def applies(ctx, ep_config) -> bool:
    """Whether the EP ops of this flat context take the one-rank path: one rank and ``EPConfig.one_rank ==
    "local"`` (the default; ``"kernels"`` runs the native kernels even then)."""
    return ctx.num_ranks == 1 and ep_config.one_rank == "local"


def guard_call(ctx, token, operand, *, combine: bool, num_experts: int, records: int):
    """The context's guard (``jax_engram_ep_guard``, EpGuardAttrs) over ``operand`` (a routing [N, K], or a
    group's routing records with ``records`` 1 / 2); the token comes back in its own buffer. Returns (token, the
    guard's copy of the operand)."""
    graph = ctx.cuda_graphs and ctx.platform != "cpu"  # as the kernels: the graph target where XLA may capture it
    return _call.call(ctx, "jax_engram_ep_guard_graph" if graph else "jax_engram_ep_guard",
                      [_call.like(token), _call.like(operand)], token, operand, input_output_aliases={0: 0},
                      combine=combine, num_experts=num_experts, records=records)
