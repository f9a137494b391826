"""Build the fake CUDA driver, CUDA runtime and NCCL libraries (fake_cuda.c, fake_nccl.c).

Each is linked with the soname of the real one (libcuda.so.1, libcudart.so.12,
libnccl.so.2) so that the runtime's and NCCL's ``dlopen("libcuda.so.1")`` find
the fake driver a process already loaded by full path, as they would find the
real one, and so that /proc/PID/maps shows the basenames the probe looks for.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

FAKES = Path(__file__).parent
DRIVER_SONAME = "libcuda.so.1"
RUNTIME_SONAME = "libcudart.so.12"
NCCL_SONAME = "libnccl.so.2"


@dataclass(frozen=True)
class FakeCudaLibraries:
    """Paths of the three built libraries (all in one folder)."""

    lib_dir: Path

    @property
    def driver(self) -> Path:
        return self.lib_dir / DRIVER_SONAME

    @property
    def runtime(self) -> Path:
        return self.lib_dir / RUNTIME_SONAME

    @property
    def nccl(self) -> Path:
        return self.lib_dir / NCCL_SONAME


def _compile(cc: str, source: Path, soname: str, out: Path, *defines: str) -> None:
    done = subprocess.run(
        [cc, "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread",
         # Keep frame-less entry points and real calls (no sibling-call jumps), as the
         # probe's caller check reads the return address at function entry.
         "-fno-optimize-sibling-calls", *defines, f"-Wl,-soname,{soname}", "-o", str(out),
         str(source), "-ldl"],
        check=False, capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building {out.name} from {source.name} failed:\n{done.stderr}")


def build_fake_cuda(out_dir: Path) -> FakeCudaLibraries:
    """Compile libcuda.so.1, libcudart.so.12 and libnccl.so.2 into ``out_dir``.

    Raises RuntimeError when no C compiler is on PATH or a build fails.
    """
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH to build the fake CUDA libraries")
    out_dir.mkdir(parents=True, exist_ok=True)
    libs = FakeCudaLibraries(out_dir)
    _compile(cc, FAKES / "fake_cuda.c", DRIVER_SONAME, libs.driver, "-DFAKE_CUDA_DRIVER")
    _compile(cc, FAKES / "fake_cuda.c", RUNTIME_SONAME, libs.runtime, "-DFAKE_CUDA_RUNTIME")
    _compile(cc, FAKES / "fake_nccl.c", NCCL_SONAME, libs.nccl)
    return libs
