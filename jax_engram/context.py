"""The jax_engram context: one rank per device along a mesh axis, with symmetric windows on every rank.

`init(mesh, axis_name)` is collective over the processes that own the mesh's devices. For every group of
devices along `axis_name` (one group per position on the other mesh axes) it creates a member per local
device, a symmetric window `[workspace | device segment | host segment]` per rank, maps every peer's window
into every member's view (same process: directly; other processes of the host: by file-descriptor
sharing). No NCCL communicator is created at init: no op needs one inside a node, and a job whose ranks share
a GPU (more ranks than GPUs, for tests) could not build one. ``Context.nccl_topology()`` creates the side
communicator, window and device communicator on demand. Ops find their member by (context id, device ordinal) at
run time, so the same jitted function works on any number of processes and devices.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import math
import os
import threading
import time
import warnings
import weakref
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jax_engram import _call, _ep_guard, _ffi, _jax_private, _scaleout_gin
from jax_engram._exchange import Exchange
from jax_engram.config import EPConfig, ep_config as _ep_config

SEGMENT_ALIGNMENT = 2 << 20
WORKSPACE_BYTES = 8 << 20  # must match kWorkspaceBytes in ffi/include/jax_engram/workspace.h
DEVICE, HOST = 0, 1  # SegmentKind

_ids = itertools.count(1)
_fingerprint_counts: dict[str, int] = {}
_live: "weakref.WeakSet[Context | HierContext]" = weakref.WeakSet()  # what the user created (not inner contexts)
_lock = threading.Lock()


def _mps_active() -> bool:
    """Whether a CUDA MPS control daemon is reachable (its pipe directory holds the control socket)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def _align(n: int, a: int = SEGMENT_ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def _wait_for_tables(ctx) -> None:
    """Blocks until the ``*_global`` calls of the context's live Engram tables are done: JAX runs them
    asynchronously, and an enqueued ``lookup_global`` / ``write_global`` still needs the context that ``close``
    tears down. Their failures are theirs to report (reading their results raises); after an op of the context
    failed nothing is waited for (a dead peer would hold every wait for ``timeout_s``)."""
    tables = list(ctx._tables)
    if not tables or ctx.errors():
        return
    for t in tables:
        t._wait_global_calls()


class JaxEngramError(RuntimeError):
    """An error reported by a jax_engram op on the device (timeout, invalid routing, ...).

    Raised by ``Context.check()`` (errors recorded in the context) and by the ``*_global`` methods. A call of a
    jitted function raises what JAX raises for a failed execution (``jax.errors.JaxRuntimeError``, or ``ValueError``
    once the function has run before) carrying the same message (see docs/semantics.md, "Errors")."""


def error_message(e: BaseException) -> str | None:
    """The jax_engram message inside an XLA runtime error (after XLA's status code), or None when the error is
    not a jax_engram one."""
    lines = [l for l in str(e).splitlines() if "jax_engram " in l]
    if not lines:
        return None
    line = lines[-1]
    return line[line.find("jax_engram "):]


def _forget_failed_executions(devices) -> None:
    """Wait for the last execution with side effects on each of ``devices`` and forget those that failed with a
    jax_engram error. The call that ran it raised it already; JAX keeps it as the device's runtime token and would
    raise it again at interpreter exit (or at the next effects barrier)."""
    tokens = _jax_private.runtime_tokens()
    for d in [d for d in list(tokens.output_runtime_tokens) if d in devices]:
        try:
            tokens.output_runtime_tokens[d].block_until_ready()
        except Exception as e:  # noqa: BLE001 - XLA's runtime error type; ours are recognised by their message
            if error_message(e) is not None:  # not ours: JAX reports it as usual
                tokens.output_runtime_tokens.pop(d, None)




@atexit.register
def _forget_failed_executions_at_exit() -> None:
    """A failed jax_engram call was raised by the call that ran it (or by ``ctx.check()``); without this, JAX would
    print it twice more at interpreter exit. Registered after jax's own exit handlers, so it runs before them."""
    try:
        _forget_failed_executions(set(_jax_private.runtime_tokens().output_runtime_tokens))
    except Exception:  # noqa: BLE001 - never fail the interpreter's exit
        pass


@dataclasses.dataclass(frozen=True)
class Region:
    """A byte range of a symmetric allocation, at the same offset on every rank."""

    alloc_id: int
    offset: int
    nbytes: int
    placement: str  # "device" | "host"


@dataclasses.dataclass(frozen=True)
class Member:
    device: Any
    group: int
    rank: int

    @property
    def ordinal(self) -> int:
        """The FFI DeviceOrdinal of this device: XLA:CPU passes the global device id (2048 * process +
        local on multi-process jobs), XLA:GPU the local CUDA ordinal."""
        if self.device.platform == "cpu":
            return int(self.device.id)
        return int(self.device.local_hardware_id)


class _Reservation:
    """First-fit allocator over one segment of the window (offsets identical on every rank because every
    process performs the same sequence of collective allocations)."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size
        self.used: dict[int, int] = {}  # offset -> bytes

    def take(self, nbytes: int, align: int = 256) -> int | None:
        pos = self.start
        for off in sorted(self.used):
            if _align(pos, align) + nbytes <= off:
                break
            pos = max(pos, off + self.used[off])
        pos = _align(pos, align)
        if pos + nbytes > self.start + self.size:
            return None
        self.used[pos] = nbytes
        return pos

    def give(self, offset: int) -> None:
        self.used.pop(offset, None)

    @property
    def free_bytes(self) -> int:
        return self.size - sum(self.used.values())


class Context:
    """A jax_engram communication context over one mesh axis. Create with :func:`jax_engram.init`."""

    def __init__(self, mesh, axis_name: str, *, device_bytes: int | None, host_bytes: int | None,
                 timeout_s: float, cuda_graphs: bool = False, ep_config: EPConfig | None = None):
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"jax_engram.init: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"jax_engram.init: axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e7:
            # finite: every wait is bounded by it, and it becomes deadlines and nanosecond counts natively
            raise ValueError(f"jax_engram.init: timeout_s must be a positive, finite number of seconds (below 1e7), "
                             f"got {timeout_s!r}")
        if not isinstance(cuda_graphs, (bool, np.bool_)):
            raise ValueError(f"jax_engram.init: cuda_graphs must be a bool, got {cuda_graphs!r}")
        for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
            if v is not None and (not isinstance(v, (int, np.integer)) or v < 0):
                raise ValueError(f"jax_engram.init: {name} must be None or a non-negative int, got {v!r}")
        platforms = {d.platform for d in mesh.devices.flat}
        if len(platforms) != 1:
            raise ValueError(f"jax_engram.init: the mesh mixes platforms {platforms}")
        self.platform = platforms.pop()
        self._native = _ffi.ensure_registered(self.platform)
        self.mesh = mesh
        self.axis_name = axis_name
        self.timeout_s = float(timeout_s)
        self.cuda_graphs = bool(cuda_graphs)
        self.ep_config = _ep_config(ep_config, "jax_engram.init: ep_config")
        self.device_bytes = None if device_bytes is None else int(device_bytes)
        self.host_bytes = None if host_bytes is None else int(host_bytes)
        self.num_ranks = int(mesh.shape[axis_name])
        axis = list(mesh.axis_names).index(axis_name)
        self._groups = np.moveaxis(mesh.devices, axis, -1).reshape(-1, self.num_ranks)
        me = jax.process_index()
        self.members = [Member(d, g, r) for g, row in enumerate(self._groups) for r, d in enumerate(row)
                        if d.process_index == me]
        if not self.members:
            raise ValueError("jax_engram.init: this process owns no device of the mesh; call init only on "
                             "processes that own some of its devices")
        self.process_ids = sorted({d.process_index for d in mesh.devices.flat})
        fp = hashlib.sha1(repr(([d.id for d in mesh.devices.flat], axis_name)).encode()).hexdigest()[:12]
        with _lock:
            n = _fingerprint_counts.get(fp, 0)
            _fingerprint_counts[fp] = n + 1
            self.id = next(_ids)
        self._exchange = Exchange(f"{fp}.{n}", self.process_ids, self.timeout_s)
        self._alloc_ids = itertools.count(0)
        self._allocs: dict[int, list[tuple[int, int]]] = {}
        self._regions: dict[Any, Region] = {}
        self._tables: "weakref.WeakSet" = weakref.WeakSet()  # EngramTables of this context (close waits for them)
        self._closed = False
        self.nccl: dict[int, dict] = {}
        self._created: list[Member] = []
        try:
            self._check_hosts()
            for m in self.members:
                self._native.member_create(self.id, m.ordinal, m.group, m.rank, self.num_ranks, self.timeout_s,
                                           f"context {self.id} (axis {axis_name!r}, group {m.group})")
                self._created.append(m)
            dev_seg = _align(self.device_bytes or 0)
            host_seg = _align(self.host_bytes or 0)
            segs = [(WORKSPACE_BYTES + dev_seg, DEVICE)] + ([(host_seg, HOST)] if host_seg else [])
            window = self._alloc(segs)
            assert window == 0
            self._device_res = _Reservation(WORKSPACE_BYTES, dev_seg) if self.device_bytes is not None else None
            self._host_res = (_Reservation(WORKSPACE_BYTES + dev_seg, host_seg)
                              if self.host_bytes is not None else None)
        except BaseException:
            self._teardown()
            raise
        _live.add(self)

    # ---------------------------------------------------------------------------------------------- setup
    def _check_hosts(self) -> None:
        me = str(jax.process_index())
        mine = {"host": self._native.host_id(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "devices": {str(m.device.id): m.ordinal for m in self.members}}
        recs = self._exchange.allgather("hosts", {me: mine}, [str(p) for p in self.process_ids])
        self.hosts = {int(k): v["host"] for k, v in recs.items()}
        # Ranks on one physical GPU (several processes given the same device, to test more ranks than GPUs): the
        # same host, the same CUDA_VISIBLE_DEVICES and the same ordinal. Our windows and kernels work there (the
        # GPU time-slices the processes' kernels); an NCCL communicator cannot (NCCL refuses duplicate GPUs).
        self.ranks_per_gpu = 1
        if self.platform != "cpu":
            for row in self._groups:
                where = [(recs[str(d.process_index)]["host"], recs[str(d.process_index)]["visible"],
                          recs[str(d.process_index)]["devices"][str(d.id)]) for d in row]
                self.ranks_per_gpu = max(self.ranks_per_gpu, max(where.count(w) for w in where))
            if self.ranks_per_gpu > 1 and _mps_active():
                # Under MPS the processes' kernels share the SMs at once instead of taking turns: the EP kernels
                # (one CTA per SM, all resident, spinning on peers) of several ranks need not fit together, and a
                # rank whose kernel cannot start would leave the others spinning until the timeout.
                raise NotImplementedError(
                    f"jax_engram.init: {self.ranks_per_gpu} ranks share a GPU while the CUDA MPS server is running; "
                    "ranks sharing a GPU are supported with the default time slicing only (stop MPS: "
                    "echo quit | nvidia-cuda-mps-control)")
        for row in self._groups:
            hosts = {self.hosts[d.process_index] for d in row}
            if len(hosts) > 1:  # windows are mapped peer to peer: a flat group must stay inside one host
                raise NotImplementedError(
                    f"jax_engram: axis {self.axis_name!r} spans {len(hosts)} hosts; a flat context maps every "
                    "peer's memory, which only works inside one host (NVLink domain). Use a 2-D (node, local) "
                    f"EP group: jax_engram.init(mesh, (\"node\", {self.axis_name!r})) with a mesh whose last axis "
                    "stays inside a host")

    def nccl_topology(self) -> dict[int, dict]:
        """Collective (every process of the context must call it): create the side NCCL communicator, window and
        LSA device communicator of every group if not done yet, and return, per local device ordinal, what NCCL
        reports (versions, ranks, LSA team, window / device-API support, P2P access, NUMA). No op needs them; they
        are for diagnosis and for paths that use NCCL. GPU only; refused when ranks share a GPU."""
        self._check_open()
        if self.platform == "cpu":
            raise RuntimeError("jax_engram: nccl_topology() needs a GPU context (this one is on CPU)")
        if self.ranks_per_gpu > 1:
            raise RuntimeError(
                f"jax_engram: context {self.id} has {self.ranks_per_gpu} ranks on one GPU; NCCL refuses a "
                "communicator with duplicate GPUs, so nccl_topology() is not available in this mode (the ops do "
                "not need NCCL)")
        return self._nccl_topology()

    def _nccl_topology(self) -> dict[int, dict]:
        """nccl_topology() without the shared-GPU refusal. For tests only: with ranks sharing a GPU, a rank that
        never joins leaves the others waiting in NCCL's bootstrap (before NCCL looks at the GPUs), which proves
        the communicator's bounded init on one GPU; when every rank joins, NCCL refuses the duplicate GPUs."""
        self._check_open()
        if not self.nccl:
            self._init_nccl()
            self._register_window()
        return dict(self.nccl)

    def _nccl_rendezvous(self) -> dict[int, bytes]:
        """The first half of the communicator's creation: meet (a barrier bounded by the context timeout, so a
        process that never gets this far is a TimeoutError naming the barrier) and share each local group's NCCL
        unique id ({group: id}). A test stops a rank here to make the others' ncclCommInitRank expire."""
        self._exchange.barrier("nccl_init")
        uids = {}
        for g, row in enumerate(self._groups):
            if not any(m.group == g for m in self.members):
                continue
            root = min(d.process_index for d in row)
            uid = self._native.nccl_unique_id() if jax.process_index() == root else None
            uids[g] = self._exchange.broadcast_bytes(f"nccl_uid/{g}", uid, root)
        return uids

    def _init_nccl(self) -> None:
        # comm_init is bounded too: a non-blocking communicator, aborted after timeout_s, naming the ranks that did
        # not join.
        for g, uid in self._nccl_rendezvous().items():
            local = [m for m in self.members if m.group == g]
            self._native.comm_init(self.id, [(m.ordinal, m.rank) for m in local], self.num_ranks, uid)

    def _register_window(self) -> None:
        for g in sorted({m.group for m in self.members}):
            self._native.window_register(self.id, [m.ordinal for m in self.members if m.group == g])
        for m in self.members:  # after registration, so window/devcomm state is current
            self.nccl[m.ordinal] = self._native.topology(self.id, m.ordinal)

    def _alloc(self, segments: list[tuple[int, int]]) -> int:
        """Collective: a symmetric allocation of `segments` [(bytes, DEVICE|HOST)] on every rank."""
        aid = next(self._alloc_ids)
        exports = {}
        try:
            for m in self.members:
                exports[f"{m.group}.{m.rank}"] = self._native.alloc_create(self.id, m.ordinal, aid, segments)
            want = [f"{g}.{r}" for g in sorted({m.group for m in self.members}) for r in range(self.num_ranks)]
            allx = self._exchange.allgather(f"alloc{aid}/exports", exports, want)
            for m in self.members:
                self._native.alloc_connect(self.id, m.ordinal, aid,
                                           [allx[f"{m.group}.{r}"] for r in range(self.num_ranks)])
            self._exchange.barrier(f"alloc{aid}/connected")
        finally:
            # Every peer has imported (or failed); the shareable handles are not needed any more.
            for m in self.members:
                if f"{m.group}.{m.rank}" in exports:
                    self._native.alloc_close_exports(self.id, m.ordinal, aid)
        self._allocs[aid] = list(segments)
        return aid

    def _free_alloc(self, aid: int) -> None:
        for m in self.members:
            self._native.alloc_free(self.id, m.ordinal, aid)
        self._allocs.pop(aid, None)

    # ------------------------------------------------------------------------------------------ regions
    def region(self, nbytes: int, placement: str = "device", *, key: Any = None, what: str = "buffer") -> Region:
        """Collective: `nbytes` of symmetric memory on every rank, carved from the init reservation of that
        placement if one was given, else in a segment of its own. Cached by `key` when given."""
        self._check_open()
        if placement not in ("device", "host"):
            raise ValueError(f"placement must be 'device' or 'host', got {placement!r}")
        if key is not None and key in self._regions:
            r = self._regions[key]
            if r.nbytes >= nbytes:
                return r
            self.release(r)
            del self._regions[key]
        nbytes = max(int(nbytes), 1)
        res = self._device_res if placement == "device" else self._host_res
        if res is not None:
            off = res.take(nbytes)
            if off is None:
                knob = "device_bytes" if placement == "device" else "host_bytes"
                raise MemoryError(
                    f"jax_engram: the {what} needs {nbytes} bytes of {placement} memory per rank but the context's "
                    f"{placement} reservation has {res.free_bytes} of {res.size} bytes free; pass a larger "
                    f"{knob}= to jax_engram.init() (at least {nbytes + res.size - res.free_bytes}), or {knob}=None "
                    "to give every buffer a segment of its own")
            r = Region(0, off, nbytes, placement)
        else:
            aid = self._alloc([(_align(nbytes), DEVICE if placement == "device" else HOST)])
            r = Region(aid, 0, nbytes, placement)
        if key is not None:
            self._regions[key] = r
        return r

    def release(self, r: Region) -> None:
        """Give region ``r`` (from :meth:`region`) back: to its reservation, or free its own segment (collective
        then). Nothing to do after ``close()``."""
        if self._closed:
            return
        if r.alloc_id == 0:
            (self._device_res if r.placement == "device" else self._host_res).give(r.offset)
        else:
            self._free_alloc(r.alloc_id)

    # ---------------------------------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"jax_engram context {self.id} is closed")

    def check(self) -> None:
        """Wait for the work this process queued on the context's devices, then raise :class:`JaxEngramError` (the
        op's own message) if an error is recorded in the context: a timeout or bad routing found by a kernel (the
        context is then unusable; on GPU such an error is recorded without failing the call). A failed call that
        left the context usable (a checked lookup, a ``validate_routing`` refusal) was raised by the call itself;
        ``check`` does not raise it again, and forgets it so that JAX does not raise it again at exit."""
        _forget_failed_executions({m.device for m in self.members})
        for m in self._created:
            e = self._native.error(self.id, m.ordinal)
            if e is not None:
                raise JaxEngramError(e["message"])

    def dispatch_path(self, *, max_tokens_per_rank: int, hidden_bytes: int, topk: int, num_experts: int,
                      config: EPConfig | None = None) -> str:
        """How ``dispatch`` of this config moves x's rows on this context: ``"copy engine (P pieces)"`` (CUDA:
        the whole x is copied into every peer's inbox by the copy engine and every receiver lays out the peers' tokens
        itself), ``"SM stores"`` (CUDA), ``"pull (CPU)"``, or ``"local (one rank)"`` (the one-rank path: a permutation
        in plain JAX, ``EPConfig.one_rank``). The same on every rank. ``config``: the op's EPConfig
        (default: the context's; its ``dispatch_copy_engine`` decides). This is the decision the op itself makes at
        trace time and passes to the kernel; it does not depend on the layout (expand or not). For benchmarks and
        diagnosis; it does not change the results."""
        cfg = self.ep_config if config is None else _ep_config(config, "Context.dispatch_path: config")
        if _ep_guard.applies(self, cfg):
            return "local (one rank)"
        pieces = self._copy_pieces(int(max_tokens_per_rank), int(hidden_bytes), int(topk), int(num_experts), cfg)
        if self.platform != "gpu":
            return "pull (CPU)"
        return f"copy engine ({pieces} pieces)" if pieces > 0 else "SM stores"

    def _copy_pieces(self, M: int, hidden_bytes: int, K: int, E: int, config: EPConfig) -> int:
        """Copy-engine pieces of a dispatch (0: SM stores), from the native policy (kernels/cuda/ep_copy_engine.h):
        the value the dispatch passes to its handler. Every process asks its first local member: the answer depends
        on the config and the device model only."""
        self._check_open()
        if self.platform != "gpu" or not self._created:
            return 0
        m = self._created[0]
        pieces = self._native.ep_dispatch_copy_pieces(self.id, m.ordinal, M, K, E, hidden_bytes,
                                                      config.copy_engine_mode, config.copy_engine_pieces)
        if pieces < 0:
            raise RuntimeError(f"jax_engram context {self.id}: no member on device ordinal {m.ordinal}")
        return int(pieces)

    def graph_captures(self) -> dict:
        """EP calls that XLA captured into CUDA graphs on this process's members (``cuda_graphs=True``), by op:
        ``{"dispatch": n, "dispatch_cached": n, "combine": n}``. A call counts once per capture, however often the
        graph is replayed; XLA captures again when an executable runs on new buffer addresses. All 0 on CPU. For
        tests and diagnosis."""
        self._check_open()
        out = {"dispatch": 0, "dispatch_cached": 0, "combine": 0}
        if self.platform == "cpu":
            return out
        for m in self._created:
            for k, v in zip(out, self._native.ep_graph_captures(self.id, m.ordinal)):
                out[k] += int(v)
        return out

    def errors(self) -> list[dict]:
        """The errors recorded in this context on this process's devices (one dict per device that has one: ``op``,
        ``rank``, ``peer``, ``code``, ``message``, ...); empty while the context is healthy. A context with an
        error is unusable: close it (``close()`` does not wait for peers then) and create a new one."""
        return [e for m in self._created if (e := self._native.error(self.id, m.ordinal)) is not None]

    def _teardown(self) -> None:
        for m in reversed(self._created):
            try:
                self._native.member_destroy(self.id, m.ordinal)
            except Exception:  # best effort while unwinding
                pass
        self._created = []

    def close(self) -> None:
        """Collective: wait for this context's device work, then free its windows and communicators. It waits for
        the ``*_global`` calls of the context's Engram tables (JAX runs them asynchronously, so their results may be
        read after close) and for the ops already running; a jitted call of your own that JAX has queued but not
        started fails with "context ... is closing" (or "no jax_engram context ... (closed, ...)" once close has
        returned): block on its results before closing to keep them. After an
        op of the context failed on this process (``ctx.errors()``, e.g. a peer that died) it frees everything
        without meeting the peers, so it does not wait for a dead one.

        With ``cuda_graphs=True`` it also clears JAX's compilation caches (``jax.clear_caches()``): a CUDA graph
        replays its kernels without running any handler, so an executable that captured this context's ops would
        otherwise reach its freed windows; after the clear, calling such a function again retraces it and fails
        with "context is closed". (An executable the caller holds, e.g. from ``.lower().compile()``, is not
        covered: do not call it after close.)"""
        if self._closed:
            return
        _wait_for_tables(self)
        self._closed = True
        if self.cuda_graphs and self.platform != "cpu":
            jax.clear_caches()
        # After an op failed (a timeout: a peer died or hangs) the peers cannot be relied on to meet again: close
        # without the final barrier instead of waiting timeout_s for a dead peer.
        failed = bool(self.errors())
        for m in self.members:
            self._native.member_destroy(self.id, m.ordinal)
        self._created = []
        try:
            if not failed:
                self._exchange.barrier("closed")
        except TimeoutError as e:
            # A peer whose own op failed closes without this barrier (above), and one that died never comes: the
            # memory is already freed here, so close() warns and returns (it never raises).
            warnings.warn(f"jax_engram: context {self.id} closed without meeting every process within its timeout "
                          f"({e})", RuntimeWarning, stacklevel=2)
        finally:
            _live.discard(self)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Context(id={self.id}, axis={self.axis_name!r}, ranks={self.num_ranks}, platform={self.platform}, "
                f"processes={len(self.process_ids)}, local_members={len(self.members)}"
                f"{', closed' if self._closed else ''})")

    # ---------------------------------------------------------------------------------------- diagnosis
    def info(self) -> dict:
        """What this context is, as a dict: id, platform, axis, ranks, groups, processes, the local members (device,
        ordinal, group, rank), the window's segment sizes, timeout, CUDA graphs, ranks per GPU, the EP config,
        and, once created, what NCCL reports (``nccl_topology()``). For logs and diagnosis."""
        d = {
            "id": self.id, "platform": self.platform, "axis": self.axis_name, "num_ranks": self.num_ranks,
            "groups": len(self._groups), "processes": len(self.process_ids), "process_index": jax.process_index(),
            "local_members": [{"device": str(m.device), "ordinal": m.ordinal, "group": m.group, "rank": m.rank}
                              for m in self.members],
            "window": {"workspace_bytes": WORKSPACE_BYTES, "device_segment_bytes": _align(self.device_bytes or 0),
                       "host_segment_bytes": _align(self.host_bytes or 0)},
            "timeout_s": self.timeout_s, "cuda_graphs": self.cuda_graphs,
            "ranks_per_gpu": self.ranks_per_gpu,
            "ep_config": dataclasses.asdict(self.ep_config),
        }
        if self.nccl:
            d["nccl"] = self.nccl
        return d

    # ------------------------------------------------------------------------------------------ memory
    def memory_info(self) -> dict:
        """What this context holds on each of its ranks (the same on every rank: allocations are symmetric).

        ``window``: the init window (workspace, device and host segments) and how much of the two reservations is
        in use; ``allocations``: every symmetric allocation by id (0 = the window) with its segments;
        ``regions``: the cached buffers (Engram tables, EP staging buffers, ...) by key, with placement, bytes and
        where they live; ``ep_buffers``: the EP staging buffers alone, one per dispatch / combine configuration
        (freed by :meth:`free_ep_buffers`); ``device_bytes`` / ``host_bytes``: the totals per rank."""
        self._check_open()
        kinds = {DEVICE: "device", HOST: "host"}
        allocs = {aid: [{"bytes": int(b), "placement": kinds[k]} for b, k in segs] for aid, segs in self._allocs.items()}
        regions = [{"key": repr(k), "placement": r.placement, "bytes": r.nbytes, "alloc_id": r.alloc_id,
                    "offset": r.offset} for k, r in self._regions.items()]
        ep = [dict(d, kind=k[0]) for k, d in zip(self._regions, regions)
              if isinstance(k, tuple) and k and k[0] in ("ep_dispatch", "ep_combine")]
        total = {"device": 0, "host": 0}
        for segs in allocs.values():
            for seg in segs:
                total[seg["placement"]] += seg["bytes"]
        res = {}
        for name, r in (("device", self._device_res), ("host", self._host_res)):
            if r is not None:
                res[name] = {"reserved": r.size, "used": r.size - r.free_bytes}
        return {"window": {"workspace_bytes": WORKSPACE_BYTES, "device_segment_bytes": _align(self.device_bytes or 0),
                           "host_segment_bytes": _align(self.host_bytes or 0), "reservations": res},
                "allocations": allocs, "regions": regions, "ep_buffers": ep,
                "device_bytes": total["device"], "host_bytes": total["host"]}

    def free_ep_buffers(self) -> int:
        """Collective: free the EP staging buffers of every dispatch / combine configuration used so far (they are
        created again, at their first use, by the next EP op). Returns the bytes freed per rank.

        Call between steps, once the outputs of the last EP op are ready (``jax.block_until_ready``): the buffers of
        an op still running would be freed under it. JAX's compilation caches are cleared, because a compiled EP op
        names its buffer; an executable the caller holds (``.lower().compile()``) must not be called again."""
        self._check_open()
        keys = [k for k in self._regions if isinstance(k, tuple) and k and k[0] in ("ep_dispatch", "ep_combine")]
        self._free_ep_calls = getattr(self, "_free_ep_calls", 0) + 1
        self._exchange.barrier(f"free_ep/{self._free_ep_calls}")  # no peer still reads them
        freed = 0
        for k in keys:
            r = self._regions.pop(k)
            freed += r.nbytes
            self.release(r)
        if keys:
            jax.clear_caches()
        return freed


# ----------------------------------------------------------------------------------- contexts of several axes
class HierContext:
    """A jax_engram context over a tuple of mesh axes ``(node axes..., local axis)``. Create with
    ``jax_engram.init(mesh, ("node", "gpu"))``. Ops run inside ``jax.shard_map`` over all of these axes
    (``P(("node", "gpu"))``); the signatures of every op are those of the flat path.

    It owns no symmetric memory: its Engram tables and EP buffers live in its per-node inner :class:`Context`
    (``ctx.inner``, the last axis), whose errors, captures and lifetime it reports and manages."""

    def __init__(self, mesh, axes: tuple, *, device_bytes, host_bytes, timeout_s: float, cuda_graphs: bool = False,
                 ep_config=None):
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"jax_engram.init: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        axes = tuple(axes)
        if len(set(axes)) != len(axes) or not all(isinstance(a, str) for a in axes):
            raise ValueError(f"jax_engram.init: the EP group {axes!r} must be distinct mesh axis names")
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(f"jax_engram.init: axis {a!r} of the EP group {axes!r} is not an axis of the mesh "
                                 f"{mesh.axis_names}")
        self.mesh = mesh
        self.axis_name = axes
        self.node_axes = axes[:-1]
        self.local_axis = axes[-1]
        self.num_nodes = int(math.prod(mesh.shape[a] for a in self.node_axes))
        self.local_size = int(mesh.shape[self.local_axis])
        self.num_ranks = self.num_nodes * self.local_size
        self.inner = Context(mesh, self.local_axis, device_bytes=device_bytes, host_bytes=host_bytes,
                             timeout_s=timeout_s, cuda_graphs=cuda_graphs, ep_config=ep_config)
        self.ep_config = self.inner.ep_config  # the intra-node dispatches' tuning
        self.platform = self.inner.platform
        self.timeout_s = self.inner.timeout_s
        self.cuda_graphs = self.inner.cuda_graphs
        self.id = self.inner.id
        self.device_bytes, self.host_bytes = self.inner.device_bytes, self.inner.host_bytes
        self._tables: "weakref.WeakSet" = weakref.WeakSet()  # EngramTables of this context (close waits for them)
        self._inter_node_path, self._gin_reason = _scaleout_gin.probe(self)
        _live.discard(self.inner)  # listed once, as what the user holds
        _live.add(self)

    @property
    def node_axis(self):
        """The node axes as ``jax.lax`` collectives take them (a name, or a tuple of names)."""
        return self.node_axes[0] if len(self.node_axes) == 1 else self.node_axes

    @property
    def inter_node_path(self) -> str:
        """How Engram rows cross nodes: ``"gin"`` (NCCL's GPU-initiated networking: one-sided gets from the
        peers' windows, where the network offers it) or ``"xla all_to_all"`` (XLA collectives over the node axes,
        static capacity, same-rail). ``info()["gin"]`` says why GIN is not used (README, "Across nodes")."""
        return self._inter_node_path

    def _check_open(self) -> None:
        self.inner._check_open()

    @property
    def _closed(self) -> bool:
        return self.inner._closed

    def check(self) -> None:
        """Wait for this process's work on the context's devices, then raise :class:`JaxEngramError` if an error is
        recorded (see :meth:`Context.check`; the errors of the per-node inner context)."""
        self.inner.check()

    def errors(self) -> list[dict]:
        """The errors recorded on this process's devices, as :meth:`Context.errors` (global ranks of the inner
        context's group); empty while the context is healthy."""
        return self.inner.errors()

    def graph_captures(self) -> dict:
        """EP calls captured into CUDA graphs on this process's devices, by op (see :meth:`Context.graph_captures`):
        the intra-node legs of the hierarchical ops."""
        return self.inner.graph_captures()

    def dispatch_path(self, *, max_tokens_per_rank: int, hidden_bytes: int, topk: int, num_experts: int,
                      config: EPConfig | None = None) -> str:
        """How the intra-node leg of ``dispatch`` moves rows (see :meth:`Context.dispatch_path`)."""
        return self.inner.dispatch_path(max_tokens_per_rank=max_tokens_per_rank, hidden_bytes=hidden_bytes,
                                        topk=topk, num_experts=num_experts, config=config)

    def region(self, nbytes: int, placement: str = "device", *, key: Any = None, what: str = "buffer") -> Region:
        """Not available: a hierarchical context owns no symmetric memory (use ``ctx.inner``'s)."""
        raise NotImplementedError("jax_engram: a hierarchical (node, local) context has no symmetric memory of its "
                                  "own; Engram tables and EP buffers live in its per-node inner context "
                                  "(ctx.inner); barrier / ring_exchange need a flat context")

    def close(self) -> None:
        """Collective: wait for the context's Engram tables and device work, then free the inner context's windows
        and communicators (see :meth:`Context.close`; it never raises for a peer that failed or died)."""
        _wait_for_tables(self)
        try:
            self.inner.close()
        finally:
            _live.discard(self)

    def __enter__(self) -> "HierContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HierContext(axes={self.axis_name!r}, nodes={self.num_nodes}, ranks_per_node={self.local_size}, "
                f"ranks={self.num_ranks}, platform={self.platform}, inner={self.inner!r})")

    def info(self) -> dict:
        """What this context is, as a dict: the inner context's :meth:`Context.info` with the group's global figures
        (axes, ranks, nodes, ranks per node) and the paths rows take inside and across nodes. For logs."""
        d = dict(self.inner.info())
        d.update({"axis": self.axis_name, "num_ranks": self.num_ranks, "hierarchical": True,
                  "nodes": self.num_nodes, "ranks_per_node": self.local_size, "node_axes": self.node_axes,
                  "local_axis": self.local_axis, "inter_node_path": self.inter_node_path,
                  "intra_node_path": "jax_engram windows (shared memory)" if self.platform == "cpu"
                  else "jax_engram windows (NVLink)",
                  "gin": "in use" if self._inter_node_path == "gin" else f"not used: {self._gin_reason}",
                  "inner": {"id": self.inner.id, "groups": len(self.inner._groups)}})
        return d

    # ------------------------------------------------------------------------------------- in shard_map
    def node_index(self):
        """This rank's node (int32 scalar; inside ``shard_map`` over the group's axes)."""
        return jax.lax.axis_index(self.node_axis).astype(jnp.int32)

    def local_index(self):
        """This rank's position inside its node (int32 scalar; inside ``shard_map`` over the group's axes)."""
        return jax.lax.axis_index(self.local_axis).astype(jnp.int32)

    def varying(self, x):
        """x marked as varying along every axis of the group (collectives over the node axes need it)."""
        return _call.vary(x, self.axis_name)

    def node_all_to_all(self, x):
        """x [num_nodes, ...]: block b goes to the same-rail rank of node b; returns [num_nodes, ...] with block a
        from node a. Payloads travel as unsigned integers of their width (bit-exact for every dtype)."""
        x = self.varying(x)
        if self.num_nodes == 1:
            return x
        dt = x.dtype
        u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dt).itemsize]
        xu = jax.lax.bitcast_convert_type(x, u) if dt != u else x
        yu = jax.lax.all_to_all(xu, self.node_axis, 0, 0, tiled=True)
        return jax.lax.bitcast_convert_type(yu, dt) if dt != u else yu


