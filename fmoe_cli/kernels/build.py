"""Compile experts.c and decode.c once per machine and load it (ctypes: no torch headers, a compile of seconds).

The shared library is cached under the user cache directory, named by a hash of the source, the
compiler command and the CPU's flags, so a changed source or another CPU builds its own. Concurrent
first uses take a file lock (one compiles, the others wait and load its result); the library is
written under a unique temporary name and renamed into place, so no process loads a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = (Path(__file__).with_name("experts.c"), Path(__file__).with_name("decode.c"))  # one library
HEADERS = (Path(__file__).with_name("bf16.h"),)  # included by the sources: part of the library's hash
# -O3 and the CPU's own instruction set (AVX-512 or AVX2/FMA/F16C); no -ffast-math: the sums' order is the contract.
COMMON_FLAGS = ["-O3", "-pthread", "-shared", "-fPIC", "-std=c11"]
FLAGS = ["-march=native", *COMMON_FLAGS]
PORTABLE_FLAGS = COMMON_FLAGS  # a compiler without -march=native: the scalar paths
# FMOE_KERNEL_ISA: which of experts.c's paths to build. `native` (default): the widest this CPU has (AVX-512 where
# present, else AVX2, with AVX-VNNI where the CPU has it). `avx2vnni`, `avx2` and `scalar` build the narrower ones on
# any x86-64 machine that runs them, so that a machine with AVX-512 also tests the paths an AVX2-only CPU (Intel's
# 12th-14th generation: AVX-VNNI; AMD's Zen 3 and older Intel: none) and a CPU with neither run (tests/test_kernels.py).
ISA_ENV = "FMOE_KERNEL_ISA"
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {"native": FLAGS, "avx2vnni": [*AVX2_FLAGS, "-mavxvnni", *COMMON_FLAGS], "avx2": [*AVX2_FLAGS, *COMMON_FLAGS],
             "scalar": PORTABLE_FLAGS}
COMPILE_TIMEOUT_S = 120


def isa() -> str:
    """FMOE_KERNEL_ISA, checked (default `native`)."""
    kind = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if kind not in ISA_FLAGS:
        raise RuntimeError(f"{ISA_ENV}={kind!r}: expected one of {', '.join(ISA_FLAGS)}")
    return kind


def cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("FMOE_KERNEL_CACHE") or Path(platformdirs.user_cache_dir("fmoe")) / "kernels")


def cpu_flags() -> str:
    """What the compiled code depends on: the CPU's feature flags (Linux), else the machine's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def library_path(cc: str) -> Path:
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*texts, cc, " ".join(ISA_FLAGS[isa()]), cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"experts-{key}.so"


def build() -> ctypes.CDLL:
    """The compiled kernels, compiled first if this machine has not yet; raises RuntimeError saying why not."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    target = library_path(cc)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        import fcntl

        with open(target.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles; the others wait for its result
            if not target.exists():
                _compile(cc, target)
    return ctypes.CDLL(str(target))


def _compile(cc: str, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        errors = ""
        for flags in (ISA_FLAGS[isa()], PORTABLE_FLAGS):
            result = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                                    timeout=COMPILE_TIMEOUT_S)
            if result.returncode == 0:
                os.replace(tmp, target)  # atomic: a reader sees no library or the whole one
                return
            errors = result.stderr.strip().splitlines()
        raise RuntimeError(f"{cc} failed: {errors[-1] if errors else 'no message'}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
