"""Hardware ceilings measured with plain JAX in the same run as our ops.

All functions take the byte count as a parameter (1 GiB default for the GPU runs; tests use ~1 MiB),
return a dict of results, and print nothing. Each result records how it was measured (``method``)
and what a GB/s means (bytes counted once unless a field says otherwise).

A ceiling that cannot be measured here (fewer than 2 devices, ...) returns ``None``; the reason is
kept in ``SKIPPED[name]`` (and ``all_ceilings`` reports it as ``{"skipped": reason}``).

Buffers are random (never zeros, METHOD.md), checked once after the copy (a checksum on each side).

Seen with this code on 2xH200 (NV18, jax 0.11.2), 1 GiB, batch=4: p2p one way 367 GB/s, both
directions 720 GB/s total; pinned host->device 54.7, device->host 54.5; local copy 1769 and xor
kernel 1758 GB/s (bytes once); uniform all_to_all R=2 algbw 449 GB/s. (torch copy engines, from
measured_h200.md: 391 / 757 / 55.3 / 2055.) At 256 MiB all of these read 10-40 % lower.

Not measured here: SM-driven peer copies (a kernel reading peer memory over NVLink); plain JAX has
no way to launch one. Our own ops' benchmarks should add that ceiling from native code.
"""
from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

try:  # imported as benchmarks._ceilings
    from . import _common as C
except ImportError:  # run from benchmarks/ (scripts there have it on sys.path)
    import _common as C

__all__ = ["NVLINK_CEILING", "HOST_LINK_CEILING", "nvlink_ceiling_gbps", "p2p_copy_ceiling", "host_to_device_ceiling", "local_d2d_ceiling", "all_to_all_ceiling",
           "all_ceilings", "ceiling_rows", "SKIPPED"]

SKIPPED: dict[str, str] = {}

# One ceiling definition per link: every "% of ceiling" the benchmarks print divides by one of these, measured in
# the same run. The ops move bytes both ways at once (every rank sends and receives), so the NVLink figure is the
# per-direction rate with both directions busy. probe_nvlink's cudaMemcpyPeerAsync figures (a few % higher than
# jax.device_put's) are context, never a denominator.
NVLINK_CEILING = ("NVLink ceiling = same-run copy engine per direction with both GPUs copying to each other at once "
                  "(p2p_copy_ceiling: two jax.device_put issued together, opposite directions; bidir.per_direction_gbps)")
HOST_LINK_CEILING = ("host link ceiling = same-run pinned host -> device jax.device_put (host_to_device_ceiling: "
                     "h2d.gbps)")


def nvlink_ceiling_gbps(p2p: dict | None) -> float | None:
    """The NVLINK_CEILING figure of a ``p2p_copy_ceiling`` result (None if there is none)."""
    if not p2p or "bidir" not in p2p:
        return None
    return p2p["bidir"].get("per_direction_gbps")


def _skip(name: str, reason: str):
    SKIPPED[name] = reason
    return None


def _words(nbytes: int) -> int:
    return max(1, int(math.ceil(int(nbytes) / 4)))


def _random_words(nbytes: int, device, seed: int = 0) -> jax.Array:
    """uint32 random buffer of ~nbytes on ``device`` (generated there, not on the host)."""
    key = jax.device_put(jax.random.key(seed), device)
    n = _words(nbytes)
    x = jax.jit(lambda k: jax.random.bits(k, (n,), jnp.uint32))(key)
    return jax.block_until_ready(x)


_checksum = jax.jit(lambda x: jnp.sum(x, dtype=jnp.uint32))


def _same(a: jax.Array, b: jax.Array) -> bool:
    return int(_checksum(a)) == int(_checksum(b)) and a.shape == b.shape


def _device(i):
    devs = jax.devices()
    return devs[i] if isinstance(i, int) else i


def _result(name, nbytes, t, method, **extra):
    r = dict(name=name, bytes=int(nbytes), median_us=t["median_us"], p10_us=t["p10_us"], p90_us=t["p90_us"],
             gbps=C.gbps(nbytes, t["median_us"]), method=method)
    r.update(extra)
    return r


