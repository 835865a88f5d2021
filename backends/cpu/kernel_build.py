"""Builds the cpu backend's compiled kernels (csrc/) into one shared library: at install, by
setup.py, into the package's `prebuilt/` folder; at first use, by native.py, into the cache,
where no prebuilt library matches this machine.

A library is named by a key of its sources, the compiler's version, this CPU's instruction-set
flags (it is built with -march=native) and the flags, so a library built for other sources or
another CPU is never loaded: the loader looks for its own key's file. Standard library only,
so setup.py can run it with no torch (and no pagedllm) importable.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
PREBUILT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prebuilt")
SOURCES = tuple(
    os.path.join(CSRC, name) for name in ("kernels.cpp", "panel_linear.cpp", "quantized_linear.cpp", "step_program.cpp")
)
HEADERS = (os.path.join(CSRC, "half.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cpu_flags_line() -> bytes:
    """/proc/cpuinfo's flags line (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def library_name(cxx: str) -> str:
    """The file name of the library these sources, this compiler and this CPU make."""
    version = subprocess.run([cxx, "--version"], capture_output=True).stdout
    sources = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            sources += f.read()
    key = hashlib.sha256(sources + version + cpu_flags_line() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return f"kernels_{key}.so"


def compile_to(cxx: str, target: str) -> None:
    """Compile the sources into `target`, built beside it and renamed, so that no process ever
    loads half a file. RuntimeError with the compiler's last words when it fails."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, *SOURCES, "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prebuild(folder: str) -> str:
    """Build the library for this machine into `folder` (the package's prebuilt/ at install),
    removing the ones built there before for other sources or CPUs. Returns what happened, in
    a line; never raises: without a compiler the kernels build on first use or the backend
    keeps its torch path, as before."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found (g++ or $CXX): the cpu kernels are not prebuilt"
    try:
        os.makedirs(folder, exist_ok=True)
        name = library_name(cxx)
        for old in glob.glob(os.path.join(folder, "kernels_*.so")):
            if os.path.basename(old) != name:
                os.unlink(old)
        target = os.path.join(folder, name)
        if not os.path.exists(target):
            compile_to(cxx, target)
        return f"cpu kernels prebuilt: {target}"
    except (OSError, RuntimeError) as e:
        return f"the cpu kernels were not prebuilt ({e}); they build on first use"
