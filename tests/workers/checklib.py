"""The check decorator of the single-process workers (api_check, prefetch_check): runs a check function at
definition, prints `CHECK <name> PASS|FAIL <detail>` and records the result."""
from __future__ import annotations

import traceback
from typing import Callable


def make_check(checks: dict[str, bool], only: str = "", skip: Callable[[str], bool] = lambda name: False):
    """A decorator factory: ``@check(name)`` runs the function now unless ``only`` (comma-separated names) leaves it
    out or ``skip(name)``; ``checks[name]`` is whether it passed."""
    def check(name: str):
        def deco(fn):
            if (only and name not in only.split(",")) or skip(name):
                return fn
            try:
                fn()
                ok, detail = True, ""
            except Exception as e:  # noqa: BLE001 - reported, not swallowed
                ok, detail = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            checks[name] = ok
            print(f"CHECK {name} {'PASS' if ok else 'FAIL'} {detail}".rstrip(), flush=True)
            return fn
        return deco
    return check