def p2p_copy_ceiling(nbytes: int = 1 << 30, src: int = 0, dst: int = 1, warmup: int = 2, iters: int = 10,
                     batch: int = 4) -> dict | None:
    """Copy-engine bandwidth device ``src`` -> ``dst`` with ``jax.device_put`` between devices.

    Returns ``dict(one_way=..., bidir=...)``: ``one_way.gbps`` = nbytes / time of one src->dst copy;
    ``bidir.gbps`` = 2*nbytes / time of src->dst and dst->src issued together (total of both
    directions, each byte counted once); ``bidir.per_direction_gbps`` = half of it.
    Each sample issues ``batch`` copies back to back and waits once (``time_fn(inner=batch)``): a
    lone ``device_put`` of 1 GiB pays ~0.4 ms of allocation/sync on H200 (321 vs 368 GB/s measured;
    torch ``copy_`` gives 391). Needs ``batch * nbytes`` free on each destination.
    ``None`` (reason in ``SKIPPED['p2p_copy']``) with fewer than 2 devices.
    """
    devs = jax.devices()
    if len(devs) < 2:
        return _skip("p2p_copy", f"needs >= 2 devices, found {len(devs)}")
    if max(src, dst) >= len(devs) or src == dst:
        return _skip("p2p_copy", f"bad pair src={src} dst={dst} for {len(devs)} devices")
    ds, dd = devs[src], devs[dst]
    a = _random_words(nbytes, ds, 1)
    b = _random_words(nbytes, dd, 2)
    nb = a.size * 4
    batch = max(int(batch), 1)
    ok = _same(a, jax.device_put(a, dd)) and _same(b, jax.device_put(b, ds))
    fwd = lambda: [jax.device_put(a, dd) for _ in range(batch)]  # noqa: E731
    both = lambda: [(jax.device_put(a, dd), jax.device_put(b, ds)) for _ in range(batch)]  # noqa: E731
    t1 = C.time_fn(fwd, warmup=warmup, iters=iters, inner=batch)
    t2 = C.time_fn(both, warmup=warmup, iters=iters, inner=batch)
    one = _result("p2p_copy_one_way", nb, t1, "jax.device_put device->device (copy engine on GPU)",
                  src=str(ds), dst=str(dd), batch=batch)
    bi = _result("p2p_copy_bidir", 2 * nb, t2, "two jax.device_put issued together, opposite directions",
                 src=str(ds), dst=str(dd), batch=batch)
    bi["per_direction_gbps"] = bi["gbps"] / 2 if bi["gbps"] else None
    del a, b
    return dict(one_way=one, bidir=bi, bytes=nb, verified=ok)


def host_to_device_ceiling(nbytes: int = 1 << 30, device: int = 0, warmup: int = 2, iters: int = 10,
                           batch: int = 4) -> dict:
    """Pinned host -> device (and device -> pinned host) bandwidth through JAX memory kinds.

    Uses ``jax.device_put(x, SingleDeviceSharding(d, memory_kind="pinned_host"))`` for the host
    buffer and ``memory_kind=<device default>`` for the destination. If the backend has no
    ``pinned_host`` memory (or the transfer fails), falls back to numpy (pageable) -> device and
    says so in ``method`` / ``fallback_reason``. Returns ``dict(h2d=..., d2h=..., method=...)``.
    ``batch`` copies per sample, as in ``p2p_copy_ceiling``.
    """
    batch = max(int(batch), 1)
    d = _device(device)
    kinds = sorted({m.kind for m in d.addressable_memories()})
    dev_kind = d.default_memory().kind
    src = _random_words(nbytes, d, 3)
    nb = src.size * 4
    res = dict(device=str(d), memory_kinds=kinds, bytes=nb)
    reason = None
    if "pinned_host" in kinds:
        try:
            host_sh = SingleDeviceSharding(d, memory_kind="pinned_host")
            dev_sh = SingleDeviceSharding(d, memory_kind=dev_kind)
            h = jax.block_until_ready(jax.device_put(src, host_sh))
            ok = _same(src, jax.device_put(h, dev_sh))
            h2d = lambda: [jax.device_put(h, dev_sh) for _ in range(batch)]  # noqa: E731
            d2h = lambda: [jax.device_put(src, host_sh) for _ in range(batch)]  # noqa: E731
            res["h2d"] = _result("h2d_pinned", nb, C.time_fn(h2d, warmup=warmup, iters=iters, inner=batch),
                                 f"jax.device_put pinned_host -> {dev_kind}", batch=batch)
            res["d2h"] = _result("d2h_pinned", nb, C.time_fn(d2h, warmup=warmup, iters=iters, inner=batch),
                                 f"jax.device_put {dev_kind} -> pinned_host", batch=batch)
            res.update(method="pinned_host memory kind", verified=ok, fallback_reason=None)
            return res
        except Exception as e:  # pragma: no cover - backend specific
            reason = f"pinned_host transfer failed: {type(e).__name__}: {str(e)[:200]}"
    else:
        reason = f"no pinned_host memory kind on {d.platform} (kinds: {kinds})"
    host = np.asarray(src)
    h2d = lambda: jax.device_put(host, d)  # noqa: E731
    d2h = lambda: np.asarray(jax.device_put(src, d, may_alias=False))  # noqa: E731
    ok = _same(src, h2d())
    res["h2d"] = _result("h2d_pageable", nb, C.time_fn(h2d, warmup=warmup, iters=iters),
                         "numpy (pageable) -> device via jax.device_put")
    res["d2h"] = _result("d2h_pageable", nb, C.time_fn(d2h, warmup=warmup, iters=iters),
                         "device -> numpy via np.asarray (includes a device copy)")
    res.update(method="pageable fallback", verified=ok, fallback_reason=reason)
    return res


