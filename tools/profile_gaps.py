"""Where a GPU step's time goes, from a ``jax.profiler`` trace (``create_perfetto_trace=True``): per GPU stream, the
span, the time busy and the idle gaps, the largest gaps with the activities on both sides, and the other streams'
activities. Used to compare ``bench_model.py --profile`` variants (e.g. Engram rows resident vs prefetched).
``--kernels CALLS``: instead, the GPU time per activity name over every GPU stream, divided by the CALLS calls
the trace recorded (which kernels an op is made of, e.g. ``bench_ep.py --one-rank --profile``).

    python tools/profile_gaps.py PROFILE_DIR [PROFILE_DIR ...] [--top 12] [--min-gap-us 3] [--kernels CALLS]
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def load(d: Path) -> list[dict]:
    files = sorted(d.rglob("perfetto_trace.json.gz")) or sorted(d.rglob("*.trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto trace under {d}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def streams(events: list[dict]) -> dict[tuple, dict]:
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    out: dict[tuple, dict] = defaultdict(lambda: {"events": []})
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        p = pname.get(e["pid"], str(e["pid"]))
        if "GPU" not in p and "gpu" not in p:
            continue
        key = (p, tname.get((e["pid"], e["tid"]), str(e["tid"])))
        out[key]["events"].append((float(e["ts"]), float(e["dur"]), e.get("name", "?")))
    for v in out.values():
        v["events"].sort()
    return dict(out)


def summarize(d: Path, top: int, min_gap: float) -> None:
    ss = streams(load(d))
    print(f"== {d}")
    if not ss:
        print("   no GPU streams found")
        return
    busy = {k: sum(du for _, du, _ in v["events"]) for k, v in ss.items()}
    main = max(busy, key=busy.get)
    t_first = ss[main]["events"][0][0]
    for key in sorted(ss, key=lambda k: -busy[k]):
        ev = ss[key]["events"]
        span = ev[-1][0] + ev[-1][1] - ev[0][0]
        gaps = []
        end, prev = ev[0][0] + ev[0][1], ev[0][2]
        for ts, du, name in ev[1:]:
            if ts - end >= min_gap:
                gaps.append((ts - end, end - t_first, prev, name))
            end, prev = max(end, ts + du), name
        gap_total = sum(g[0] for g in gaps)
        print(f"   {key[1][:60]:60s} {len(ev):5d} events  span {span:9.1f} us  busy {busy[key]:9.1f} us  "
              f"gaps >= {min_gap:g} us: {len(gaps)} = {gap_total:8.1f} us")
        if key == main:
            for g, at, a, b in sorted(gaps, reverse=True)[:top]:
                print(f"      gap {g:7.1f} us at +{at:9.1f}: after {a[:50]!r} before {b[:50]!r}")
        else:
            for ts, du, name in ev[:top]:
                print(f"      +{ts - t_first:9.1f} us  {du:7.1f} us  {name[:70]}")


def kernels(d: Path, top: int, calls: int) -> None:
    ss = streams(load(d))
    per: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for v in ss.values():
        for _, du, name in v["events"]:
            per[name][0] += 1
            per[name][1] += du
    total = sum(t for _, t in per.values())
    print(f"== {d}: GPU busy {total / calls:.1f} us per call, {sum(c for c, _ in per.values()) / calls:.1f} "
          f"activities per call ({calls} calls)")
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"   {t / calls:9.1f} us  {c / calls:5.1f} x  {name[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--min-gap-us", type=float, default=3.0)
    ap.add_argument("--kernels", type=int, default=0, metavar="CALLS",
                    help="GPU time per activity name, per call of the CALLS the trace recorded")
    a = ap.parse_args()
    for d in a.dirs:
        if a.kernels > 0:
            kernels(d, a.top, a.kernels)
        else:
            summarize(d, a.top, a.min_gap_us)


if __name__ == "__main__":
    main()
