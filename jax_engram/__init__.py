"""jax_engram: DeepEP V2's communication primitives (Engram lookup, MoE dispatch/combine) as JAX ops, and the
layers built on them (``moe_layer``, ``engram_layer``; Flax NNX modules in :mod:`jax_engram.nn`)."""
from jax_engram.config import EngramConfig, EPConfig
from jax_engram.context import AnyContext, Context, HierContext, JaxEngramError, Region, init, live_contexts
from jax_engram.ops import barrier, ring_exchange
from jax_engram.ep import CombineResult, DispatchResult, EPHandle, combine, dispatch
from jax_engram.engram import ENGRAM_DTYPES, ENGRAM_MODES, SF_LAYOUTS, EngramPending, EngramTable
from jax_engram.layers import EngramHashing, engram_layer, engram_prefetch, moe_layer, start_before

__version__ = "0.1.0"

__all__ = ["AnyContext", "Context", "HierContext", "JaxEngramError", "Region", "init", "live_contexts", "barrier",
           "ring_exchange",
           "EngramTable", "EngramPending", "EngramConfig", "ENGRAM_DTYPES", "ENGRAM_MODES", "SF_LAYOUTS",
           "dispatch", "combine", "DispatchResult", "CombineResult", "EPHandle", "EPConfig",
           "moe_layer", "engram_layer", "engram_prefetch", "start_before", "EngramHashing", "__version__"]