@runtime_checkable
class AnyContext(Protocol):
    """What :func:`init` returns: a :class:`Context` (one mesh axis) or a :class:`HierContext` (a tuple of mesh
    axes ``("node", "gpu")``). Every op takes either through ``ctx=``; both offer these members."""

    mesh: jax.sharding.Mesh
    axis_name: Any  #: the mesh axis (str) or axes (tuple of str) of the group
    num_ranks: int
    platform: str
    timeout_s: float
    cuda_graphs: bool
    ep_config: EPConfig

    def check(self) -> None: ...

    def errors(self) -> list[dict]: ...

    def info(self) -> dict: ...

    def dispatch_path(self, *, max_tokens_per_rank: int, hidden_bytes: int, topk: int, num_experts: int,
                      config: EPConfig | None = None) -> str: ...

    def close(self) -> None: ...


def init(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...], *, device_bytes: int | None = None,
         host_bytes: int | None = None,
         timeout_s: float = 100.0, cuda_graphs: bool = False, ep_config: EPConfig | None = None) -> AnyContext:
    """Create a jax_engram context over `axis_name` of `mesh` (collective over the mesh's processes).

    axis_name may be a tuple of mesh axes ``("node", "gpu")``: a hierarchical EP group spanning nodes (the
    last axis inside one node; global rank = node-major): a :class:`HierContext`. The same ops and tables work
    on it; ids and tokens cross nodes through XLA collectives over the node axes (README, "Across nodes").

    Every op of the context runs inside ``jax.jit(jax.shard_map(...))`` over a mesh that places the devices as
    ``mesh`` does (``ctx.mesh``); another device order is refused when the function is lowered.

    device_bytes / host_bytes: optional per-rank reservations (bytes) of the window's device (HBM) and host
    segments, from which Engram tables and EP buffers are carved. None (default): each buffer gets a
    segment of its own when first needed. timeout_s (seconds, positive and finite) bounds every wait of every op
    of this context.

    cuda_graphs (CUDA): let XLA capture the EP ops (dispatch, cached dispatch, combine) into the CUDA graphs it
    builds around them (command buffers), so a jitted step with many small kernels is not cut in pieces at every
    EP op. Dispatches that move rows with the copy engine (large batches, see ``Context.dispatch_path``) stay
    outside graphs. The trade-off: a replayed op runs no host code, so an error its kernel finds on the device
    (a timeout, bad routing) is raised by ``ctx.check()`` or by the next op of the context that is not replayed,
    not by the op itself; call ``ctx.check()`` where you need to know. No effect on CPU.

    ep_config: the context's default :class:`jax_engram.EPConfig` (tuning of the CUDA dispatch / combine kernels);
    ``dispatch(config=...)`` overrides it per call. None: the defaults.
    """
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) == 1:
            axis_name = axis_name[0]
        else:
            return HierContext(mesh, tuple(axis_name), device_bytes=device_bytes, host_bytes=host_bytes,
                               timeout_s=timeout_s, cuda_graphs=cuda_graphs, ep_config=ep_config)
    return Context(mesh, axis_name, device_bytes=device_bytes, host_bytes=host_bytes, timeout_s=timeout_s,
                   cuda_graphs=cuda_graphs, ep_config=ep_config)


def live_contexts() -> list[AnyContext]:
    """The contexts this process created with :func:`init` that are not closed yet (e.g. to close them all at the end
    of a job): :class:`Context` and :class:`HierContext` objects (not a ``HierContext``'s inner context)."""
    return list(_live)
