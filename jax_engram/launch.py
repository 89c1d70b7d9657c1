"""Local multi-process launcher for ``jax.distributed`` jobs (tests, examples, benchmarks).

One machine, N processes, one coordinator on ``127.0.0.1``.  On CPU every process gets
``K`` virtual CPU devices and gloo collectives; on CUDA process ``i`` owns the GPUs
``local_device_ids = [i*K, ..., i*K+K-1]`` (``CUDA_VISIBLE_DEVICES`` is *not* touched).

Command line::

    python -m jax_engram.launch -n 2 [--platform cpu|cuda] [--devices-per-process K] \
        [--timeout SECONDS] script.py [script args...]

Every child's stdout/stderr is forwarded line by line as ``[rank i] ...``.  The first
non-zero exit (or the timeout, or Ctrl-C) kills every child's whole process group, the
launcher says which rank failed / that it timed out, and exits non-zero.

Inside the child script::

    from jax_engram.launch import initialize, shutdown, emit_result
    initialize()             # before anything starts a JAX backend; no-op outside the launcher
    ...
    emit_result({"ok": 1})   # one line: RESULT <json>
    shutdown()

From Python (tests)::

    from jax_engram.launch import run, LaunchError
    results = run(2, "tests/workers/hello_distributed.py", devices_per_process=2)
    # -> one parsed RESULT dict per rank; raises LaunchError (with every rank's output tail)

This module deliberately imports nothing from the rest of ``jax_engram`` and does not import
``jax`` at import time (only :func:`initialize` / :func:`shutdown` do), so the launcher works
before the native modules are built and never grabs a device in the parent process.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "LaunchConfig",
    "LaunchError",
    "JobResult",
    "config_from_env",
    "initialize",
    "shutdown",
    "emit_result",
    "parse_results",
    "free_port",
    "child_env",
    "launch",
    "run",
    "main",
]

# Environment contract between the launcher and its children.
ENV_COORDINATOR = "JAX_ENGRAM_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_ENGRAM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_ENGRAM_PROCESS_ID"
ENV_PLATFORM = "JAX_ENGRAM_PLATFORM"
ENV_DEVICES_PER_PROCESS = "JAX_ENGRAM_DEVICES_PER_PROCESS"
ENV_GPUS = "JAX_ENGRAM_GPUS"  # cuda: share this many GPUs round-robin among the ranks (unset: one GPU per rank)

RESULT_PREFIX = "RESULT "
PLATFORMS = ("cpu", "cuda")

_POLL_S = 0.05


# --------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What the launcher told this process (see :func:`config_from_env`)."""

    coordinator: str
    num_processes: int
    process_id: int
    platform: str
    devices_per_process: int
    gpus: int = 0

    @property
    def local_device_ids(self) -> list[int]:
        """CUDA devices of this process: ``[i*K, ..., i*K+K-1]``, taken modulo ``gpus`` when the job shares
        ``gpus`` GPUs among more ranks (several processes on one GPU: correctness tests of many ranks)."""
        k, i = self.devices_per_process, self.process_id
        ids = list(range(i * k, i * k + k))
        return [d % self.gpus for d in ids] if self.gpus else ids


def config_from_env(environ: Mapping[str, str] | None = None) -> LaunchConfig | None:
    """The launch configuration from ``JAX_ENGRAM_*`` variables, or ``None`` outside a launch."""
    env = os.environ if environ is None else environ
    coord = env.get(ENV_COORDINATOR)
    if not coord:
        return None
    try:
        cfg = LaunchConfig(
            coordinator=coord,
            num_processes=int(env[ENV_NUM_PROCESSES]),
            process_id=int(env[ENV_PROCESS_ID]),
            platform=env.get(ENV_PLATFORM, "cpu").lower(),
            devices_per_process=int(env.get(ENV_DEVICES_PER_PROCESS, "1")),
            gpus=int(env.get(ENV_GPUS, "0") or 0),
        )
    except (KeyError, ValueError) as e:
        raise RuntimeError(f"incomplete/invalid {ENV_COORDINATOR}* launch environment: {e!r}") from e
    if cfg.platform not in PLATFORMS:
        raise RuntimeError(f"{ENV_PLATFORM}={cfg.platform!r}; expected one of {PLATFORMS}")
    if not 0 <= cfg.process_id < cfg.num_processes or cfg.devices_per_process < 1 or cfg.gpus < 0:
        raise RuntimeError(f"invalid launch environment: {cfg}")
    return cfg


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _exit_code(status: Any) -> int:
    if status is None:
        return 0
    if isinstance(status, bool):
        return int(status)
    if isinstance(status, int):
        return status & 0xFF if status >= 0 else 1
    return 1  # sys.exit("message")