def local_d2d_ceiling(nbytes: int = 1 << 30, device: int = 0, warmup: int = 2, iters: int = 10,
                      batch: int = 4, loop_n: int = 10) -> dict:
    """On-device copy bandwidth, two ways:

    * ``copy``: ``jax.device_put(x, same_device, may_alias=False)`` (a memcpy), ``batch`` per sample;
    * ``kernel``: ``x ^ c`` on uint32 repeated ``loop_n`` times in one jitted ``fori_loop``
      (``time_loop``; an SM-driven read+write stream, in place on the loop carry, no allocation).
      On H200 at 1 GiB: ~1.8 TB/s counted once (3.6 TB/s read+write); torch ``copy_`` gave 2.06.

    ``gbps`` counts the bytes once (nbytes / t, like measured_h200.md's 2055 GB/s); ``rw_gbps`` counts
    read + write (2*nbytes / t), the figure to hold against HBM bandwidth.
    """
    d = _device(device)
    x = _random_words(nbytes, d, 4)
    nb = x.size * 4
    batch = max(int(batch), 1)
    step = lambda v: v ^ jnp.uint32(0x5A5A5A5A)  # noqa: E731
    xor = jax.jit(step)
    ok = _same(x, jax.device_put(x, d, may_alias=False)) and int(_checksum(xor(xor(x)))) == int(_checksum(x))
    res = dict(device=str(d), bytes=nb, verified=ok)
    copy = lambda: [jax.device_put(x, d, may_alias=False) for _ in range(batch)]  # noqa: E731
    r = _result("local_d2d_copy", nb, C.time_fn(copy, warmup=warmup, iters=iters, inner=batch),
                "jax.device_put(may_alias=False) on the same device", batch=batch)
    r["rw_gbps"] = C.gbps(2 * nb, r["median_us"])
    res["copy"] = r
    r = _result("local_d2d_kernel", nb, C.time_loop(step, x, loop_n, warmup=warmup, iters=iters),
                f"x ^ const on uint32, {loop_n}x in a jitted fori_loop (read + write)", loop_n=loop_n)
    r["rw_gbps"] = C.gbps(2 * nb, r["median_us"])
    res["kernel"] = r
    return res


