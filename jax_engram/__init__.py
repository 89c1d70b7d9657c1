"""jax_engram: DeepEP V2's communication primitives (Engram lookup, MoE dispatch/combine) as JAX ops."""
from jax_engram.config import EngramConfig
from jax_engram.context import Context, JaxEngramError, Region, init, live_contexts
from jax_engram.ops import barrier, ring_exchange
from jax_engram.ep import DispatchResult, EPHandle, combine, dispatch
from jax_engram.engram import ENGRAM_DTYPES, ENGRAM_MODES, SF_LAYOUTS, EngramPending, EngramTable

__version__ = "0.1.0"

__all__ = ["Context", "JaxEngramError", "Region", "init", "live_contexts", "barrier", "ring_exchange",
           "EngramTable", "EngramPending", "EngramConfig", "ENGRAM_DTYPES", "ENGRAM_MODES", "SF_LAYOUTS",
           "dispatch", "combine", "DispatchResult", "EPHandle", "__version__"]