_fail_fast_installed = False


def _install_fail_fast() -> None:
    """Make a failing child exit *now* with its own exit code.

    Otherwise jax's atexit hook runs ``jax.distributed.shutdown()``, whose shutdown barrier
    waits ``shutdown_timeout_seconds`` for the healthy ranks and then aborts *every* rank
    (SIGABRT) -- the launcher would see the failure late and blame the wrong rank.
    Covers uncaught exceptions (``sys.excepthook``) and ``sys.exit(non-zero)`` called in the
    main thread.  A bare ``raise SystemExit(n)`` is not intercepted.
    """
    global _fail_fast_installed
    if _fail_fast_installed:
        return
    _fail_fast_installed = True
    orig_hook, orig_exit = sys.excepthook, sys.exit

    def excepthook(tp, value, tb):
        try:
            orig_hook(tp, value, tb)
        finally:
            _flush_std()
            os._exit(1)

    def exit(status: Any = None):  # noqa: A001 - replaces sys.exit in launched children only
        code = _exit_code(status)
        if code != 0 and threading.current_thread() is threading.main_thread():
            if isinstance(status, str):
                print(status, file=sys.stderr)
            _flush_std()
            os._exit(code)
        orig_exit(status)

    sys.excepthook = excepthook
    sys.exit = exit


def initialize(
    *,
    initialization_timeout: int = 60,
    heartbeat_timeout_seconds: int = 30,
    shutdown_timeout_seconds: int = 30,
    fail_fast: bool = True,
) -> LaunchConfig | None:
    """Join the job started by the launcher; call before anything starts a JAX backend.

    Reads the ``JAX_ENGRAM_*`` variables.  Without them it does nothing and returns ``None``
    (plain single-process run).  Otherwise: on cpu selects the CPU platform with gloo
    collectives and ``K`` CPU devices, then calls ``jax.distributed.initialize`` (on cuda with
    ``local_device_ids=[i*K .. i*K+K-1]``) and returns the :class:`LaunchConfig`.
    Calling it again in an initialized process is a no-op.

    ``fail_fast`` (default): an uncaught exception or ``sys.exit(non-zero)`` in the main
    thread ends the process immediately (``os._exit``, after printing the traceback and
    flushing stdout/stderr) instead of hanging in jax's distributed shutdown barrier; see
    :func:`_install_fail_fast`.  Clean exits still shut down normally.

    A process that dies: jax.distributed terminates every other process ``heartbeat_timeout_seconds``
    after its last heartbeat (at once if it was process 0), so keep ``jax_engram.init(timeout_s=...)``
    below it to get jax_engram's error naming the peer first; a clean exit waits up to
    ``shutdown_timeout_seconds`` in jax's shutdown barrier for a dead peer (docs/DESIGN.md, "Failures").
    """
    cfg = config_from_env()
    if cfg is None:
        return None
    import jax  # deferred on purpose: importing this module must not import jax

    if jax.distributed.is_initialized():
        return cfg
    if fail_fast:
        _install_fail_fast()
    if cfg.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", cfg.devices_per_process)
    kwargs: dict[str, Any] = {}
    host = cfg.coordinator.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        # Local job: keep the coordination service off the external interfaces.
        kwargs["coordinator_bind_address"] = cfg.coordinator
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=cfg.local_device_ids if cfg.platform == "cuda" else None,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
        **kwargs,
    )
    return cfg


