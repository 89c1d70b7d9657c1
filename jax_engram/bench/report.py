"""Tables and plots from the JSON files that benchmarks/bench_engram.py and bench_ep.py write.

Nothing here touches a device or imports JAX: a report can be re-made from a saved JSON on any machine
(``python -m jax_engram.bench --replot DIR``). Plots use matplotlib's Agg backend (PNG files, no display).

Every plot puts our op, the JAX baselines of the same run and the hardware ceiling of the same run on the same
axes: latency (µs per call) and bandwidth (GB/s that crossed a link, the unit the ceiling is measured in) against
the bytes each rank moves.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Sequence

__all__ = ["engram_table", "ep_table", "model_table", "plot_engram", "plot_ep", "plot_model", "render_table"]


# ----------------------------------------------------------------------------------------------- tables
def _fmt(v: Any, spec: str | None) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if spec and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    return str(v)


def render_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str | None]], title: str = "") -> str:
    """Plain-text table; ``columns`` are ``(key, header, format spec or None)``; numbers right-aligned."""
    head = [h for _, h, _ in columns]
    body = [[_fmt(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max([len(head[i])] + [len(b[i]) for b in body]) for i in range(len(columns))]
    numeric = [all(isinstance(r.get(k), (int, float)) or r.get(k) is None for r in rows) for k, _, _ in columns]

    def line(cells):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    out = ([title] if title else []) + [line(head), "  ".join("-" * w for w in widths)] + [line(b) for b in body]
    return "\n".join(out)


def _kib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1024.0


def engram_rows(res: dict) -> list[dict]:
    """One row per (placement, hidden, T): our fetch+wait against the best baseline and the ceiling."""
    by_key: dict[tuple, dict] = {}
    for r in res.get("rows", []):
        key = (r.get("placement"), r.get("hidden"), r.get("T"))
        d = by_key.setdefault(key, dict(placement=key[0], hidden=key[1], T=key[2], KiB=_kib(r.get("bytes"))))
        if "us" not in r:
            continue
        us = r["us"] if r.get("us_call") is None else min(r["us"], r["us_call"])
        if r["impl"] == "engram fetch+wait":
            d.update(us=r["us"], gbps=r.get("remote_gbps"), pct_ceil=r.get("pct_ceil"), speedup=r.get("speedup"),
                     verified=r.get("verified"))
        elif r["impl"] in ("gspmd take", "all_to_all lookup", "pinned_host take"):
            d[r["impl"]] = us
    return [by_key[k] for k in sorted(by_key, key=lambda k: (str(k[0]), k[1] or 0, k[2] or 0))]


def engram_table(res: dict) -> str:
    env = res.get("env", {})
    cols = [("placement", "placement", None), ("hidden", "hidden", None), ("T", "T", None),
            ("KiB", "KiB/rank", ".1f"), ("us", "engram us", ".2f"), ("gspmd take", "gspmd take us", ".1f"),
            ("all_to_all lookup", "all_to_all us", ".1f"), ("pinned_host take", "pinned_host take us", ".1f"),
            ("gbps", "remote GB/s", ".1f"),
            ("pct_ceil", "% ceiling", ".1f"), ("speedup", "speedup", ".1f"), ("verified", "verified", None)]
    title = (f"Engram lookup: {res.get('ranks')} ranks, {env.get('device_kind')} ({env.get('backend')}), "
             f"E={res.get('args', {}).get('E')}, jax {env.get('jax')}")
    out = [render_table(engram_rows(res), cols, title)] if res.get("rows") else []
    if res.get("sizes"):
        out.append(render_table(res["sizes"], [("impl", "impl", None), ("size_gib", "table GiB", ".3g"),
                                               ("us", "us", ".1f"), ("gbps", "GB/s", ".1f"),
                                               ("pct_own_best", "% own best", ".0f"), ("pct_link", "% link", ".0f")],
                                f"Engram host fetch by host table size per rank ({env.get('device_kind')}, "
                                f"{env.get('backend')})"))
    return "\n\n".join(out)


def ep_rows(res: dict) -> list[dict]:
    """Our runs at the default SM count plus the baselines, one row per (tokens, dtype, layout, path)."""
    out = []
    for r in res.get("runs", []):
        out.append(dict(tokens=r["tokens"], dtype=r["dtype"], layout=r["layout"], sms=r.get("sms"),
                        path=r.get("dispatch_path"), dispatch_us=r.get("dispatch_us"),
                        dispatch_gbps=r.get("dispatch_physical_gbps"), dispatch_pct=r.get("dispatch_pct_ceiling"),
                        combine_us=r.get("combine_us"), combine_gbps=r.get("combine_physical_gbps"),
                        combine_pct=r.get("combine_pct_ceiling"),
                        ok=(r.get("check") or {}).get("ok")))
    for n, bl in sorted(res.get("baselines", {}).items(), key=lambda kv: int(kv[0])):
        for key, b in bl.items():
            if b.get("supported"):
                out.append(dict(tokens=int(n), dtype="bf16", layout=key, dispatch_us=b["dispatch_us"],
                                combine_us=b["combine_us"], ok=(b.get("check") or {}).get("ok")))
    return out


def ep_table(res: dict) -> str:
    env = res.get("env", {})
    a = res.get("args", {})
    cols = [("tokens", "tokens", None), ("dtype", "dtype", None), ("layout", "layout / baseline", None),
            ("sms", "SMs", None), ("path", "dispatch rows by", None), ("dispatch_us", "dispatch us", ".1f"), ("dispatch_gbps", "GB/s", ".0f"),
            ("dispatch_pct", "% ceil", ".0f"), ("combine_us", "combine us", ".1f"), ("combine_gbps", "GB/s", ".0f"),
            ("combine_pct", "% ceil", ".0f"), ("ok", "check", None)]
    c = (res.get("ceiling") or {}).get("one_way", {}).get("gbps")
    title = (f"EP dispatch / combine: {res.get('ranks')} ranks, {env.get('device_kind')} ({env.get('backend')}), "
             f"hidden {a.get('hidden')}, top-{a.get('topk')} of {a.get('experts')}, jax {env.get('jax')}"
             + (f", P2P ceiling {c:.0f} GB/s one way" if c else ""))
    return render_table(ep_rows(res), cols, title)


# ------------------------------------------------------------------------------------------------ plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _finite(points: Iterable[tuple[float, float | None]]) -> tuple[list[float], list[float]]:
    pts = sorted((x, y) for x, y in points if x and y is not None and math.isfinite(y) and y > 0)
    return [p[0] for p in pts], [p[1] for p in pts]


def _panel(ax, series: list[tuple[str, list[tuple[float, float | None]], dict]], ceiling: tuple[float, str] | None,
           ylabel: str, xlabel: str) -> None:
    for label, pts, style in series:
        xs, ys = _finite(pts)
        if xs:
            ax.plot(xs, ys, label=label, **style)
    if ceiling and ceiling[0]:
        ax.axhline(ceiling[0], color="black", linestyle="--", linewidth=1, label=f"ceiling: {ceiling[1]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _save(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ours(**kw) -> dict:
    return dict(marker="o", linewidth=2, **kw)


def _base(**kw) -> dict:
    return dict(marker="s", linestyle=":", **kw)


def plot_engram(res: dict, out_dir: str, prefix: str = "engram") -> list[str]:
    """One PNG per placement: latency and bandwidth vs KiB per rank, at the hidden size of the T sweep (the most
    common hidden in the run); our lookup, the baselines of that placement (device: takes from HBM; host: the
    host-memory take) and the same-run ceiling (none on CPU). At one rank a device table's rows are all local: its
    bandwidth panel shows local GB/s against the HBM copy ceiling. A --sizes run adds ``<prefix>_sizes.png``: GB/s
    per host path against host table size with the CPU-only gather and the link. Returns the paths."""
    plt = _pyplot()
    rows = [r for r in res.get("rows", []) if "us" in r]
    paths = _plot_engram_sizes(res, out_dir, prefix, plt) if res.get("sizes") else []
    if not rows:
        return paths
    hiddens = [r["hidden"] for r in rows]
    h0 = max(set(hiddens), key=hiddens.count)
    ranks = res.get("ranks") or 1
    env = res.get("env", {})
    gpu = env.get("backend") not in (None, "cpu")
    ceil = res.get("ceilings", {})
    for placement in sorted({r["placement"] for r in rows}):
        sel = [r for r in rows if r["placement"] == placement and r["hidden"] == h0]
        local = placement == "device" and ranks == 1
        remote = 1.0 if local else ((ranks - 1) / ranks if placement == "device" else 1.0)
        if local:
            cg = ((ceil.get("local_hbm") or {}).get("copy") or {}).get("gbps"), "HBM copy (bytes counted once)"
            bw_label = "GB/s read from local HBM"
        elif placement == "device":
            p = ceil.get("p2p", {})
            cg = (p.get("bidir") or {}).get("per_direction_gbps"), "P2P copy per direction, both ways busy"
            bw_label = "GB/s over the link (remote rows)"
        else:
            h = ceil.get("host_to_device", {})
            cg = (h.get("h2d") or {}).get("gbps"), "pinned host -> device copy"
            bw_label = "GB/s over the link (host rows)"
        if not gpu:
            cg = None  # a CPU run has no GPU ceilings
        impls = ((("gspmd take", "tab:orange"), ("all_to_all lookup", "tab:green")) if placement == "device"
                 else (("pinned_host take", "tab:orange"),))
        lat, bw = [], []
        for impl, style in (("engram fetch+wait", _ours(color="tab:blue")),) + tuple(
                (i, _base(color=c)) for i, c in impls):
            pts = [(r["bytes"] / 1024.0, r["us"] if r.get("us_call") is None or impl.startswith("engram")
                    else min(r["us"], r["us_call"])) for r in sel if r["impl"] == impl]
            label = "jax_engram lookup" if impl.startswith("engram") else f"JAX {impl}"
            lat.append((label, pts, style))
            bw.append((label, [(x, (x * 1024.0 * remote) / (us * 1e-6) / 1e9 if us else None) for x, us in pts],
                       style))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        xl = f"KiB looked up per rank (hidden {h0}, E={res.get('args', {}).get('E')}, T varies)"
        _panel(a1, lat, None, "µs per lookup", xl)
        _panel(a2, bw, cg if cg and cg[0] else None, bw_label, xl)
        fig.suptitle(f"Engram lookup, placement={placement}: {ranks} ranks, {env.get('device_kind')} "
                     f"({env.get('backend')}), jax {env.get('jax')}", fontsize=10)
        paths.append(_save(plt, fig, out_dir, f"{prefix}_{placement}.png"))
    return paths


def _plot_engram_sizes(res: dict, out_dir: str, prefix: str, plt) -> list[str]:
    rows = [r for r in res["sizes"] if r.get("gbps")]
    if not rows:
        return []
    env = res.get("env", {})
    gpu = env.get("backend") not in (None, "cpu")
    series = []
    colors = iter(("tab:blue", "tab:purple", "tab:orange", "tab:green", "tab:red", "tab:gray"))
    for impl in sorted({r["impl"] for r in rows}):
        style = (_ours if impl.startswith("engram") else _base)(color=next(colors, "black"))
        series.append((impl, [(r["size_gib"], r["gbps"]) for r in rows if r["impl"] == impl], style))
    link = ((res.get("ceilings") or {}).get("host_to_device") or {}).get("h2d", {}).get("gbps")
    fig, ax = plt.subplots(1, 1, figsize=(7.5, 4.8))
    _panel(ax, series, (link, "pinned host -> device copy") if gpu and link else None, "GB/s of rows fetched",
           f"host table GiB per rank ({rows[0]['bytes'] / 2**20:.1f} MiB of {rows[0]['row_bytes']}-B rows per fetch)")
    hm = (res.get("ceilings") or {}).get("host_memory") or {}
    if hm.get("memcpy_gbps"):
        ax.axhline(hm["memcpy_gbps"], color="gray", linestyle="-.", linewidth=1,
                   label=f"host memcpy ({hm.get('threads')} threads)")
        ax.legend(fontsize=7)
    fig.suptitle(f"Engram host fetch by table size: {env.get('device_kind')} ({env.get('backend')})", fontsize=10)
    return [_save(plt, fig, out_dir, f"{prefix}_sizes.png")]


def plot_ep(res: dict, out_dir: str, prefix: str = "ep") -> list[str]:
    """One PNG per op (dispatch, combine): latency and physical link bandwidth vs tokens per rank for each
    (dtype, layout) at the default SM count, the bf16 baselines, and the same-run P2P ceiling."""
    plt = _pyplot()
    runs = res.get("runs", [])
    if not runs:
        return []
    env = res.get("env", {})
    a = res.get("args", {})
    default_sms = {}
    for r in runs:  # the first run of a (tokens, dtype, layout) is the default SM count and dispatch path
        default_sms.setdefault((r["tokens"], r["dtype"], r["layout"]), r)
    main = list(default_sms.values())
    # the P2P ceiling is a GPU figure: a CPU run's device_put between CPU devices is not drawn as one
    gpu = env.get("backend") not in (None, "cpu")
    c1 = (res.get("ceiling") or {}).get("one_way", {}).get("gbps") if gpu else None
    # baselines move bf16 rows with the same routing as our bf16 runs: same physical bytes per token count
    phys = {r["tokens"]: r["row_bytes"] * r["remote_rows"] for r in main if r["dtype"] == "bf16"}
    comb_phys = {r["tokens"]: r["hidden"] * 2 * r["remote_rows"] for r in main if r["dtype"] == "bf16"}
    colors = {"bf16": "tab:blue", "fp8": "tab:purple"}
    paths = []
    for op in ("dispatch", "combine"):
        lat, bw = [], []
        for dt, lay in sorted({(r["dtype"], r["layout"]) for r in main}):
            if op == "combine" and dt != "bf16":
                continue  # the combine of an fp8 dispatch moves the same bf16 rows: one series is enough
            sel = [r for r in main if r["dtype"] == dt and r["layout"] == lay]
            style = _ours(color=colors.get(dt, "tab:blue"), linestyle="-" if lay == "nonexpand" else "--")
            label = f"jax_engram {lay}" + (f" {dt}" if op == "dispatch" else "")
            lat.append((label, [(r["tokens"], r[f"{op}_us"]) for r in sel], style))
            bw.append((label, [(r["tokens"], r.get(f"{op}_physical_gbps")) for r in sel], style))
        names = {}
        for n, bl in res.get("baselines", {}).items():
            for key, b in bl.items():
                if b.get("supported"):
                    names.setdefault(key, (b.get("name", key), []))[1].append((int(n), b[f"{op}_us"]))
        for i, (key, (name, pts)) in enumerate(sorted(names.items())):
            style = _base(color=("tab:orange", "tab:green", "tab:red")[i % 3])
            lat.append((f"JAX {name} (bf16)", pts, style))
            nb = phys if op == "dispatch" else comb_phys
            bw.append((f"JAX {name} (bf16)", [(t, nb[t] / (us * 1e-6) / 1e9 if t in nb and us else None)
                                              for t, us in pts], style))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        xl = f"tokens per rank (hidden {a.get('hidden')}, top-{a.get('topk')} of {a.get('experts')})"
        _panel(a1, lat, None, f"µs per {op}", xl)
        _panel(a2, bw, (c1, "P2P copy, one way") if c1 else None, "GB/s received from other ranks", xl)
        fig.suptitle(f"EP {op}: {res.get('ranks')} ranks, {env.get('device_kind')} ({env.get('backend')}), "
                     f"jax {env.get('jax')}", fontsize=10)
        paths.append(_save(plt, fig, out_dir, f"{prefix}_{op}.png"))
    return paths


# ------------------------------------------------------------------------------------------- model step
def model_rows(res: dict) -> list[dict]:
    """One row per (table size, variant): ms and overhead % against ``resident`` and ``none`` per (T, mode)."""
    by: dict[tuple, dict] = {}
    for r in res.get("steps", []):
        key = (r.get("table_gib"), r["variant"])
        d = by.setdefault(key, dict(table_gib=r.get("table_gib"), variant=r["variant"]))
        col = f"T{r['T']} {r['mode']}"
        if "ms" in r:
            d[f"{col} ms"] = r["ms"]
            d[f"{col} vs res"] = r.get("vs_resident_pct")
            d[f"{col} vs none"] = r.get("vs_none_pct")
            d[f"{col} b2b ms"] = r.get("b2b_ms")
            d[f"{col} b2b vs res"] = r.get("b2b_vs_resident_pct")
        else:
            d[f"{col} ms"] = None
            d["skipped"] = "skipped" if r.get("skipped") else "error"
    for d in by.values():
        d.setdefault("skipped", "")
    order = {}
    for i, r in enumerate(res.get("steps", [])):
        order.setdefault(r["variant"], i)
    return [by[k] for k in sorted(by, key=lambda k: (k[0] or 0, order.get(k[1], 0)))]


def model_table(res: dict) -> str:
    """The model benchmark's table (benchmarks/bench_model.py): variant x (T, fwd/train), ms and overhead %."""
    env, cfg = res.get("env", {}), res.get("config", {})
    cols_seen = []
    for r in res.get("steps", []):
        c = f"T{r['T']} {r['mode']}"
        if c not in cols_seen:
            cols_seen.append(c)
    cols = [("table_gib", "table GiB", ".3g"), ("variant", "variant", None)]
    for c in cols_seen:
        cols += [(f"{c} ms", f"{c} ms", ".2f"), (f"{c} vs res", "vs resident %", "+.1f"),
                 (f"{c} vs none", "vs none %", "+.1f")]
        if any(r.get("b2b_ms") is not None for r in res.get("steps", []) if f"T{r['T']} {r['mode']}" == c):
            cols += [(f"{c} b2b ms", "back to back ms", ".2f"), (f"{c} b2b vs res", "vs resident %", "+.1f")]
    cols.append(("skipped", "", None))
    tinfo = res.get("tables") or [{}]
    title = (f"Engram in a model step: {res.get('ranks')} ranks, {env.get('device_kind')} ({env.get('backend')}), "
             f"jax {env.get('jax')}; {cfg.get('layers')} layers, hidden {cfg.get('hidden')}, Engram at "
             f"{cfg.get('engram_layers')}, E={cfg.get('E')}, {cfg.get('row_dtype')} rows of {cfg.get('row_bytes')} B, "
             f"{len(cfg.get('engram_layers') or [])} host tables of {tinfo[0].get('rows_per_table')} rows")
    out = [render_table(model_rows(res), cols, title),
           "(ms: one call timed to its end; back to back: calls enqueued while the previous one runs, as a training "
           "loop runs them)"]
    fetch = [dict(r, note=r.get("skipped") or r.get("error") or "") for r in res.get("fetch", [])]
    if fetch:
        h2d = (res.get("ceilings") or {}).get("h2d_gbps")
        out.append("")
        out.append(render_table(fetch, [("table_gib", "table GiB", ".3g"), ("T", "T", None), ("path", "fetch alone", None),
                                        ("bytes", "bytes", None), ("ms", "ms", ".3f"), ("gbps", "GB/s", ".1f"),
                                        ("pct_link", "% link", ".0f"), ("note", "", None)],
                                f"Fetch alone (every Engram layer's rows, scale packs included); link (pinned host "
                                f"-> device, same run): {'n/a' if not h2d else f'{h2d:.1f} GB/s'}"))
    out += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(out)


