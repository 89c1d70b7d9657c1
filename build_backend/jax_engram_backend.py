"""PEP 517 build backend of jax_engram: scikit-build-core, plus the NCCL wheel that an isolated AUTO build needs.

``JAX_ENGRAM_CUDA`` = 13 / 12 / ON asks for the CUDA module, and pyproject's overrides then add the matching
``nvidia-nccl-cuXX`` wheel (headers + library) to an isolated build's requirements. With the default AUTO nothing
asks, yet a machine with nvcc should get the CUDA module from a plain ``pip install ".[cuda13]"`` as well: for AUTO
this wrapper adds the NCCL wheel of nvcc's CUDA major version (pinned as in those overrides). Without nvcc, AUTO
builds the CPU module only. Everything else is scikit-build-core's.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from scikit_build_core import build as _skb
from scikit_build_core.build import (  # noqa: F401  (the PEP 517 hooks we do not change)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def nvcc_major() -> int | None:
    """CUDA major version of the nvcc CMake would find (CUDACXX, PATH, /usr/local/cuda), or None."""
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if not cand or not os.access(cand, os.X_OK):
            continue
        try:
            out = subprocess.run([cand, "--version"], capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"release (\d+)\.", out)
        if m:
            return int(m.group(1))
    return None


def nccl_pin(major: int) -> str | None:
    """The ``nvidia-nccl-cu<major>==...`` build requirement of pyproject's overrides (one place for the pin)."""
    cfg = tomllib.loads(_PYPROJECT.read_text())
    for ov in cfg.get("tool", {}).get("scikit-build", {}).get("overrides", []):
        for req in ov.get("build", {}).get("requires", []):
            if re.match(rf"nvidia-nccl-cu{major}\b", req):
                return req
    return None


def _auto_requires() -> list[str]:
    if os.environ.get("JAX_ENGRAM_CUDA", "AUTO").strip().upper() != "AUTO":
        return []  # OFF needs nothing; the required values get theirs from pyproject's overrides
    major = nvcc_major()
    pin = nccl_pin(major) if major is not None else None
    return [pin] if pin else []


def get_requires_for_build_wheel(config_settings=None):
    return [*_skb.get_requires_for_build_wheel(config_settings), *_auto_requires()]


def get_requires_for_build_editable(config_settings=None):
    return [*_skb.get_requires_for_build_editable(config_settings), *_auto_requires()]