def shutdown() -> None:
    """``jax.distributed.shutdown()`` if this process initialized it; otherwise nothing."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        jax.distributed.shutdown()


def _json_default(o: Any) -> Any:
    # numpy / jax arrays and scalars without importing numpy here.
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"emit_result: {type(o).__name__} is not JSON serializable")


def emit_result(obj: Any) -> None:
    """Print ``RESULT <json>`` as one line on stdout (flushed); the launcher parses it."""
    line = RESULT_PREFIX + json.dumps(obj, default=_json_default) + "\n"
    sys.stdout.flush()
    sys.stdout.write(line)
    sys.stdout.flush()


def parse_results(lines: Iterable[str]) -> Any:
    """The last ``RESULT <json>`` payload found in ``lines`` (or ``None``)."""
    found = None
    for line in lines:
        pos = line.rfind(RESULT_PREFIX)
        while pos >= 0:  # tolerates foreign output glued in front of the marker
            try:
                found = json.loads(line[pos + len(RESULT_PREFIX):])
                break
            except ValueError:
                pos = line.rfind(RESULT_PREFIX, 0, pos)
    return found


# --------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A launched job failed or timed out.  The message holds every rank's output tail."""

    def __init__(self, message: str, job: "JobResult"):
        super().__init__(message)
        self.job = job
        self.failed_rank = job.failed_rank
        self.timed_out = job.timed_out
        self.returncodes = job.returncodes
        self.outputs = job.outputs