def plot_model(res: dict, out_dir: str, prefix: str = "model") -> list[str]:
    """One PNG: overhead % against ``resident`` vs table size per (variant, T, mode), and each path's fetch GB/s vs
    table size with the same run's link ceiling (none on CPU). Returns the paths."""
    plt = _pyplot()
    steps = [r for r in res.get("steps", []) if r.get("vs_resident_pct") is not None and r["variant"] != "resident"]
    if not steps:
        return []
    env, cfg = res.get("env", {}), res.get("config", {})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    keys = sorted({(r["variant"], r["T"], r["mode"]) for r in steps}, key=str)
    for v, T, mode in keys:
        pts = sorted((r["table_gib"], r["vs_resident_pct"]) for r in steps
                     if (r["variant"], r["T"], r["mode"]) == (v, T, mode))
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if mode == "train" else "--",
                label=f"{v} T={T} {mode}")
    a1.axhline(1.0, color="black", linestyle=":", linewidth=1, label="goal: +1 %")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("host rows in all (GiB)")
    a1.set_ylabel("step time vs Engram math on resident rows (%)")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=6, ncol=2)
    series = []
    fetch = [r for r in res.get("fetch", []) if r.get("gbps")]
    for path, T in sorted({(r["path"], r["T"]) for r in fetch}, key=str):
        series.append((f"{path} T={T}", [(r["table_gib"], r["gbps"]) for r in fetch
                                         if (r["path"], r["T"]) == (path, T)],
                       _ours() if path != "take_hbm" else _base()))
    h2d = (res.get("ceilings") or {}).get("h2d_gbps")
    gpu = env.get("backend") not in (None, "cpu")
    _panel(a2, series, (h2d, "pinned host -> device copy") if gpu and h2d else None, "fetch GB/s",
           "host rows in all (GiB)")
    fig.suptitle(f"Engram in a model step: {env.get('device_kind')} ({env.get('backend')}), {cfg.get('layers')} layers, "
                 f"hidden {cfg.get('hidden')}, {cfg.get('row_dtype')} rows", fontsize=10)
    return [_save(plt, fig, out_dir, f"{prefix}_step.png")]
