"""jax_engram: DeepEP V2's communication primitives (Engram lookup, MoE dispatch/combine) as JAX ops."""
from jax_engram.context import Context, JaxEngramError, Region, init, live_contexts
from jax_engram.ops import barrier, ring_exchange

__version__ = "0.1.0"

__all__ = ["Context", "JaxEngramError", "Region", "init", "live_contexts", "barrier", "ring_exchange",
           "__version__"]
