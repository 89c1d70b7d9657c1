"""Typed configuration of jax_engram's ops: frozen dataclasses whose fields reach the native handlers as FFI
attributes, so a configuration is part of the jit cache key (no environment variables on the hot path).

One section per op family; each section is self-contained (its own types, validation and attribute mapping).

Terms: an SM (streaming multiprocessor) is one of the GPU's compute units (132 on an H200); a CTA (cooperative
thread array, a CUDA thread block) runs on one SM, so "N SMs" means a kernel of N resident CTAs; TMA (Tensor
Memory Accelerator) is the per-SM unit that copies whole blocks between global and shared memory (``cp.async.bulk``);
the copy engine is the GPU's DMA unit (``cudaMemcpyAsync``).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import numpy as np

__all__ = ["EngramConfig", "EngramGather", "EngramHostGather", "EngramLoads", "EPConfig"]


# ============================================================================================== Engram
#: How the CUDA Engram gather moves rows (engram_layout.h Gather).
#:   "tma": bulk copies (cp.async.bulk) global -> shared -> global on ``num_sms`` CTAs, one pipeline per warp
#:          with several chunks in flight; the SMs it does not hold stay free for the model.
#:   "sm":  vector loads and stores by every thread of a grid as large as what is resident at once.
#:   "sm_few": the "sm" gather on at most ``num_sms`` CTAs (what "tma" runs where bulk copies cannot).
EngramGather = Literal["tma", "sm", "sm_few"]
#: Load kind of the "sm" gather (engram_layout.h Loads): "auto" = "cg" (L2-only) for a table in HBM,
#: "volatile" (relaxed.sys, never a stale cached line) for host memory; or one of them for every placement.
EngramLoads = Literal["auto", "volatile", "cg", "plain"]

#: Who moves the rows of a host-placed table on a GPU (engram_layout.h HostGather): "cpu" = worker threads of the
#: member gather into pinned staging and the copy engine moves each chunk (no SMs held); "gpu" = the GPU gather
#: reads host memory over the link; "auto" = :meth:`EngramTable.host_path`.
EngramHostGather = Literal["auto", "cpu", "gpu"]

_GATHER = {"sm": 0, "tma": 1, "sm_few": 2}
_HOST_GATHER = {"gpu": 0, "cpu": 1}
_LOADS = {"auto": 0, "volatile": 1, "cg": 2, "plain": 3}
_MAX_NUM_SMS = 1024            # engram_layout.h kMaxGatherSms
_MIN_TMA_SMEM_KIB = 16         # engram_layout.h kTmaMinSmemBytes / 1024
_MAX_TMA_SMEM_KIB = 227        # Hopper's per-block opt-in limit; the launcher clamps to the device's
_MAX_HOST_THREADS = 256        # engram_layout.h kMaxHostThreads


@dataclasses.dataclass(frozen=True)
class EngramConfig:
    """How an :class:`~jax_engram.EngramTable`'s fetches run on the GPU (on CPU only validated, except
    ``host_threads``: the CPU backend's fetch always gathers on its host gather pool and waits for it). SM, CTA,
    TMA and the copy engine: see :mod:`jax_engram.config`.

    Attributes:
      fetch_gather: gather of an overlapped ``fetch`` (``overlap=True``, side stream). Default ``"tma"``: the
        bulk-copy gather holds ``num_sms`` SMs, so the model's kernels between fetch and wait keep the rest.
      lookup_gather: gather of ``lookup`` / ``fetch(overlap=False)`` (XLA's stream, nothing to overlap).
        Default ``"sm"``: nothing runs beside a lookup, so every SM issues its loads at once (small lookups are
        latency-bound), and large ones are bound by the link either way; ``"tma"`` makes lookups hold
        ``num_sms`` SMs too.
      num_sms: CTAs of the ``"tma"`` gather (one per SM: each takes ``tma_smem_kib`` of shared memory), the
        analogue of DeepEP's ``num_qps``; also the CTAs of ``"sm_few"``, which ``"tma"`` falls back to where rows
        cannot move by bulk copies (row size or addresses not multiples of 16 bytes).
      tma_smem_kib: shared memory per CTA of the ``"tma"`` gather (its rows in flight: 4 warps x 4 stages of
        chunks), clamped to what the device allows.
      sm_loads: load kind of the ``"sm"`` gather (:data:`EngramLoads`).
      sm_blocks_per_sm: grid cap of the full-grid ``"sm"`` gather in 256-thread blocks per SM; 0 = as many as
        are resident at once (occupancy calculator).
      host_gather: who moves the rows of a host-placed table (:data:`EngramHostGather`). ``"auto"``: CPU threads
        for an overlapped ``fetch`` (the model's kernels keep every SM); for ``lookup`` the GPU gather while the
        per-rank shard is at most 1 GiB (where the GPU's reads of host memory are fast), else CPU threads. Device
        tables always use the GPU gather. The CPU backend always gathers on its worker threads.
      host_threads: worker threads of the member's host gather pool; 0 = the backend's default (CUDA: three
        quarters of the cores, at most 12, where the gather + copy pipeline peaks; CPU backend: up to 4). The pool only grows.
    """

    fetch_gather: EngramGather = "tma"
    lookup_gather: EngramGather = "sm"
    num_sms: int = 4
    tma_smem_kib: int = 192
    sm_loads: EngramLoads = "auto"
    sm_blocks_per_sm: int = 0
    host_gather: EngramHostGather = "auto"
    host_threads: int = 0

    def __post_init__(self):
        pre = "jax_engram.EngramConfig"
        for name in ("fetch_gather", "lookup_gather"):
            v = getattr(self, name)
            if v not in _GATHER:
                raise ValueError(f"{pre}: {name} must be one of {tuple(_GATHER)}, got {v!r}")
        if self.host_gather not in ("auto", *_HOST_GATHER):
            raise ValueError(f"{pre}: host_gather must be one of ('auto', 'cpu', 'gpu'), got {self.host_gather!r}")
        if self.sm_loads not in _LOADS:
            raise ValueError(f"{pre}: sm_loads must be one of {tuple(_LOADS)}, got {self.sm_loads!r}")
        for name, lo, hi in (("num_sms", 1, _MAX_NUM_SMS), ("tma_smem_kib", _MIN_TMA_SMEM_KIB, _MAX_TMA_SMEM_KIB),
                             ("sm_blocks_per_sm", 0, 64), ("host_threads", 0, _MAX_HOST_THREADS)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{pre}: {name} must be an int in [{lo}, {hi}], got {v!r}")

    def gather(self, overlap: bool) -> EngramGather:
        """The gather a fetch with this ``overlap`` uses."""
        return self.fetch_gather if overlap else self.lookup_gather

    def host_path(self, placement: str, shard_bytes: int, overlap: bool) -> Literal["cpu", "gpu"]:
        """Who moves the rows of a fetch with this ``overlap`` from a table of ``placement`` whose per-rank shard is
        ``shard_bytes`` (the rule of ``host_gather="auto"``; device tables: always ``"gpu"``)."""
        if placement != "host":
            return "gpu"
        if self.host_gather != "auto":
            return self.host_gather
        if overlap:
            return "cpu"
        return "gpu" if shard_bytes <= _host_gather_gpu_max_shard_bytes() else "cpu"

    def ffi_attrs(self, overlap: bool) -> dict[str, int]:
        """The gather fields of the fetch handler's attributes for a fetch with this ``overlap``
        (EngramFetchAttrs in ffi/handlers/engram_bindings.h)."""
        return dict(gather=_GATHER[self.gather(overlap)], gather_sms=self.num_sms,
                    tma_smem_bytes=self.tma_smem_kib * 1024, sm_loads=_LOADS[self.sm_loads],
                    sm_blocks_per_sm=self.sm_blocks_per_sm)

    def host_attrs(self, host_path: Literal["cpu", "gpu"]) -> dict[str, int]:
        """The host-path fields of the fetch handler's attributes (host_gather 0 = gpu / 1 = cpu, host_threads)."""
        return dict(host_gather=_HOST_GATHER[host_path], host_threads=self.host_threads)


def _host_gather_gpu_max_shard_bytes() -> int:
    """engram_layout.h kHostGatherGpuMaxShardBytes (from the CPU module, which is always built)."""
    from jax_engram import _ffi

    return int(_ffi.native("cpu").engram_layout["host_gather_gpu_max_shard_bytes"])


# ================================================================================================== EP
def _ep_limits() -> dict:
    from jax_engram import _ffi  # the CPU module is always built and carries the layout headers' limits

    return _ffi.native("cpu").ep_limits


def _check_int(owner: str, name: str, v, lo: int, hi: int, allow_none: bool = False):
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{owner}.{name} must be an int{' or None' if allow_none else ''}, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{owner}.{name} must be in [{lo}, {hi}], got {v}")


_COPY_ENGINE_MODES = {"auto": 0, "never": 1, "always": 2}  # EpCopyMode in kernels/cuda/ep_copy_engine.h


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Tuning of the EP ops: the CUDA dispatch / combine kernels (ignored by the CPU backend) and, for every backend,
    the one-rank path (``one_rank``). The defaults are the tuned ones.

    Attributes:
      dispatch_copy_engine: how a dispatch moves x's rows to the peers. ``"auto"``: the copy engine when a peer is
        expected to receive nearly all of a rank's tokens (>= 95 %, e.g. 2 ranks at top-8) and
        ``max_tokens_per_rank * row bytes >= 4 MiB``, else SM stores; ``"never"``: SM stores; ``"always"``: the copy
        engine whenever the device and config allow it (stream memory operations, 16-byte rows, 2+ ranks).
        ``Context.dispatch_path`` reports the choice; it never changes results.
      copy_engine_pieces: pieces the copy-engine rows are cut into (receivers start on a piece as it lands; each
        piece costs the copy engine a fixed time), in ``[1, 32]``.
      dispatch_stage_warps: warps of the 16 per CTA that push rows in a dispatch and a cached dispatch (the others
        receive); None: the path's default (SM stores 6; copy engine: 1, cached 4). In ``[1, 15]``.
      combine_stage_warps: the same for combine; None: 8 (expand: 14). Far fewer than the default can be much
        slower for the expand combine, whose expert side sums several rows per pushed row.
      one_rank: how a flat context of ONE rank runs dispatch / combine. ``"local"`` (default): a local permutation
        in plain JAX (nothing crosses a link at one rank: no dispatch / combine kernel, no staging buffer), bit for
        bit the layouts, sums and gradients of the kernels, behind a small guard call per op that keeps their
        errors: bad routing (an expert id outside ``[-1, num_experts)``, a duplicate in a token) fails the dispatch
        with the kernels' error and leaves the context unusable, and a closed context or one with an error refuses
        the op. What it does not check is a handle's arrays (the kernels' check that a handle comes from this
        context's dispatch). ``"kernels"``: the kernels of every group size (for tests and benchmarks that compare
        the two).
    """

    dispatch_copy_engine: Literal["auto", "never", "always"] = "auto"
    copy_engine_pieces: int = 4
    dispatch_stage_warps: Optional[int] = None
    combine_stage_warps: Optional[int] = None
    one_rank: Literal["kernels", "local"] = "local"

    def __post_init__(self):
        if self.dispatch_copy_engine not in _COPY_ENGINE_MODES:
            raise ValueError(f"EPConfig.dispatch_copy_engine must be one of {sorted(_COPY_ENGINE_MODES)}, got "
                             f"{self.dispatch_copy_engine!r}")
        if self.one_rank not in ("kernels", "local"):
            raise ValueError(f"EPConfig.one_rank must be 'kernels' or 'local', got {self.one_rank!r}")
        lim = _ep_limits()
        _check_int("EPConfig", "copy_engine_pieces", self.copy_engine_pieces, 1, lim["max_copy_pieces"])
        for name in ("dispatch_stage_warps", "combine_stage_warps"):
            _check_int("EPConfig", name, getattr(self, name), 1, lim["max_stage_warps"], allow_none=True)
        # exact Python ints: the attributes are part of the cache key, and np.int64(4) == 4 hashes alike anyway
        for name in ("copy_engine_pieces", "dispatch_stage_warps", "combine_stage_warps"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, int(v))

    @property
    def copy_engine_mode(self) -> int:
        """The native policy's mode code (EpCopyMode)."""
        return _COPY_ENGINE_MODES[self.dispatch_copy_engine]


def ep_config(value, where: str) -> EPConfig:
    """``value`` as an EPConfig (None: the defaults), or a TypeError naming ``where``."""
    if value is None:
        return EPConfig()
    if not isinstance(value, EPConfig):
        raise TypeError(f"{where} must be a jax_engram.EPConfig or None, got {type(value).__name__}")
    return value