@dataclasses.dataclass
class JobResult:
    """Outcome of :func:`launch`."""

    returncodes: list[int | None]  # None: still running when the job was torn down
    outputs: list[str]  # per-rank tail (stdout+stderr interleaved as received)
    results: list[Any]  # per-rank last ``RESULT <json>`` payload on stdout, None if none
    failed_rank: int | None = None  # first rank seen exiting non-zero
    timed_out: bool = False
    interrupted: bool = False
    wall_s: float = 0.0
    coordinator: str = ""

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.interrupted and all(rc == 0 for rc in self.returncodes)

    def describe(self) -> str:
        n = len(self.returncodes)
        if self.timed_out:
            running = [r for r, rc in enumerate(self.returncodes) if rc is None]
            return (f"job of {n} processes timed out after {self.wall_s:.1f} s "
                    f"(ranks still running: {running}); killed all ranks")
        if self.interrupted:
            return f"job of {n} processes interrupted; killed all ranks"
        if self.failed_rank is not None:
            rc = self.returncodes[self.failed_rank]
            how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
            return (f"rank {self.failed_rank} failed ({how}) after {self.wall_s:.1f} s; "
                    f"killed the other ranks")
        return f"job of {n} processes finished, return codes {self.returncodes}"

    def report(self, tail_chars: int = 4000) -> str:
        parts = [self.describe()]
        for r, out in enumerate(self.outputs):
            parts.append(f"----- rank {r} (rc={self.returncodes[r]}) output tail -----\n"
                         f"{out[-tail_chars:]}")
        return "\n".join(parts)


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (small race until the coordinator binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(
    rank: int,
    n: int,
    coordinator: str,
    platform: str = "cpu",
    devices_per_process: int = 1,
    env: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of rank ``rank`` (exposed for tests and for other launchers)."""
    e = dict(os.environ if base is None else base)
    e["PYTHONUNBUFFERED"] = "1"
    if platform == "cpu":
        e["JAX_PLATFORMS"] = "cpu"
    else:
        e["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    pp = _package_pythonpath()
    if pp:
        old = e.get("PYTHONPATH")
        if not old or pp not in old.split(os.pathsep):
            e["PYTHONPATH"] = pp + (os.pathsep + old if old else "")
    if env:
        e.update({str(k): str(v) for k, v in env.items()})
    # Contract variables and hard rules win over anything the caller passed.
    e["NCCL_NVLS_ENABLE"] = "0"  # NVLink SHARP / multicast must stay off on our GPU hosts
    e[ENV_COORDINATOR] = coordinator
    e[ENV_NUM_PROCESSES] = str(n)
    e[ENV_PROCESS_ID] = str(rank)
    e[ENV_PLATFORM] = platform
    e[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
    return e


def _package_pythonpath() -> str | None:
    """Directory holding ``jax_engram`` if the launcher found it through a plain sys.path entry.

    The child runs ``python script.py`` (sys.path[0] = the script's directory), so a source
    checkout used via cwd / pytest ``pythonpath`` would be invisible to it.  We pass the same
    directory on, so the child resolves ``jax_engram`` exactly as the launcher did.  Installed
    packages (site-packages, editable finders) are already visible and are left alone.
    """
    parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sites = set(map(os.path.realpath, site.getsitepackages() + [site.getusersitepackages()]))
    except Exception:  # pragma: no cover - exotic interpreters
        sites = set()
    if os.path.realpath(parent) in sites:
        return None
    on_path = {os.path.realpath(p or os.getcwd()) for p in sys.path}
    return parent if os.path.realpath(parent) in on_path else None


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the launcher
    except Exception:
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    except OSError:
        pass


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every child's process group (also reaches grandchildren left in a group whose
    leader already exited) and reap the children.

    No SIGTERM first: jax installs a preemption notifier that catches SIGTERM, so a JAX
    process does not die on it and a grace period would only add latency.
    """
    for p in procs:
        _killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            try:
                p.kill()  # not a group leader (non-POSIX / setsid failed)
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass


class _Output:
    """Thread-safe per-rank output capture with optional prefixed echo."""

    def __init__(self, n: int, echo: bool, tail_lines: int):
        self.lock = threading.Lock()
        self.echo = echo
        self.tails = [collections.deque(maxlen=tail_lines) for _ in range(n)]
        self.results: list[Any] = [None] * n

    def reader(self, rank: int, pipe, is_stderr: bool) -> None:
        prefix = f"[rank {rank}] "
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                res = None
                if not is_stderr and RESULT_PREFIX in line:
                    res = parse_results([line])
                with self.lock:
                    self.tails[rank].append(line)
                    if res is not None:
                        self.results[rank] = res
                    if self.echo:
                        stream = sys.stderr if is_stderr else sys.stdout
                        try:
                            stream.write(prefix + line + "\n")
                            stream.flush()
                        except (OSError, ValueError):
                            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass


# What rank 0 prints when the coordinator port was taken between free_port() and the bind
# (jaxlib 0.11.2 then dies with SIGSEGV).
_PORT_TAKEN_MARKERS = ("Failed to add port to server", "Address already in use")


def _port_taken(job: JobResult) -> bool:
    return job.failed_rank == 0 and any(m in job.outputs[0] for m in _PORT_TAKEN_MARKERS)


def launch(
    n: int,
    script: str,
    args: Sequence[str] = (),
    platform: str = "cpu",
    devices_per_process: int = 1,
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
    *,
    echo: bool = True,
    tail_lines: int = 400,
    python: str | None = None,
    cwd: str | None = None,
    port_retries: int = 2,
) -> JobResult:
    """Run ``n`` copies of ``python script args...`` as one jax.distributed job; never raises
    for child failures (see :class:`JobResult`).  ``KeyboardInterrupt`` kills the job and is
    re-raised.  ``env`` entries override the inherited environment (not the contract variables).
    If the coordinator port was grabbed by someone else before rank 0 bound it, the job is
    restarted on a new port (at most ``port_retries`` times).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    platform = platform.lower()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    if not os.path.exists(script):
        raise FileNotFoundError(script)
    cmd = [python or sys.executable, script, *map(str, args)]
    for attempt in range(port_retries + 1):
        job = _launch_once(cmd, n, platform, devices_per_process, timeout, env,
                           echo=echo, tail_lines=tail_lines, cwd=cwd)
        if not _port_taken(job) or attempt == port_retries:
            return job
        sys.stderr.write(f"[launch] coordinator port {job.coordinator} was taken; "
                         f"restarting the job on a new port\n")
    raise AssertionError("unreachable")


def _launch_once(
    cmd: Sequence[str],
    n: int,
    platform: str,
    devices_per_process: int,
    timeout: float,
    env: Mapping[str, str] | None,
    *,
    echo: bool,
    tail_lines: int,
    cwd: str | None,
) -> JobResult:
    coordinator = f"127.0.0.1:{free_port()}"
    out = _Output(n, echo, tail_lines)
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    returncodes: list[int | None] = [None] * n
    failed_rank: int | None = None
    timed_out = interrupted = False
    t0 = time.monotonic()
    deadline = t0 + timeout
    posix = os.name == "posix"
    try:
        for rank in range(n):
            p = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_env(rank, n, coordinator, platform, devices_per_process, env),
                cwd=cwd,
                start_new_session=posix,  # own process group -> killpg reaches grandchildren
                preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
            )
            procs.append(p)
            for pipe, is_err in ((p.stdout, False), (p.stderr, True)):
                t = threading.Thread(target=out.reader, args=(rank, pipe, is_err),
                                     name=f"launch-rank{rank}-{'err' if is_err else 'out'}",
                                     daemon=True)
                t.start()
                threads.append(t)

        while True:
            for rank, p in enumerate(procs):
                if returncodes[rank] is None:
                    rc = p.poll()
                    if rc is not None:
                        returncodes[rank] = rc
                        if rc != 0 and failed_rank is None:
                            failed_rank = rank
            if failed_rank is not None or all(rc is not None for rc in returncodes):
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        # Always tear down the groups: on failure / timeout / Ctrl-C this kills the survivors,
        # on success it reaps stray grandchildren so nothing outlives the launcher.
        _kill_all(procs)
        for t in threads:
            t.join(timeout=5)
        wall = time.monotonic() - t0
        if interrupted:
            with out.lock:
                sys.stderr.write(f"[launch] interrupted after {wall:.1f} s; killed all {n} ranks\n")
    # Ranks that were killed by us get their (negative) signal code; ranks that had already
    # been running when the job was torn down stay distinguishable via ``timed_out``.
    for rank, p in enumerate(procs):
        if returncodes[rank] is None and not timed_out:
            returncodes[rank] = p.returncode
    with out.lock:
        outputs = ["\n".join(t) for t in out.tails]
        results = list(out.results)
    return JobResult(returncodes=returncodes, outputs=outputs, results=results,
                     failed_rank=failed_rank, timed_out=timed_out, interrupted=interrupted,
                     wall_s=wall, coordinator=coordinator)


def run(
    n: int,
    script: str,
    args: Sequence[str] = (),
    platform: str = "cpu",
    devices_per_process: int = 1,
    timeout: float = 240,
    env: Mapping[str, str] | None = None,
    *,
    echo: bool = True,
    require_result: bool = True,
) -> list[Any]:
    """Run a job and return each rank's last ``RESULT`` payload (a dict for emit_result(dict)).

    Raises :class:`LaunchError` (message: which rank failed / timeout, plus every rank's output
    tail) if any rank fails, the job times out, or (``require_result``) a rank printed no
    ``RESULT`` line.
    """
    job = launch(n, script, args, platform, devices_per_process, timeout, env, echo=echo)
    if not job.ok:
        raise LaunchError(job.report(), job)
    results = job.results
    missing = [r for r, res in enumerate(results) if res is None]
    if require_result and missing:
        raise LaunchError(f"ranks {missing} exited 0 but printed no '{RESULT_PREFIX}<json>' line\n"
                          + job.report(), job)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jax_engram.launch",
        description="Run N local processes of a script as one jax.distributed job "
                    "(the script calls jax_engram.launch.initialize()).")
    ap.add_argument("-n", "--num-processes", type=int, required=True, dest="n")
    ap.add_argument("--platform", choices=PLATFORMS, default="cpu")
    ap.add_argument("--devices-per-process", type=int, default=1, metavar="K")
    ap.add_argument("--gpus", type=int, default=0, metavar="G",
                    help="cuda: share G GPUs round-robin among the ranks (more ranks than GPUs; for correctness "
                         "tests: the GPU time-slices the processes' kernels)")
    ap.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS")
    ap.add_argument("script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)

    # SIGTERM/SIGHUP to the launcher -> same clean teardown as Ctrl-C.
    def _as_interrupt(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                signal.signal(sig, _as_interrupt)
            except (ValueError, OSError):  # not the main thread
                pass
    try:
        env = {ENV_GPUS: str(a.gpus)} if a.gpus else None
        job = launch(a.n, a.script, a.script_args, a.platform, a.devices_per_process, a.timeout, env)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"[launch] error: {e}", file=sys.stderr)
        return 2
    if job.ok:
        print(f"[launch] all {a.n} ranks exited 0 ({job.wall_s:.1f} s)", file=sys.stderr)
        return 0
    print(f"[launch] {job.describe()}", file=sys.stderr)
    if job.timed_out:
        return 124
    rc = job.returncodes[job.failed_rank] if job.failed_rank is not None else 1
    return rc if rc and 0 < rc < 126 else 1


if __name__ == "__main__":
    sys.exit(main())
