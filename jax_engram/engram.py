"""Engram: a huge embedding table sharded over the ranks of a context axis, read by *global* id with
one-sided loads from every peer (DeepEP V2's ``engram_write`` / ``engram_fetch``, as jit primitives).

Table. ``EngramTable(num_entries, hidden, dtype, ctx=ctx, placement=..., num_sf_packs=...)`` reserves, on every
rank, ``num_entries * hidden * itemsize`` bytes of symmetric memory (``ctx.region``): HBM (``"device"``) or
host-NUMA memory mapped into every GPU's view (``"host"``). Rank r's shard holds global ids
``[r*num_entries, (r+1)*num_entries)``, row-major. With ``num_sf_packs = P > 0`` a replicated scale-factor
table ``[num_ranks*num_entries, P]`` (float32, or int32 holding packed UE8M0x4) lives in every rank's own
memory too (written by ``write``, read locally by ``fetch``), so the table is self-contained: nothing has
to be passed around between jitted calls.

Inside ``jax.shard_map`` over the context axis, under ``jax.jit`` (local shapes)::

    done = table.write(storage, sf=None, after=None)     # storage [num_entries, hidden]: this rank's shard
    done = table.write(rows, sf, row_offset=o)           # rows [n, hidden]: its rows o..o+n (a slice at a time)
    pending = table.fetch(indices, after=done, mode="fill", sf_layout="row")   # indices [T, I] global ids
    h = ...                                              # independent XLA work overlaps the reads (GPU)
    data, sf = table.wait(pending, after=h)              # data [T, I*hidden], sf per sf_layout or None
    data, sf = table.lookup(indices, after=done, ...)    # fetch + wait

(T tokens, I = ids per token; ``done`` is a float32 [] scalar that only orders, as for every jax_engram op.)

Outside ``shard_map`` (global arrays, jit and shard_map done for you)::

    table.write_global(x, sf=None)     # x [num_ranks*num_entries, hidden] (sharded along the axis, or numpy:
                                       # moved to the devices WRITE_SLICE_BYTES per rank at a time)
    data, sf = table.lookup_global(ids)

Semantics (``docs/semantics.md``, "Engram"; the reference is
``jax_engram.reference.engram_lookup``):

* global id g -> owner ``g // num_entries``, row ``g % num_entries``; negative ids are padding: zero row
  and zero sf. Ids ``>= num_ranks*num_entries`` follow ``mode``: ``"fill"`` zero row/sf, ``"clip"`` read
  the last valid id, ``"checked"`` raise an error naming the first bad flat position and its id, once, from
  the call that looked them up; the table and the context stay usable. On CPU the fetch itself fails. On
  GPU the check runs on the device (bad ids read as zeros) and ``wait`` reads the first bad position back
  and fails the call with the same ``OUT_OF_RANGE`` message (a host sync: checked mode is for debugging).
  ``lookup_global`` waits for a checked lookup and raises :class:`jax_engram.JaxEngramError`.
* indices must be integers; int32 is used as is, other integer dtypes are converted with saturation
  (``> 2**31-1`` becomes out of range, never wraps to a valid id). Global ids are int32, so
  ``num_ranks * num_entries < 2**31``.
* ``write`` is collective: barrier (no fetch of the old table in flight anywhere), copy the shard into
  the own region, barrier (visible everywhere). A fetch that follows a write in the same program must
  be ordered after the write (``fetch(ids, after=done)``); a write that follows a lookup in the same program
  must be ordered after something computed from it (``write(x, after=data)``): independent side-effecting
  ops may run in any order. Separate jitted calls are ordered by the device stream on GPU; the ``*_global``
  methods chain an internal ordering scalar so they are ordered on every backend.
* fetch returns as soon as the reads are enqueued (GPU: on a side stream that first waits for XLA's
  stream); ``wait`` makes XLA's stream wait for them. Every buffer the reads touch (output, indices) is
  carried in the pending object until ``wait``: keep fetch and wait in the same jitted program, and do
  not use anything of a pending object except by passing it to ``wait``.
* GPU gathers (``EngramConfig``, per table or per call): an overlapped ``fetch`` uses bulk copies
  (``cp.async.bulk`` through shared memory) on ``num_sms`` CTAs (default 4), so the XLA work between fetch
  and wait keeps the other SMs; ``lookup`` (nothing to overlap) uses the full-grid gather, the lowest latency
  for small lookups. Rows whose size (or whose table offset / output address) is not a multiple of 16 bytes
  cannot move by bulk copies: there the "tma" choice runs the vector gather capped at ``num_sms`` CTAs.
  Results are identical bit for bit whichever gather runs.
* No kernel is specialised on T, I, hidden or num_entries: the kernels read them from the buffers' shapes, not
  from attributes (XLA still compiles one executable per distinct input shape, as for any jitted function;
  DeepEP JIT-compiles a kernel per (num_entries, hidden, I, num_qps) instead). An overlapped fetch's attributes
  name its call site (``slot``), so that its wait waits for that fetch alone.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_engram import _call, _ffi, _scaleout
from jax_engram.config import EngramConfig
from jax_engram.context import AnyContext, HierContext, JaxEngramError, _forget_failed_executions

__all__ = ["EngramTable", "EngramPending", "ENGRAM_DTYPES", "ENGRAM_MODES", "SF_LAYOUTS"]

#: Storage dtypes of an Engram table.
ENGRAM_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32),
                 np.dtype(ml_dtypes.float8_e4m3fn))
# The enums and limits of ffi/include/jax_engram/engram_layout.h, from the CPU module (always built).
_LAYOUT = _ffi.native("cpu").engram_layout
#: Out-of-range handling (engram_layout.h Mode).
ENGRAM_MODES = dict(_LAYOUT["modes"])
#: Scale-factor output layouts (engram_layout.h SfLayout).
SF_LAYOUTS = dict(_LAYOUT["sf_layouts"])
_SF_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))
_SF_TOKEN_ALIGN = int(_LAYOUT["sf_token_align"])
_INT32_MAX = 2**31 - 1
_NO_BAD_POSITION = int(_LAYOUT["no_bad_position"])  # flat positions T*E must stay below it

_uids = itertools.count()
_slots = itertools.count(1)  # EngramPending.slot: one per traced fetch call (its wait waits for that fetch only)

Placement = Literal["host", "device"]
EngramMode = Literal["fill", "clip", "checked"]
SfLayout = Literal["row", "tma_col_major"]


def _dtype_name(d) -> str:
    return np.dtype(d).name


def _check_config(pre: str, config):
    if config is not None and not isinstance(config, EngramConfig):
        raise TypeError(f"{pre}: config must be a jax_engram.EngramConfig, got {type(config).__name__}")
    return config


def _check_choice(op: str, what: str, value, choices) -> int:
    if value not in choices:
        raise ValueError(f"jax_engram EngramTable.{op}: {what} must be one of {tuple(choices)}, got {value!r}")
    return choices[value]


def _checked_row_offset(pre: str, row_offset: int, num_entries: int, n: int) -> int:
    """A Python int row offset checked against [0, num_entries - n] (n rows of every rank's shard written)."""
    if not 0 <= int(row_offset) <= num_entries - n:
        raise ValueError(f"{pre}: row_offset {int(row_offset)} puts the {n} rows outside the shard of "
                         f"{num_entries} rows (0 <= row_offset <= {num_entries - n})")
    return int(row_offset)


def _row_offset(pre: str, row_offset, num_entries: int, n: int) -> jax.Array:
    """A write's first row as an int32 [] array: a Python int checked (_checked_row_offset); an integer array
    (clamped into that range natively, engram::write_start_row) saturated into int32 first, so a wide offset cannot
    wrap onto a valid row."""
    last = num_entries - n
    if isinstance(row_offset, (bool, np.bool_)):
        raise TypeError(f"{pre}: row_offset must be an int or an integer [] array, got {row_offset!r}")
    if isinstance(row_offset, (int, np.integer)):
        return jnp.asarray(_checked_row_offset(pre, row_offset, num_entries, n), jnp.int32)
    off = jnp.asarray(row_offset)
    if off.shape != () or not jnp.issubdtype(off.dtype, jnp.integer):
        raise TypeError(f"{pre}: row_offset must be an int or an integer [] array, got {off.dtype}{list(off.shape)}")
    if off.dtype != jnp.int32:
        off = jnp.clip(off, 0, last).astype(jnp.int32)
    return off


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "sf", "status", "indices"],
                   meta_fields=["has_sf", "overlap", "check_total", "slot"])
