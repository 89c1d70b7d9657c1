"""Loading the native modules and registering their FFI handlers with XLA (lazily, once per platform)."""
from __future__ import annotations

import os
import re
import threading
from types import ModuleType

import jax
import jaxlib

_lock = threading.Lock()
_registered: set[str] = set()

_XLA_PLATFORM = {"cpu": "cpu", "gpu": "CUDA", "cuda": "CUDA"}


def native(platform: str) -> ModuleType:
    """The native module for a jax platform name ("cpu" or "gpu")."""
    if platform == "cpu":
        from jax_engram import _engram_cpu

        return _engram_cpu
    if platform in ("gpu", "cuda"):
        try:
            from jax_engram import _engram_cuda
        except ImportError as e:
            raise RuntimeError(
                "jax_engram was installed without its CUDA module (or it failed to load: "
                f"{e}). Rebuild with nvcc on PATH and the CUDA module required: "
                "JAX_ENGRAM_CUDA=13 pip install '.[cuda13]' (or 12 / '.[cuda12]'; README, Install)"
            ) from e
        return _engram_cuda
    raise NotImplementedError(f"jax_engram supports CPU and NVIDIA GPU devices, not {platform!r}")


def warn_if_cuda_module_missing() -> None:
    """Warn at import when jax has CUDA support installed but jax_engram was built without its CUDA module (a
    build backend cannot see the ``cuda13`` extra: ``pip install .[cuda13]`` without ``JAX_ENGRAM_CUDA=13`` builds
    the CPU module only), instead of failing only at the first GPU op."""
    import importlib.util
    import warnings

    try:
        if importlib.util.find_spec("jax_engram._engram_cuda") is not None:
            return
        plugins = [m for m in ("jax_cuda13_plugin", "jax_cuda12_plugin") if importlib.util.find_spec(m) is not None]
    except (ImportError, ValueError):
        return
    if plugins:
        warnings.warn(
            f"jax_engram was built without its CUDA module, but jax has CUDA support installed ({plugins[0]}): "
            "jax_engram ops on GPUs will fail. Rebuild with nvcc on PATH and the CUDA module required: "
            "JAX_ENGRAM_CUDA=13 pip install '.[cuda13]' (or 12 / '.[cuda12]'; README, Install).",
            RuntimeWarning, stacklevel=3)


def cuda_available() -> bool:
    try:
        native("gpu")
        return True
    except RuntimeError:
        return False


def running_ffi_api() -> tuple[int, int] | None:
    """FFI C API version of the running jaxlib, read from the headers it ships."""
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        text = open(path).read()
    except OSError:
        return None
    maj = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    mnr = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    return (int(maj.group(1)), int(mnr.group(1))) if maj and mnr else None


def _abi_message(mod: ModuleType) -> str:
    info = mod.build_info
    built = tuple(info["ffi_api"])
    return (
        f"jax_engram's {mod.platform} module was built against jaxlib {info['jaxlib']} "
        f"(XLA FFI API {built[0]}.{built[1]}), running jaxlib {jaxlib.__version__} "
        f"(XLA FFI API {'.'.join(map(str, running_ffi_api() or ('?', '?')))})"
    )


def ensure_registered(platform: str) -> ModuleType:
    """Register every handler of the platform's module with XLA. Idempotent and thread-safe."""
    mod = native(platform)
    with _lock:
        if mod.platform in _registered:
            return mod
        jax.devices()  # jaxlib CPU quirk: stateful targets must be registered after the backend starts
        built = tuple(mod.build_info["ffi_api"])
        running = running_ffi_api()
        if running is not None and (running[0] != built[0] or running[1] < built[1]):
            raise RuntimeError(
                _abi_message(mod) + ": handlers built with newer FFI headers are rejected by this jaxlib. "
                "Rebuild jax_engram in this environment (pip install -e . --no-build-isolation)."
            )
        for name, capsule in mod.registrations().items():
            try:
                jax.ffi.register_ffi_target(name, capsule, platform=_XLA_PLATFORM[mod.platform])
            except Exception as e:  # XLA reports API mismatches as INVALID_ARGUMENT
                raise RuntimeError(f"registering FFI target {name} failed; {_abi_message(mod)}: {e}") from e
        _registered.add(mod.platform)
    return mod


warn_if_cuda_module_missing()
