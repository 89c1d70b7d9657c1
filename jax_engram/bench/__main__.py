"""``python -m jax_engram.bench engram|ep|model|all``: run the benchmarks and write a report (table, JSON, PNG plots).

Examples::

    python -m jax_engram.bench all --smoke                       # tiny sizes, CPU when there is no GPU
    python -m jax_engram.bench model --out-dir out               # Engram in a 16-layer model step (one GPU)
    python -m jax_engram.bench model --smoke --platform cpu      # the same on 4 CPU devices, seconds
    python -m jax_engram.bench ep --out-dir out                  # one process over every local GPU
    python -m jax_engram.bench engram -- --deepep-only           # arguments after -- go to the script
    python -m jax_engram.bench ep --processes 2 --platform cuda  # one process per GPU (jax_engram.launch)
    python -m jax_engram.bench --replot benchmarks/results       # tables and plots from saved JSON only

Files in ``--out-dir`` (default ``bench_out``): ``<name>.json`` (the script's results), ``<name>.log`` (its
whole output), the plots (``engram_device.png``, ``engram_host.png``, ``ep_dispatch.png``, ``ep_combine.png``,
``model_step.png``)
and ``report.json`` (what ran, exit codes, wall times, file names). Exit status 0 only if every benchmark
exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jax_engram.bench import report

# "all" runs engram and ep; model (48 GiB of host tables by default) runs when named.
SCRIPTS = {"engram": "bench_engram.py", "ep": "bench_ep.py", "model": "bench_model.py"}
SMOKE_ARGS = {"engram": ["--tiny"], "ep": ["--smoke"], "model": ["--smoke"]}
# JSON names the scripts write (bench_*.py --out); results/ in the repository uses the *_2xh200 names.
JSON_NAMES = {"engram": ("engram.json", "engram_2xh200.json"), "ep": ("ep.json", "ep_2xh200.json"),
              "model": ("model.json", "model_h200.json")}
TABLES = {"engram": report.engram_table, "ep": report.ep_table, "model": report.model_table}
PLOTS = {"engram": report.plot_engram, "ep": report.plot_ep, "model": report.plot_model}


def find_scripts(explicit: str | None = None) -> Path:
    """The directory holding the benchmark scripts (SCRIPTS): ``explicit``, else the source checkout's
    ``benchmarks/`` beside the package, else the copy installed with the package (``bench/scripts``)."""
    here = Path(__file__).resolve().parent
    cands = ([Path(explicit)] if explicit else []) + [here.parents[1] / "benchmarks", here / "scripts"]
    for c in cands:
        if all((c / s).is_file() for s in SCRIPTS.values()):
            return c
    raise SystemExit(f"python -m jax_engram.bench: benchmark scripts ({', '.join(SCRIPTS.values())}) not found in "
                     + ", ".join(str(c) for c in cands) + "; pass --scripts DIR")


def _command(name: str, scripts: Path, a: argparse.Namespace, json_path: Path, extra: list[str]) -> list[str]:
    script = str(scripts / SCRIPTS[name])
    args = (SMOKE_ARGS[name] if a.smoke else []) + ["--out", str(json_path)] + extra
    if a.processes > 1:
        return [sys.executable, "-m", "jax_engram.launch", "-n", str(a.processes), "--platform",
                "cuda" if a.platform in ("cuda", "gpu") else "cpu", "--devices-per-process",
                str(a.devices_per_process), "--timeout", str(a.timeout), script] + args
    return [sys.executable, "-u", script] + args


class _Progress:
    """A progress bar over the script's measurements (the lines that state a configuration): tqdm when it is
    installed and stderr is a terminal, else one plain line per measurement."""

    def __init__(self, name: str, enabled: bool):
        self.name, self.n, self.bar = name, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                if sys.stderr.isatty():
                    self.bar = tqdm(desc=f"bench {name}", unit=" measurements", file=sys.stderr, dynamic_ncols=True,
                                    bar_format="{desc}: {n_fmt}{unit} [{elapsed}]{postfix}")
            except ImportError:
                self.bar = None

    def line(self, text: str) -> None:
        if "config:" not in text or any(s in text for s in (" | baseline ", "ceiling", "cuda_graphs=")):
            return
        self.n += 1
        what = text.split("config:", 1)[1].split(" | ")[0].strip()
        skip = ("devices=", "device_kind=", "sms=", "backend=", "jax=", "NVIDIA", "H200", "ranks=", "rows_per_rank=",
                "row_bytes=", "MiB_per_rank=", "A=1")
        what = " ".join(w for w in what.split() if not w.startswith(skip))
        if self.bar is not None:
            self.bar.set_postfix_str(what[:90], refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"bench {self.name} [{self.n}] {what[:110]}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _scrub(res: dict) -> dict:
    """No machine paths in the saved JSON: the output path the script was given becomes its file name."""
    args = res.get("args")
    if isinstance(args, dict) and isinstance(args.get("out"), str) and args["out"]:
        args["out"] = os.path.basename(args["out"])
    return res


def _render(name: str, res: dict, out_dir: Path) -> tuple[str, list[str]]:
    table = TABLES[name](res)
    try:
        plots = PLOTS[name](res, str(out_dir))
    except ImportError as e:  # matplotlib missing: the table and JSON still stand; say what is missing
        print(f"bench {name}: no plots ({e}); pip install 'jax-engram[bench]' (matplotlib)", file=sys.stderr)
        plots = []
    return table, plots


def _shown(arg: str) -> str:
    """A command argument as the report and log show it: paths relative to the working directory when below it,
    else just the file name (no machine paths in files that may get committed)."""
    if not os.path.isabs(arg):
        return arg
    rel = os.path.relpath(arg)
    return rel if not rel.startswith("..") else os.path.basename(arg)


def run_one(name: str, scripts: Path, a: argparse.Namespace, out_dir: Path, extra: list[str]) -> dict:
    json_path = out_dir / JSON_NAMES[name][0]
    log_path = out_dir / f"{name}.log"
    json_path.unlink(missing_ok=True)
    cmd = _command(name, scripts, a, json_path, extra)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if a.platform != "auto" and a.processes <= 1:
        env["JAX_PLATFORMS"] = a.platform
    t0 = time.perf_counter()
    prog = _Progress(name, enabled=not a.quiet and not a.verbose)
    with open(log_path, "w") as log:
        log.write("$ python " + " ".join(_shown(c) for c in cmd[1:]) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                bufsize=1)
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-60:]
            if a.verbose:
                sys.stdout.write(line)
                sys.stdout.flush()
            prog.line(line)
        rc = proc.wait()
    prog.close()
    wall = time.perf_counter() - t0
    shown = ["python"] + [_shown(c) for c in cmd[1:]]
    out = dict(benchmark=name, command=" ".join(shown),
               rc=rc, wall_s=round(wall, 1), json=json_path.name, log=log_path.name, plots=[])
    if rc != 0 or not json_path.is_file():
        print(f"bench {name}: FAILED (exit status {rc}{', no JSON written' if rc == 0 else ''}); last lines of "
              f"{log_path}:\n" + "".join(tail[-40:]), file=sys.stderr)
        out["rc"] = rc or 1
        return out
    res = _scrub(json.loads(json_path.read_text()))
    json_path.write_text(json.dumps(res, indent=1) + "\n")
    table, plots = _render(name, res, out_dir)
    print(table, flush=True)
    out["plots"] = [os.path.basename(p) for p in plots]
    print(f"bench {name}: {wall:.0f} s; wrote {json_path}, {log_path}"
          + "".join(f", {out_dir / p}" for p in out["plots"]), flush=True)
    return out


def replot(src: Path, out_dir: Path) -> int:
    """Tables and plots from saved JSON files (``engram.json``/``ep.json`` or the results/ names)."""
    found = 0
    for name, names in JSON_NAMES.items():
        for fn in names:
            p = src / fn
            if p.is_file():
                table, plots = _render(name, json.loads(p.read_text()), out_dir)
                print(table)
                print(f"{p}: " + ", ".join(str(Path(q)) for q in plots), flush=True)
                found += 1
                break
    if not found:
        print(f"no {', '.join(n for v in JSON_NAMES.values() for n in v)} in {src}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m jax_engram.bench", description=__doc__.splitlines()[0].replace("``", ""),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("which", nargs="?", choices=["engram", "ep", "model", "all"], default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (bench_engram --tiny, bench_ep / bench_model --smoke): "
                    "checks the plumbing in a minute on CPU, measures nothing meaningful")
    ap.add_argument("--out-dir", default="bench_out", help="where the JSON, logs and plots go (default bench_out)")
    ap.add_argument("--platform", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: what jax finds (GPUs if any); cpu forces the CPU backend")
    ap.add_argument("--processes", type=int, default=1, help="run under jax_engram.launch with this many processes")
    ap.add_argument("--devices-per-process", type=int, default=1, help="with --processes")
    ap.add_argument("--timeout", type=float, default=3600.0, help="with --processes: the launcher's timeout")
    ap.add_argument("--scripts", default=None, help="directory holding the bench_*.py scripts")
    ap.add_argument("--replot", metavar="DIR", default=None,
                    help="make the tables and plots from the JSON in DIR (no benchmark runs)")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the scripts' output instead of a progress bar")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    a = ap.parse_args(argv)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.replot:
        return replot(Path(a.replot), out_dir)
    if a.which is None:
        ap.error("say which benchmark: engram, ep, model or all (or --replot DIR)")
    names = ["engram", "ep"] if a.which == "all" else [a.which]
    if extra and len(names) > 1:
        ap.error("arguments after -- go to one script: use engram, ep or model, not all")
    scripts = find_scripts(a.scripts)
    runs = [run_one(n, scripts, a, out_dir, extra) for n in names]
    (out_dir / "report.json").write_text(json.dumps(dict(runs=runs), indent=1) + "\n")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