def all_to_all_ceiling(bytes_per_rank: int = 1 << 30, mesh=None, warmup: int = 2, iters: int = 10,
                       loop_n: int = 5) -> dict | None:
    """Uniform ``jax.lax.all_to_all`` (NCCL on GPU) inside ``shard_map``: each rank sends
    ``bytes_per_rank/R`` to every rank (itself included).

    ``algbw_gbps`` = bytes_per_rank / t (logical, local chunk included); ``remote_gbps`` =
    bytes_per_rank*(R-1)/R / t (bytes that leave each rank, per direction). Timed with ``time_loop``
    (``loop_n`` back-to-back all_to_alls in one jitted loop). ``None`` with 1 device (reason in
    ``SKIPPED['all_to_all']``).
    """
    mesh = mesh if mesh is not None else C.make_ep_mesh()
    R = mesh.shape["ep"]
    if R < 2:
        return _skip("all_to_all", f"needs >= 2 devices on the mesh, found {R}")
    m = max(1, _words(bytes_per_rank) // R)
    key = jax.random.key(5)
    x = jax.jit(lambda k: jax.random.bits(k, (R * R, m), jnp.uint32),
                out_shardings=NamedSharding(mesh, P("ep", None)))(key)
    a2a = jax.jit(jax.shard_map(lambda v: jax.lax.all_to_all(v, "ep", 0, 0, tiled=True), mesh=mesh,
                                in_specs=P("ep", None), out_specs=P("ep", None)))
    # correctness: global [R*R, m] viewed as [src, dst, m] must come back as [dst, src, m]
    y = a2a(x)
    if R * R * m * 4 <= (64 << 20):
        xs = np.asarray(x).reshape(R, R, m)
        ok = bool(np.array_equal(np.asarray(y).reshape(R, R, m), xs.transpose(1, 0, 2)))
    else:
        ok = None  # too large to check on the host; the CPU tests cover the logic
    del y
    nb = R * m * 4
    t = C.time_loop(a2a, x, loop_n, warmup=warmup, iters=iters)
    r = _result("all_to_all_uniform", nb, t, f"jax.lax.all_to_all(tiled) in shard_map over 'ep', {loop_n}x in a loop",
                ranks=R, verified=ok, loop_n=loop_n)
    r["algbw_gbps"] = r.pop("gbps")
    r["remote_gbps"] = C.gbps(nb * (R - 1) / R, t["median_us"])
    return r


def all_ceilings(nbytes: int = 1 << 30, mesh=None, warmup: int = 2, iters: int = 10, batch: int = 4) -> dict:
    """Run every ceiling; skipped or failing ones appear as ``{"skipped": reason}`` / ``{"error": ...}``."""
    out = {}
    jobs = [
        ("p2p_copy", lambda: p2p_copy_ceiling(nbytes, warmup=warmup, iters=iters, batch=batch)),
        ("host_to_device", lambda: host_to_device_ceiling(nbytes, warmup=warmup, iters=iters, batch=batch)),
        ("local_d2d", lambda: local_d2d_ceiling(nbytes, warmup=warmup, iters=iters, batch=batch)),
        ("all_to_all", lambda: all_to_all_ceiling(nbytes, mesh=mesh, warmup=warmup, iters=iters)),
    ]
    for name, job in jobs:
        try:
            r = job()
            out[name] = r if r is not None else {"skipped": SKIPPED.get(name, "skipped")}
        except Exception as e:  # keep the other ceilings
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def ceiling_rows(ceil: dict) -> list[dict]:
    """Flatten ``all_ceilings`` output into table rows (what, us, GB/s, note)."""
    rows = []

    def add(what, r, g="gbps", note=""):
        rows.append(dict(what=what, median_us=r.get("median_us"), gbps=r.get(g), note=note or r.get("method", "")))

    for name, r in ceil.items():
        if "skipped" in r or "error" in r:
            rows.append(dict(what=name, median_us=None, gbps=None, note=r.get("skipped") or r.get("error")))
            continue
        if name == "p2p_copy":
            add("p2p copy one way", r["one_way"])
            add("p2p copy both directions (total)", r["bidir"])
        elif name == "host_to_device":
            add(f"host->device ({r['method']})", r["h2d"])
            add(f"device->host ({r['method']})", r["d2h"])
        elif name == "local_d2d":
            add("local d2d copy (bytes once)", r["copy"])
            add("local d2d kernel (bytes once)", r["kernel"])
        elif name == "all_to_all":
            add(f"all_to_all uniform R={r['ranks']} (algbw)", r, "algbw_gbps")
    return rows
