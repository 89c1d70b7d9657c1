"""The contract as a user meets it (CPU): an op whose shard_map mesh places the devices differently from its
context's is refused naming both device orders (flat and ("node", "gpu") contexts); the exception each failing
call raises, once, with nothing printed at interpreter exit. The checks live in tests/workers/contract_check.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, WORKERS_DIR

WORKER = str(WORKERS_DIR / "contract_check.py")


def _run(*args, timeout=600):
    p = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=str(REPO_ROOT), env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1"))
    return p


def test_reordered_mesh_is_refused():
    p = _run("--case", "mesh")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    passed = [l for l in p.stdout.splitlines() if l.startswith("PASS ")]
    # 2 group shapes x (same mesh + 2 reordered meshes x 5 ops + eager refusal)
    assert len(passed) == 2 * (1 + 2 * 5 + 1), p.stdout


@pytest.mark.parametrize("kind,where", [("routing", "jit"), ("routing", "check"), ("validate_routing", "jit"),
                                        ("validate_routing", "check"), ("checked", "jit"), ("checked", "check"),
                                        ("checked", "global")])
def test_errors_raised_as_documented_once_and_not_at_exit(kind, where):
    """docs/semantics.md "Errors": inside jit, XLA's JaxRuntimeError carrying our message; ctx.check() after it
    (only for an error recorded in the context) and the *_global methods: JaxEngramError whose message starts with
    ``jax_engram``; nothing printed at exit."""
    p = _run("--case", "error", "--error", kind, "--where", where)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "END", p.stdout[-4000:] + p.stderr[-4000:]
    raised = [l[len("RAISED "):] for l in p.stdout.splitlines() if l.startswith("RAISED ")]
    assert len(raised) == (2 if where == "check" else 1), p.stdout
    if where == "check" and kind != "routing":  # the call raised it; check() does not raise it again
        assert raised.pop() == "nothing", raised
    first_type, first_msg = raised[0].split(" :: ", 1)
    want_op = {"routing": "jax_engram ep dispatch", "validate_routing": "jax_engram ep dispatch",
               "checked": "jax_engram engram fetch"}[kind]
    if where == "global":
        assert first_type == "jax_engram.context.JaxEngramError" and first_msg.startswith(want_op), raised
    else:
        assert first_type == "jax.errors.JaxRuntimeError" and want_op in first_msg, raised
        if kind == "validate_routing":  # the op's own error, not a host callback's traceback
            assert "(validate_routing=True): topk_idx of" in first_msg and "CpuCallback" not in first_msg, raised
    if len(raised) == 2:  # routing: recorded in the context, which is unusable
        t, msg = raised[1].split(" :: ", 1)
        assert t == "jax_engram.context.JaxEngramError" and msg.startswith(want_op), raised
    # Reported once: no log record of the callback's exception, nothing raised again at exit.
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-4000:]


def test_public_api_has_docstrings_and_real_signatures():
    """What help(jax_engram) shows a new user: every public callable, Context and HierContext method and property has
    its own docstring
    (not a source comment) and a signature with its real parameters (no bare *args, **kwargs)."""
    import inspect

    import jax_engram as je

    def params(fn):
        return list(inspect.signature(fn).parameters.values())

    names = [n for n in je.__all__ if callable(getattr(je, n)) and not n.startswith("_")]
    methods = [v.fget if isinstance(v, property) else getattr(cls, n)
               for cls in (je.Context, je.HierContext) for n, v in vars(cls).items()
               if not n.startswith("_") and (callable(getattr(cls, n)) or isinstance(v, property))]
    assert len(names) >= 15 and len(methods) >= 24, (names, methods)
    for obj in [getattr(je, n) for n in names] + methods:
        doc = inspect.getdoc(obj)
        assert doc and len(doc) > 20, f"{obj} has no docstring"
        assert "module docstring" not in doc and "_scaleout" not in doc, f"{obj}: {doc[:200]}"
        if inspect.isclass(obj) and (issubclass(obj, BaseException) or getattr(obj, "_is_protocol", False)):
            continue  # an exception, or a Protocol (AnyContext: what init returns, never constructed)
        bare = [p for p in params(obj) if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.annotation is inspect.Parameter.empty]  # typed varargs (start_before's *pending) are real
        assert not bare, f"{obj} hides its parameters: {inspect.signature(obj)}"
    init = params(je.EngramTable.__init__)
    assert [p.name for p in init][:4] == ["self", "num_entries", "hidden", "dtype"] and init[4].name == "ctx"
    assert init[4].kind is inspect.Parameter.KEYWORD_ONLY
