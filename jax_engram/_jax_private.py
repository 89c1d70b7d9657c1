"""The one module that reaches into jax's private modules (``jax._src``), each use guarded: a jax that moved what is
used here fails with a clear error naming it, never with an ImportError from deep inside an op."""
from __future__ import annotations

import jax


def _missing(what: str, e: Exception) -> RuntimeError:
    return RuntimeError(f"jax_engram needs {what}, which jax {jax.__version__} does not provide where expected: {e}")


def kv_client():
    """jax.distributed's key-value client, or None before ``jax.distributed.initialize``."""
    try:
        from jax._src.distributed import global_state
    except ImportError as e:
        raise _missing("jax.distributed's key-value client (jax._src.distributed.global_state)", e) from None
    return global_state.client


def backends_initialized() -> bool:
    """Whether jax has started its backends (after which the platform and CPU device count are fixed)."""
    try:
        from jax._src import xla_bridge
    except ImportError as e:
        raise _missing("jax._src.xla_bridge.backends_are_initialized", e) from None
    return bool(xla_bridge.backends_are_initialized())


def ffi_effect():
    """The effect of a side-effecting ``jax.ffi.ffi_call`` (what keeps it from being dead-code eliminated); a
    primitive with this effect is kept and allowed wherever jax_engram's FFI calls are."""
    try:
        from jax._src.ffi import _FfiEffect
    except ImportError as e:
        raise _missing("jax._src.ffi._FfiEffect", e) from None
    return _FfiEffect


def register_dce_rule(primitive, rule) -> None:
    """Installs ``rule(used_outputs, eqn) -> (used_inputs, eqn or None)`` as ``primitive``'s dead-code elimination
    rule (``jax._src.interpreters.partial_eval.dce_rules``)."""
    try:
        from jax._src.interpreters.partial_eval import dce_rules
    except ImportError as e:
        raise _missing("jax._src.interpreters.partial_eval.dce_rules", e) from None
    dce_rules[primitive] = rule


def in_eager_shard_map() -> bool:
    """Whether the innermost trace is an eager (not jitted) ``jax.shard_map``, which runs every primitive as a
    program of its own."""
    try:
        from jax._src import core
        from jax._src.shard_map import ShardMapTrace
    except ImportError as e:
        raise _missing("jax._src.shard_map.ShardMapTrace", e) from None
    return isinstance(core.trace_ctx.trace, ShardMapTrace)


def runtime_tokens():
    """jax's record of the last execution with side effects on each device (``jax._src.dispatch.runtime_tokens``):
    ``output_runtime_tokens`` {device: token}; a failed execution stays there and is raised again at exit."""
    try:
        from jax._src.dispatch import runtime_tokens as tokens
    except ImportError as e:
        raise _missing("jax._src.dispatch.runtime_tokens", e) from None
    return tokens


def tracing() -> bool:
    """Whether a function is being traced (inside ``jax.jit``, ``jax.grad``, ...), whatever the arrays at hand are:
    a concrete array captured by a jitted function is not a tracer, yet the call is staged."""
    try:
        from jax._src.core import trace_state_clean
    except ImportError as e:
        raise _missing("jax._src.core.trace_state_clean", e) from None
    return not trace_state_clean()