@dataclasses.dataclass(frozen=True)
class EngramPending:
    """What ``EngramTable.fetch`` returns (a frozen pytree): the output buffers being filled and everything the
    reads touch. Pass it to ``EngramTable.wait`` (in the same jitted program); do not read its fields."""

    data: jax.Array
    sf: jax.Array
    status: jax.Array
    indices: jax.Array
    has_sf: bool
    overlap: bool
    check_total: int = 0  # mode="checked" on a device backend: wait raises if an id is not in [0, check_total)
    slot: int = 0  # the fetch call site (static): on GPU the wait waits for this fetch's work only


def _checked_error(e: BaseException) -> JaxEngramError:
    """The JaxEngramError of a failed checked lookup: the op's own message, without XLA's wrapping."""
    msg = str(e)
    lines = [l for l in msg.splitlines() if "index out of range in mode='checked'" in l]
    if lines:  # the handler's own line, after XLA's status code
        line = lines[0]
        i = line.find("jax_engram ")
        msg = line[i:] if i >= 0 else line
    return JaxEngramError(msg.rstrip(".") + ". The table and its context stay usable.")


class EngramTable:
    """A table of ``num_ranks * num_entries`` rows of ``hidden`` elements, sharded over the context axis.

    Args:
      num_entries: rows per rank (every rank holds the same number).
      hidden: elements per row.
      dtype: bfloat16, float16, float32 or float8_e4m3fn.
      ctx: a :class:`jax_engram.Context`, or a ("node", "gpu") context (:class:`jax_engram.HierContext`; ids
        are global over all its ranks, rows cross nodes as ``inter_node_path`` says). Construction is
        collective (every process constructs its tables in the same order) and takes memory from the context
        (``ctx.region``): from the init reservation of that placement (``device_bytes`` / ``host_bytes``) if
        one was given, else a segment of its own.
      placement: ``"host"`` (host-NUMA memory, read by the GPUs over PCIe/C2C) or ``"device"`` (HBM of the
        owner, read by peers over NVLink).
      num_sf_packs: P > 0 keeps a replicated scale-factor table ``[num_ranks*num_entries, P]`` of
        ``sf_dtype`` (required for float8_e4m3fn, which carries no scale of its own).
      sf_dtype: float32, or int32 (packed UE8M0x4).
      sf_placement: where each rank's copy of the scale-factor table lives (read locally), default HBM.
      config: how fetches run on the GPU (:class:`jax_engram.EngramConfig`: the gather of overlapped fetches
        and of lookups, the SMs the bulk-copy gather holds, ...); every op also takes ``config=`` to override
        it per call. Part of the jit cache key.
    """

    def __init__(self, num_entries: int, hidden: int, dtype: Any = jnp.bfloat16, *, ctx: AnyContext,
                 placement: Placement = "host", num_sf_packs: int = 0, sf_dtype: Any = np.float32,
                 sf_placement: Placement = "device", config: EngramConfig | None = None):
        pre = "jax_engram.EngramTable"
        ctx._check_open()
        for name, v, lo in (("num_entries", num_entries, 1), ("hidden", hidden, 1), ("num_sf_packs", num_sf_packs, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{pre}: {name} must be an int >= {lo}, got {v!r}")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt not in ENGRAM_DTYPES:
            raise TypeError(f"{pre}: dtype must be one of {[d.name for d in ENGRAM_DTYPES]}, got {dtype!r}")
        for name, v in (("placement", placement), ("sf_placement", sf_placement)):
            if v not in ("host", "device"):
                raise ValueError(f"{pre}: {name} must be 'host' or 'device', got {v!r}")
        sdt = np.dtype(sf_dtype)
        if sdt not in _SF_DTYPES:
            raise TypeError(f"{pre}: sf_dtype must be float32 or int32 (packed UE8M0x4), got {sf_dtype!r}")
        if dt == np.dtype(ml_dtypes.float8_e4m3fn) and num_sf_packs == 0:
            raise ValueError(f"{pre}: dtype float8_e4m3fn needs scale factors: pass num_sf_packs > 0 (e.g. "
                             "ceil(hidden / 128) packs of per-128-channel scales) and write the sf table")
        self.config = _check_config(pre, config) or EngramConfig()
        self.ctx = ctx
        self.num_ranks = ctx.num_ranks
        self.num_entries = int(num_entries)
        self.hidden = int(hidden)
        self.dtype = dt
        self.placement = placement
        self.num_sf_packs = int(num_sf_packs)
        self.sf_dtype = sdt
        self.sf_placement = sf_placement
        self.row_bytes = self.hidden * dt.itemsize
        self.total_entries = self.num_ranks * self.num_entries
        if self.total_entries > _INT32_MAX:
            raise ValueError(f"{pre}: num_ranks*num_entries = {self.total_entries} exceeds 2**31-1; global ids are "
                             "int32")
        self.nbytes = self.num_entries * self.row_bytes
        self.sf_nbytes = self.total_entries * self.num_sf_packs * 4
        self._token = None  # chain of the *_global calls (write -> lookups -> write ...)
        self._global_fns: dict = {}
        ctx._tables.add(self)  # ctx.close() waits for the chain
        self._hier: _scaleout.HierEngram | None = None
        if isinstance(ctx, HierContext):  # a ("node", "gpu") group: the rows live in per-node inner tables
            inner = EngramTable(num_entries, hidden, dtype, ctx=ctx.inner, placement=placement,
                                num_sf_packs=num_sf_packs, sf_dtype=sf_dtype, sf_placement=sf_placement,
                                config=config)
            try:
                self._hier = _scaleout.HierEngram(ctx, inner)
            except BaseException:
                inner.free()
                raise
            self._uid, self.region, self.sf_region = inner._uid, inner.region, inner.sf_region
            return
        self._uid = next(_uids)
        self.region = ctx.region(self.nbytes, placement, key=("engram", self._uid),
                                 what=f"Engram table ({self.num_entries} rows x {self.hidden} {dt.name} per rank)")
        self.sf_region = None
        if self.num_sf_packs:
            try:
                self.sf_region = ctx.region(
                    self.sf_nbytes, sf_placement, key=("engram_sf", self._uid),
                    what=f"Engram scale-factor table ({self.total_entries} x {self.num_sf_packs} {sdt.name}, "
                         "replicated)")
            except BaseException:
                ctx.release(self.region)
                raise

    # -------------------------------------------------------------------------------------- helpers
    def __repr__(self) -> str:
        sf = f", num_sf_packs={self.num_sf_packs} ({self.sf_dtype.name})" if self.num_sf_packs else ""
        text = (f"EngramTable({self.num_ranks} ranks x {self.num_entries} rows, hidden={self.hidden}, "
                f"{self.dtype.name}, placement={self.placement!r}{sf}, {self.nbytes} bytes per rank)")
        if self._hier is None:
            return text
        return f"Hierarchical{text} ({self.ctx.num_nodes} nodes x {self.ctx.local_size})"

    @property
    def inter_node_path(self) -> str:
        """On a ("node", "gpu") context: how this table's rows cross nodes, "gin" or "xla all_to_all" (see
        ``ctx.info()["gin"]``)."""
        if self._hier is None:
            raise AttributeError("EngramTable.inter_node_path: the table's context has one axis (no nodes to cross)")
        return self._hier.inter_node_path

    # The attributes of each op are those of its struct in ffi/handlers/engram_bindings.h, all of them and no
    # other (XLA decodes the whole attribute dictionary into the struct; ctx_id is added by _call.call).
    def _region_attrs(self) -> dict:
        r = self.sf_region
        return dict(alloc_id=self.region.alloc_id, offset=self.region.offset, num_entries=self.num_entries,
                    row_bytes=self.row_bytes, sf_alloc_id=r.alloc_id if r else 0, sf_offset=r.offset if r else 0)

    def _write_attrs(self) -> dict:
        """EngramWriteAttrs (less ctx_id)."""
        return dict(self._region_attrs(), sf_row_bytes=self.num_sf_packs * 4)

    def _fetch_attrs(self, mode: int, sf_layout: int, overlap: bool, config: EngramConfig, slot: int) -> dict:
        """EngramFetchAttrs (less ctx_id)."""
        return dict(self._region_attrs(), mode=mode, num_sf_packs=self.num_sf_packs, sf_layout=sf_layout,
                    overlap=int(overlap), **config.ffi_attrs(overlap),
                    **config.host_attrs("gpu" if mode == ENGRAM_MODES["checked"] else self.host_path(overlap, config)),
                    slot=slot)

    def host_path(self, overlap: bool, config: EngramConfig | None = None) -> Literal["cpu", "gpu"]:
        """Who moves this table's rows in a fetch with this ``overlap`` on a GPU: ``"cpu"`` (worker threads gather
        into pinned staging, the copy engine moves it: no SMs) or ``"gpu"`` (the GPU gather); the rule of
        ``EngramConfig.host_gather`` for this placement and shard size (``config``: the table's by default).
        ``mode="checked"`` fetches always take the GPU gather, whose device-side range check writes the status
        that ``wait`` raises from (checked mode is for debugging; on the host path that status word was found
        wrong for tables with host-placed scale factors)."""
        return (config or self.config).host_path(self.placement, self.nbytes, bool(overlap))

    def sf_shape(self, num_tokens: int, ids_per_token: int, sf_layout: SfLayout = "row") -> tuple[int, ...]:
        """Local shape of the sf output of a lookup of [num_tokens, ids_per_token] ids (``(0,)`` without scale
        factors): "row" -> [num_tokens, ids_per_token*P], "tma_col_major" -> [ids_per_token*P,
        align(num_tokens, 4)]."""
        _check_choice("sf_shape", "sf_layout", sf_layout, SF_LAYOUTS)
        if not self.num_sf_packs:
            return (0,)
        packs = ids_per_token * self.num_sf_packs
        if sf_layout == "row":
            return (num_tokens, packs)
        return (packs, (num_tokens + _SF_TOKEN_ALIGN - 1) // _SF_TOKEN_ALIGN * _SF_TOKEN_ALIGN)

    def _indices(self, indices, op: str):
        indices = _call.on_mesh(self.ctx, f"EngramTable.{op}", indices)
        if indices.ndim != 2:
            raise ValueError(f"jax_engram EngramTable.{op}: indices must be [num_tokens, ids_per_token] global "
                             f"ids, got shape {indices.shape}")
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(f"jax_engram EngramTable.{op}: indices must be an integer array (int32 global ids), got "
                            f"{indices.dtype}")
        T, E = indices.shape
        if T * E >= _NO_BAD_POSITION:
            raise ValueError(f"jax_engram EngramTable.{op}: num_tokens*ids_per_token = {T * E} ids per call is "
                             f"too many (limit "
                             f"{_NO_BAD_POSITION - 1})")
        if indices.dtype != jnp.int32:
            # Saturate instead of wrapping: an id beyond int32 must stay out of range, not alias a valid row.
            if indices.dtype.itemsize >= 4:  # uint32, int64, uint64 (narrower types convert exactly)
                if jnp.issubdtype(indices.dtype, jnp.signedinteger):
                    indices = jnp.clip(indices, -1, _INT32_MAX)
                else:
                    indices = jnp.minimum(indices, np.array(_INT32_MAX, indices.dtype))
            indices = indices.astype(jnp.int32)
        return indices

    def _check_write(self, storage: jax.Array, sf: Optional[jax.Array],
                     row_offset) -> tuple[jax.Array, Optional[jax.Array], jax.Array]:
        """write's arguments checked, the same on both group shapes: (storage, sf as an array or None, row_offset as
        an int32 [] array)."""
        _call.check_axis(self.ctx, "EngramTable.write")
        pre = "jax_engram EngramTable.write"
        storage = _call.on_mesh(self.ctx, "EngramTable.write", storage)
        if storage.ndim != 2 or storage.shape[1] != self.hidden or not 1 <= storage.shape[0] <= self.num_entries:
            raise ValueError(f"{pre}: storage must be [n, hidden] rows of this rank's shard, 1 <= n <= num_entries "
                             f"(the whole shard: [{self.num_entries}, {self.hidden}]; local shape inside shard_map), "
                             f"got {storage.shape}")
        n = storage.shape[0]
        if storage.dtype != self.dtype:
            raise TypeError(f"{pre}: storage dtype {storage.dtype} does not match the table's {self.dtype.name} "
                            "(no implicit conversion; cast it yourself)")
        row_offset = _row_offset(pre, row_offset, self.num_entries, n)
        if not self.num_sf_packs:
            if sf is not None:
                raise ValueError(f"{pre}: sf given but the table was created with num_sf_packs=0")
            return storage, None, row_offset
        if sf is None:
            raise ValueError(f"{pre}: the table has num_sf_packs={self.num_sf_packs}: pass sf, the scale factors of "
                             f"the written rows of every rank [num_ranks*n, P] = [{self.num_ranks * n}, "
                             f"{self.num_sf_packs}] (a whole-shard write: the replicated table, indexed by global id)")
        sf = jnp.asarray(sf)
        if sf.shape != (self.num_ranks * n, self.num_sf_packs):
            raise ValueError(f"{pre}: sf must be the scale factors of the written rows of every rank, rank-major: "
                             f"[num_ranks*n, num_sf_packs] = [{self.num_ranks * n}, {self.num_sf_packs}] (a "
                             f"whole-shard write: the replicated table, indexed by global id), got {sf.shape}")
        if sf.dtype != self.sf_dtype:
            raise TypeError(f"{pre}: sf dtype {sf.dtype} does not match the table's sf_dtype {self.sf_dtype.name}")
        return storage, sf, row_offset

    # --------------------------------------------------------------------------- in shard_map
    def write(self, storage: jax.Array, sf: Optional[jax.Array] = None, *, row_offset: int | jax.Array = 0,
              after: Optional[jax.Array] = None) -> jax.Array:
        """Collective: replace rows ``row_offset .. row_offset+n`` of this rank's shard with ``storage`` [n, hidden]
        of the table's dtype, 1 <= n <= num_entries (the whole shard: [num_entries, hidden] at row 0). With scale
        factors, ``sf`` [num_ranks*n, P] holds those rows' factors for every rank, rank-major (rank q's rows
        ``q*num_entries + row_offset ..``); each rank's replicated copy is updated (a whole-shard write: the
        replicated table [num_ranks*num_entries, P] indexed by global id).

        A write of part of the shard lets a table larger than device memory be filled a slice at a time
        (``write_global`` does that with host arrays). ``row_offset``: a Python int (checked: ``0 <= row_offset <=
        num_entries - n``) or an int32 [] array, which is clamped into that range as ``lax.dynamic_update_slice``
        clamps (a changing offset does not recompile). It is the same on every rank where the table has scale
        factors (each rank writes every rank's factors at it).

        ``after``: any array that must be computed before the write starts (e.g. the data of an earlier
        lookup of this table in the same program). Returns ``done``, a float32 [] scalar: pass it as ``after=``
        to the fetches that must see the new rows.
        """
        storage, sf, row_offset = self._check_write(storage, sf, row_offset)
        if self._hier is not None:
            return self._hier.write(storage, sf, row_offset, after=after)
        if not self.num_sf_packs:
            sf = jnp.zeros((0,), jnp.int32)
        # `after` only orders the write (stop_gradient: it may be a differentiated array, e.g. the data of a
        # lookup inside a training step; the write contributes no gradient to it).
        token = _call.new_token(self.ctx) if after is None else jax.lax.stop_gradient(jnp.asarray(after))
        return _call.call(self.ctx, "jax_engram_engram_write", _call.like(storage, (), _call.TOKEN_DTYPE), token,
                          row_offset, storage, sf, effect=True, **self._write_attrs())

    def fetch(self, indices: jax.Array, *, after: Optional[jax.Array] = None, mode: EngramMode = "fill",
              sf_layout: SfLayout = "row", overlap: bool = True,
              config: EngramConfig | None = None) -> EngramPending:
        """Enqueue the reads of rows ``indices`` [T, I] (T tokens, I ids per token; int32 global ids); returns a
        pending lookup for ``wait``.

        ``after``: the ``done`` of a ``write`` in the same program that this fetch must see (or any array that
        must be computed first; it only orders the fetch, so it may be a differentiated array: the fetch adds
        nothing to its gradient). ``mode``, for ids ``>= num_ranks*num_entries`` (negative ids are padding: zero
        rows): "fill" reads zeros, "clip" the last row, "checked" fails the call naming the first bad id (see
        docs/semantics.md, "Errors"). ``sf_layout``:
        "row" -> sf [T, I*P]; "tma_col_major" -> sf [I*P, align(T, 4)] (column-major by token, zero padding).
        ``overlap`` (GPU): run the reads on the member's side stream so that XLA work placed between fetch
        and wait overlaps them (False: on XLA's stream, the lowest latency when nothing is in between; this
        is what ``lookup`` does). No effect on CPU, where fetch reads synchronously.
        ``config``: overrides the table's :class:`EngramConfig` for this call. Who moves the rows of a host table
        is ``config.host_gather`` (default ``"auto"``: CPU threads for an overlapped fetch, no SMs); where the GPU
        gathers (device tables, or host tables it is asked to), the gather is ``config.fetch_gather`` with
        ``overlap=True`` (default: bulk copies on ``config.num_sms`` SMs) and ``config.lookup_gather`` without
        (default: the full-grid gather).
        """
        if self._hier is not None:
            return self._fetch_hierarchical(indices, after, mode, sf_layout, config)
        _call.check_axis(self.ctx, "EngramTable.fetch")
        cfg = _check_config("jax_engram EngramTable.fetch", config) or self.config
        mode_i = _check_choice("fetch", "mode", mode, ENGRAM_MODES)
        layout_i = _check_choice("fetch", "sf_layout", sf_layout, SF_LAYOUTS)
        indices = self._indices(indices, "fetch")
        T, E = indices.shape
        # Ordering only (stop_gradient: under jax.grad a differentiated `after` must not reach the FFI call, which
        # has no derivative; the rows are constants of the ids, which are integers).
        token = indices if after is None else jax.lax.stop_gradient(jnp.asarray(after))
        sf_dt = self.sf_dtype if self.num_sf_packs else np.dtype(np.int32)
        if T * E == 0:  # nothing to read (XLA cannot compile the aliasing wait on empty buffers)
            return EngramPending(jnp.zeros((T, E * self.hidden), self.dtype),
                                 jnp.zeros(self.sf_shape(T, E, sf_layout), sf_dt), jnp.zeros((), jnp.int32), indices,
                                 bool(self.num_sf_packs), bool(overlap))
        results = (_call.like(indices, (T, E * self.hidden), self.dtype),
                   _call.like(indices, self.sf_shape(T, E, sf_layout), sf_dt),
                   _call.like(indices, (), jnp.int32))
        slot = next(_slots) if overlap else 0  # lookups need none (and keep their HLO the same across traces)
        data, sf, status = _call.call(self.ctx, "jax_engram_engram_fetch", results, indices, token,
                                      **self._fetch_attrs(mode_i, layout_i, bool(overlap), cfg, slot))
        # Device backends check on the device and leave the first bad flat position in `status` (CPU: the fetch
        # itself fails); wait turns it into an error of this call.
        check_total = self.total_entries if mode == "checked" and self.ctx.platform != "cpu" else 0
        return EngramPending(data, sf, status, indices, bool(self.num_sf_packs), bool(overlap), check_total, slot)

    def wait(self, pending: EngramPending, *, after: Optional[jax.Array] = None
             ) -> tuple[jax.Array, Optional[jax.Array]]:
        """Wait for a pending fetch; returns ``(data [T, I*hidden] of the table's dtype, sf or None)``.

        ``after``: an array (any shape and dtype) that must be computed before the wait, typically the hidden
        state at the layer that consumes the rows, i.e. the result of the work meant to overlap the reads.
        Without it XLA may place the wait right after the fetch (nothing overlaps). It only orders: ``after`` may
        be differentiated (under ``jax.grad`` / ``jax.vjp`` the wait adds nothing to its gradient), and the
        rows are constants (their ids are integers). The wait returns only the rows: whatever consumes them is
        ordered after the wait, and nothing else needs to be.
        """
        _call.check_axis(self.ctx, "EngramTable.wait")
        if not isinstance(pending, EngramPending):
            raise TypeError(f"jax_engram EngramTable.wait: expected the EngramPending returned by fetch, got "
                            f"{type(pending).__name__}")
        if self._hier is not None:  # the hierarchical fetch ran the whole lookup
            return pending.data, (pending.sf if pending.has_sf else None)
        if pending.data.size == 0:
            return pending.data, (pending.sf if pending.has_sf else None)
        ops = (pending.data, pending.sf, pending.status, pending.indices,
               pending.status if after is None else jax.lax.stop_gradient(jnp.asarray(after)))
        # EngramWaitAttrs: ctx_id, overlap, slot, check_total. A checked wait (GPU) reads the fetch's status after
        # the reads and fails this call naming the first bad id, once (the OUT_OF_RANGE of the CPU fetch); the table
        # and the context stay usable. It is kept even if its results are unused, so the check always runs.
        data, sf = _call.call(self.ctx, "jax_engram_engram_wait", [_call.like(ops[0]), _call.like(ops[1])], *ops,
                              input_output_aliases={0: 0, 1: 1}, keep=bool(pending.overlap or pending.check_total),
                              overlap=pending.overlap, slot=pending.slot, check_total=pending.check_total)
        return data, (sf if pending.has_sf else None)

    def _fetch_hierarchical(self, indices, token, mode, sf_layout, config) -> EngramPending:
        """fetch on a ("node", "gpu") context: the whole path (inter-node exchange, inner reads, exchange back)
        runs here and ``wait`` only hands the result over."""
        _call.check_axis(self.ctx, "EngramTable.fetch")
        _check_choice("fetch", "mode", mode, ENGRAM_MODES)
        _check_choice("fetch", "sf_layout", sf_layout, SF_LAYOUTS)
        indices = self._indices(indices, "fetch")
        T, E = indices.shape
        sf_dt = self.sf_dtype if self.num_sf_packs else np.dtype(np.int32)
        if T * E == 0:
            return EngramPending(jnp.zeros((T, E * self.hidden), self.dtype),
                                 jnp.zeros(self.sf_shape(T, E, sf_layout), sf_dt), jnp.zeros((), jnp.int32), indices,
                                 bool(self.num_sf_packs), False)
        data, sf, status = self._hier.fetch(indices, token, mode, sf_layout, config)
        return EngramPending(data, sf, status, indices, bool(self.num_sf_packs), False)

    def lookup(self, indices: jax.Array, *, after: Optional[jax.Array] = None, mode: EngramMode = "fill",
               sf_layout: SfLayout = "row",
               config: EngramConfig | None = None) -> tuple[jax.Array, Optional[jax.Array]]:
        """``wait(fetch(indices, after=after, mode=mode, sf_layout=sf_layout, overlap=False, config=config))``:
        ``(data [T, I*hidden], sf or None)``; on GPU the reads run on XLA's stream (nothing to overlap with) with
        the config's ``lookup_gather``."""
        pending = self.fetch(indices, after=after, mode=mode, sf_layout=sf_layout, overlap=False, config=config)
        if not pending.check_total:
            # Nothing to wait for: without overlap the reads ran in XLA's stream order (GPU) or in the call (CPU),
            # so one custom call (not two) per lookup; a checked lookup still needs wait's status check.
            return pending.data, (pending.sf if pending.has_sf else None)
        return self.wait(pending)

    # ----------------------------------------------------------------------------- global API
    def _mesh_spec(self):
        return self.ctx.mesh, self.ctx.axis_name

    def _global_token(self):
        mesh, ax = self._mesh_spec()
        if self._token is None:
            # make_array_from_callback, not device_put: on a multi-process job device_put of a host array checks
            # that every process passed the same value with an XLA all-gather, and this needs no collective.
            zeros = np.zeros((self.num_ranks,), np.float32)
            self._token = jax.make_array_from_callback(zeros.shape, NamedSharding(mesh, P(ax)), lambda i: zeros[i])
        return self._token

    def _write_fn(self):
        fn = self._global_fns.get("write")
        if fn is None:
            mesh, ax = self._mesh_spec()

            def body(x, sf, off, tok):
                t = self.write(x, sf if self.num_sf_packs else None, row_offset=off, after=tok)
                return t.reshape(1)

            sm = jax.shard_map(body, mesh=mesh, in_specs=(P(ax, None), P(), P(), P(ax)), out_specs=P(ax))
            fn = self._global_fns["write"] = jax.jit(sm)
        return fn

    def write_global(self, x: jax.Array | np.ndarray, sf: jax.Array | np.ndarray | None = None, *,
                     row_offset: int = 0) -> jax.Array:
        """Collective: write rows ``row_offset .. row_offset+n`` of every rank's shard from ``x`` [num_ranks*n,
        hidden] (rank r's rows = ``x[r*n:(r+1)*n]``; a jax.Array sharded along the axis, or a host array that every
        process passes in full) and, with scale factors, their ``sf`` [num_ranks*n, P] (rank-major, as in
        ``write``). The defaults write the whole table: x [num_ranks*num_entries, hidden], rank r's shard = rows
        r*num_entries.., and the replicated sf indexed by global id.

        A host array moves to the devices in slices of at most ``WRITE_SLICE_BYTES`` of rows per rank, one
        ``write`` each, so a host-placed table larger than device memory is written from host memory (a numpy
        memmap works too); a jax.Array is written as it is. Ordered after every earlier ``*_global`` call of this
        table. Returns ``done`` (float32 [num_ranks], one per rank)."""
        pre = "jax_engram EngramTable.write_global"
        R = self.num_ranks
        rows = tuple(np.shape(x))
        if len(rows) != 2 or rows[1] != self.hidden or rows[0] % R or not 1 <= rows[0] // R <= self.num_entries:
            raise ValueError(f"{pre}: x must be [num_ranks*n, hidden] with 1 <= n <= num_entries (the whole table: "
                             f"[{self.total_entries}, {self.hidden}]), got {rows}")
        n = rows[0] // R
        if isinstance(row_offset, (bool, np.bool_)) or not isinstance(row_offset, (int, np.integer)):
            raise TypeError(f"{pre}: row_offset must be an int, got {row_offset!r}")
        row_offset = _checked_row_offset(pre, row_offset, self.num_entries, n)
        if self.num_sf_packs:
            if sf is None:
                raise ValueError(f"{pre}: the table has num_sf_packs={self.num_sf_packs}: pass sf "
                                 f"[{R * n}, {self.num_sf_packs}]")
            if tuple(np.shape(sf)) != (R * n, self.num_sf_packs):
                raise ValueError(f"{pre}: sf must be [num_ranks*n, num_sf_packs] = [{R * n}, {self.num_sf_packs}] "
                                 f"(the written rows' scale factors, rank-major), got {tuple(np.shape(sf))}")
        elif sf is not None:
            raise ValueError(f"{pre}: sf given but the table has num_sf_packs=0")
        mesh, ax = self._mesh_spec()
        if isinstance(x, jax.Array):
            return self._write_slice(self._to_global(x, P(ax, None), "x"), sf, row_offset)
        x = np.asarray(x)
        if sf is not None and not isinstance(sf, np.ndarray):
            sf = np.asarray(sf)  # replicated scale factors: small beside the rows, sliced on the host below
        step = max(1, min(n, self.WRITE_SLICE_BYTES // self.row_bytes))
        sh = NamedSharding(mesh, P(ax, None))
        for s0 in range(0, n, step):
            m = min(step, n - s0)

            def rows_of(idx, s0=s0, m=m):  # device piece idx = rank r's rows r*m.. of the slice = its rows s0.. of x
                r0 = (idx[0].start or 0) // m * n + s0
                return x[r0:r0 + m, idx[1]]

            piece = jax.make_array_from_callback((R * m, self.hidden), sh, rows_of)
            sfs = None if sf is None else np.concatenate([sf[q * n + s0:q * n + s0 + m] for q in range(R)])
            self._write_slice(piece, sfs, row_offset + s0)
        return self._token

    #: Bytes of rows per rank that ``write_global`` moves to the devices at a time from a host array.
    WRITE_SLICE_BYTES: int = 1 << 30

    def _write_slice(self, x: jax.Array, sf, row_offset: int) -> jax.Array:
        """One jitted write of global x [num_ranks*n, hidden] at row_offset (an operand: no recompile per slice)."""
        if self.num_sf_packs:
            sf = self._to_global(sf, P(), "sf")
        else:
            sf = self._to_global(np.zeros((0,), np.int32), P(), "sf")
        off = self._to_global(np.asarray(row_offset, np.int32), P(), "row_offset")
        self._token = self._write_fn()(x, sf, off, self._global_token())
        return self._token

    def _to_global(self, a, spec, name):
        mesh, _ = self._mesh_spec()
        sh = NamedSharding(mesh, spec)
        if isinstance(a, jax.Array):
            if a.sharding.is_equivalent_to(sh, a.ndim):
                return a
            if not a.is_fully_addressable:
                raise ValueError(f"jax_engram EngramTable: {name} is a multi-process array with sharding "
                                 f"{a.sharding}; expected {sh.spec} over the context's mesh")
            return jax.device_put(a, sh)
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

    def _lookup_fn(self, mode, sf_layout, sharded, config=None):
        config = config or self.config
        key = ("lookup", mode, sf_layout, sharded, config)
        fn = self._global_fns.get(key)
        if fn is None and self._hier is not None and not sharded:
            fn = self._global_fns[key] = self._hier.replicated_lookup_fn(self, mode, sf_layout, config)
        if fn is None:
            mesh, ax = self._mesh_spec()
            ids_spec = P(ax, None) if sharded else P()
            out_spec = P(ax, None) if sharded else P()

            def body(ids, tok):
                pend = self.fetch(ids, after=tok, mode=mode, sf_layout=sf_layout, overlap=False, config=config)
                data, sf = self.wait(pend)
                # The next *_global call depends on this lookup through the status word (never read).
                return (data, (sf if sf is not None else jnp.zeros((0,), jnp.int32)),
                        pend.status.reshape(1).astype(_call.TOKEN_DTYPE))

            sm = jax.shard_map(body, mesh=mesh, in_specs=(ids_spec, P(ax)),
                               out_specs=(out_spec, out_spec if self.num_sf_packs else P(), P(ax)))
            fn = self._global_fns[key] = jax.jit(sm)
        return fn

    def lookup_global(self, ids: jax.Array | np.ndarray, *, mode: EngramMode = "fill", sf_layout: SfLayout = "row",
                      sharded: Optional[bool] = None,
                      config: EngramConfig | None = None) -> tuple[jax.Array, Optional[jax.Array]]:
        """Look up global ids from outside shard_map. Two forms:

        * sharded (default for a jax.Array whose first dimension is sharded along the context axis): ids
          [num_ranks*T, I], rank r looks up rows r*T..(r+1)*T; returns data [num_ranks*T, I*hidden] sharded
          the same way and sf as the per-rank sf outputs stacked along axis 0 ([num_ranks*T, I*P] for "row",
          [num_ranks*I*P, align(T, 4)] for "tma_col_major").
        * replicated (numpy arrays, replicated jax.Arrays, or ``sharded=False``): ids [T, I] seen by every
          rank; returns replicated data [T, I*hidden] and sf ([T, I*P] or [I*P, align(T, 4)]).

        Ordered after every earlier ``*_global`` call of this table. ``config`` overrides the table's
        :class:`EngramConfig` (its ``lookup_gather`` applies). Returns ``(data, sf or None)``.
        """
        _check_choice("lookup_global", "mode", mode, ENGRAM_MODES)
        config = _check_config("jax_engram EngramTable.lookup_global", config)
        _check_choice("lookup_global", "sf_layout", sf_layout, SF_LAYOUTS)
        mesh, ax = self._mesh_spec()
        if sharded is None and self._hier is not None:
            sharded = self._hier.ids_sharded(ids)
        if np.ndim(ids) != 2:
            raise ValueError(f"jax_engram EngramTable.lookup_global: ids must be [num_tokens, ids_per_token], got "
                             f"shape {np.shape(ids)}")
        if sharded is None:
            sharded = (isinstance(ids, jax.Array) and isinstance(ids.sharding, NamedSharding)
                       and len(ids.sharding.spec) > 0 and ids.sharding.spec[0] is not None
                       and ax in (ids.sharding.spec[0] if isinstance(ids.sharding.spec[0], tuple)
                                  else (ids.sharding.spec[0],)))
        if sharded and np.shape(ids)[0] % self.num_ranks:
            raise ValueError(f"jax_engram EngramTable.lookup_global: sharded ids [num_ranks*T, I] need a first "
                             f"dimension divisible by num_ranks={self.num_ranks}, got {np.shape(ids)}")
        if not isinstance(ids, jax.Array):
            ids = np.asarray(ids)
            if not np.issubdtype(ids.dtype, np.integer):
                raise TypeError(f"jax_engram EngramTable.lookup_global: ids must be integers, got {ids.dtype}")
            if ids.dtype != np.int32:
                lo = -1 if np.issubdtype(ids.dtype, np.signedinteger) else 0
                ids = np.clip(ids, lo, _INT32_MAX).astype(np.int32)
        ids = self._to_global(ids, P(ax, None) if sharded else P(), "ids")
        fn = self._lookup_fn(mode, sf_layout, bool(sharded), config)
        if mode != "checked":
            data, sf, token = fn(ids, self._global_token())
        else:
            # Wait for the lookup (checked mode's price: a host sync) so that a bad id fails THIS call, once; the
            # failed token is never chained into the table's next call (which would fail with the same error). The
            # call itself may raise already (CPU handlers fail synchronously, e.g. with several processes).
            try:
                data, sf, token = fn(ids, self._global_token())
                jax.block_until_ready(token)
            except Exception as e:  # noqa: BLE001 - XLA's runtime error carries our message
                _forget_failed_executions({d for d in self.ctx.mesh.devices.flat
                                           if d.process_index == jax.process_index()})
                raise _checked_error(e) from None
        self._token = token
        return data, (sf if self.num_sf_packs else None)

    def _wait_global_calls(self) -> None:
        """Blocks until this table's ``*_global`` calls are done (their failures are theirs to report)."""
        if self._token is not None:
            try:
                jax.block_until_ready(self._token)
            except Exception:  # noqa: BLE001 - the call's own results carry its error; free / close never raise
                pass

    def free(self) -> None:
        """Give the table's memory back to the context (collective, like construction). It first waits for the
        table's ``*_global`` calls (JAX runs them asynchronously) and for the ops already running; a jitted call of
        your own that JAX has queued but not started fails naming the freed memory (block on its results before
        freeing to keep them). The context stays usable. With ``cuda_graphs=True`` it clears JAX's compilation
        caches, as ``Context.close`` does: a captured graph replays its kernels without a handler to refuse them."""
        if not self.ctx._closed:
            self._wait_global_calls()
        if self.ctx.cuda_graphs and self.ctx.platform != "cpu" and not self.ctx._closed:
            jax.clear_caches()
        if self._hier is not None:
            self._hier.free()
            self.region = self.sf_region = None
            return
        for r in (self.region, self.sf_region):
            if r is not None:
                self.ctx.release(r)
        self.region = self.sf_region = None
