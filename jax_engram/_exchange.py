"""Collective exchange of small records among the processes of a context.

Multi-process: jax.distributed's key-value store (keys are never overwritten, so every exchange uses a
fresh key under the context's unique prefix). One process: a local pass-through. Every wait is bounded.
"""
from __future__ import annotations

import json
import time
from typing import Any

import jax

from jax_engram._jax_private import kv_client as _client


class Exchange:
    def __init__(self, prefix: str, process_ids: list[int], timeout_s: float):
        self.prefix = f"jax_engram/{prefix}"
        self.process_ids = sorted(set(process_ids))
        self.timeout_ms = int(timeout_s * 1000)
        self.multi = len(self.process_ids) > 1
        self.client = _client() if self.multi else None
        if self.multi and self.client is None:
            raise RuntimeError(
                "this mesh spans several processes but jax.distributed is not initialized; call "
                "jax.distributed.initialize() (or use python -m jax_engram.launch) before jax_engram.init()"
            )
        self._n = 0

    def allgather(self, name: str, local: dict[str, Any], want: list[str], *,
                  timeout_s: float | None = None) -> dict[str, Any]:
        """Publish `local` records and return the records for every key in `want` (from any process), waiting at
        most `timeout_s` (default: the context's timeout) for them all."""
        if not self.multi:
            missing = [k for k in want if k not in local]
            if missing:
                raise RuntimeError(f"jax_engram exchange {name}: no record for {missing} in a single-process context")
            return {k: local[k] for k in want}
        base = f"{self.prefix}/{name}"
        for k, v in local.items():
            self.client.key_value_set(f"{base}/{k}", json.dumps(v))
        out = dict(local)
        bound_s = self.timeout_ms / 1000 if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + bound_s  # one bound for the whole exchange, not one per key
        for k in want:
            if k in out:
                continue
            try:
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                out[k] = json.loads(self.client.blocking_key_value_get(f"{base}/{k}", left_ms))
            except Exception as e:
                missing = [m for m in want if m not in out and self._try_get(f"{base}/{m}") is None]
                raise TimeoutError(
                    f"jax_engram exchange '{name}': no record from {missing or [k]} (process index, or group.rank) within "
                    f"{bound_s:.0f} s (a process did not call the same jax_engram function, or "
                    f"died): {e}"
                ) from e
        return out

    def _try_get(self, key: str):
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - absent key
            return None

    def barrier(self, name: str) -> None:
        if not self.multi:
            return
        try:
            self.client.wait_at_barrier(f"{self.prefix}/{name}", self.timeout_ms, process_ids=self.process_ids)
        except TypeError:  # older clients without process_ids
            self.client.wait_at_barrier(f"{self.prefix}/{name}", self.timeout_ms)
        except Exception as e:
            raise TimeoutError(f"jax_engram barrier '{name}' among processes {self.process_ids} failed within "
                               f"{self.timeout_ms / 1000:.0f} s (a process died, hangs, or called another jax_engram "
                               f"function): {e}") from e

    def broadcast_bytes(self, name: str, value: bytes | None, root: int) -> bytes:
        """`value` from process `root` to every process of the context."""
        if not self.multi:
            assert value is not None
            return value
        key = f"{self.prefix}/{name}"
        if jax.process_index() == root:
            self.client.key_value_set_bytes(key, value)
            return value
        try:
            return self.client.blocking_key_value_get_bytes(key, self.timeout_ms)
        except Exception as e:
            raise TimeoutError(f"jax_engram: process {root} did not publish '{name}' within "
                               f"{self.timeout_ms / 1000:.0f} s: {e}") from e
