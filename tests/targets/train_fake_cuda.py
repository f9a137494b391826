"""A small PyTorch training loop (CPU) that also drives fake CUDA and NCCL libraries.

The fakes (tests/fakes/fake_cuda.c, fake_nccl.c, built by
tests/fakes/build_cuda.py) are loaded with ctypes by full path, as a CUDA job
has the real ones loaded from site-packages/nvidia/*/lib. Every iteration,
after backward() and before optimizer.step(), it makes a scripted number of
kernel launches (runtime and driver API), graph launches, blocking calls that
each wait ``--sync-us`` microseconds, and NCCL calls with scripted counts and
datatypes; then, like train_gpt.py --timestamps, it writes "<iteration> <ns>"
(time.monotonic_ns() just before optimizer.step()), so a test compares
counter differences between two stamps with exactly one iteration's calls.
``--idle-ms`` of sleep, half before the stamp and half after the step
(host-side work, a data-loader wait), leave a quiet gap around every stamp.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch
from torch import nn

# ncclDataType_t and ncclRedOp_t values of nccl.h
NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9, "float8e4m3": 10, "float8e5m2": 11,
}
NCCL_SUM = 0
COLLECTIVES = ("all_reduce", "all_reduce_config", "reduce_scatter", "all_gather", "broadcast",
               "reduce", "all_to_all", "gather", "scatter")
P2P = ("send", "recv")  # issued together inside one ncclGroupStart/ncclGroupEnd, as torch does


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class CudaLaunchConfig(ctypes.Structure):  # cudaLaunchConfig_t
    _fields_ = [("gridDim", Dim3), ("blockDim", Dim3), ("dynamicSmemBytes", ctypes.c_size_t),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


class CuLaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


def parse_nccl(spec: str) -> tuple[str, int, str]:
    """'all_reduce:4096:float32' -> ('all_reduce', 4096, 'float32')."""
    op, count, dtype = spec.split(":")
    return op, int(count), dtype


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cuda-lib-dir", required=True, type=Path,
                   help="folder with the fake libcuda.so.1, libcudart.so.12, libnccl.so.2")
    p.add_argument("--no-nccl", action="store_true", help="do not load libnccl.so.2")
    p.add_argument("--timestamps", help="append '<iteration> <monotonic ns>' before each step")
    p.add_argument("--step-returns", help="append '<iteration> <monotonic ns>' as each "
                   "optimizer step returns (with --timestamps: each step's bracket)")
    p.add_argument("--sync-log", help="append '<iteration> <ns>': the time its blocking "
                   "calls took in each iteration, by its own clock")
    p.add_argument("--train-iters", type=int, default=0, help="0: train until killed")
    p.add_argument("--idle-ms", type=float, default=20.0)
    p.add_argument("--runtime-launches", type=int, default=0, help="cudaLaunchKernel calls")
    p.add_argument("--runtime-ptsz-launches", type=int, default=0,
                   help="cudaLaunchKernel_ptsz calls")
    p.add_argument("--runtime-ex-launches", type=int, default=0, help="cudaLaunchKernelExC calls")
    p.add_argument("--driver-launches", type=int, default=0, help="cuLaunchKernel calls")
    p.add_argument("--driver-ptsz-launches", type=int, default=0,
                   help="cuLaunchKernel_ptsz calls")
    p.add_argument("--driver-ex-launches", type=int, default=0, help="cuLaunchKernelEx calls")
    p.add_argument("--graph-launches", type=int, default=0, help="cudaGraphLaunch calls")
    p.add_argument("--stream-syncs", type=int, default=0)
    p.add_argument("--device-syncs", type=int, default=0)
    p.add_argument("--event-syncs", type=int, default=0)
    p.add_argument("--memcpys", type=int, default=0)
    p.add_argument("--sync-us", type=int, default=0, help="each blocking call waits this long")
    p.add_argument("--nccl", action="append", default=[], type=parse_nccl,
                   metavar="OP:COUNT:DTYPE", help="one NCCL call per iteration (repeatable); "
                   f"OP in {', '.join((*COLLECTIVES, *P2P))}; DTYPE in {', '.join(NCCL_DTYPES)}")
    return p.parse_args(argv)


class FakeGpu:
    """The fake libraries, loaded by full path, and one iteration's scripted calls."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # The driver first: the runtime and NCCL dlopen it by soname and get this copy.
        self.cu = ctypes.CDLL(str(args.cuda_lib_dir / "libcuda.so.1"))
        self.rt = ctypes.CDLL(str(args.cuda_lib_dir / "libcudart.so.12"))
        self.nccl = None if args.no_nccl else ctypes.CDLL(str(args.cuda_lib_dir / "libnccl.so.2"))
        self.rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p,
                                             ctypes.c_size_t, ctypes.c_void_p]
        self.rt.cudaLaunchKernel_ptsz.argtypes = self.rt.cudaLaunchKernel.argtypes
        self.rt.cudaLaunchKernelExC.argtypes = [ctypes.POINTER(CudaLaunchConfig),
                                                ctypes.c_void_p, ctypes.c_void_p]
        self.cu.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.cu.cuLaunchKernel_ptsz.argtypes = self.cu.cuLaunchKernel.argtypes
        self.cu.cuLaunchKernelEx.argtypes = [ctypes.POINTER(CuLaunchConfig), ctypes.c_void_p,
                                             ctypes.c_void_p, ctypes.c_void_p]
        self.rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_int]
        self.rt.fakeCudaSetSyncMicroseconds(ctypes.c_uint(args.sync_us))
        self.grid, self.block = Dim3(64, 1, 1), Dim3(256, 1, 1)
        self.rt_config = CudaLaunchConfig(self.grid, self.block, 0, None, None, 0)
        self.cu_config = CuLaunchConfig(64, 1, 1, 256, 1, 1, 0, None, None, 0)
        self.host_src = ctypes.create_string_buffer(b"x" * 4096)
        self.host_dst = ctypes.create_string_buffer(4096)
        self.comm = ctypes.c_void_p()
        if self.nccl is not None:
            self._check(self.nccl.ncclCommInitAll(ctypes.byref(self.comm), 1, None),
                        "ncclCommInitAll")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned {rc}")

    def iteration(self) -> None:
        a, rt, cu = self.args, self.rt, self.cu
        for _ in range(a.runtime_launches):
            self._check(rt.cudaLaunchKernel(None, self.grid, self.block, None, 0, None),
                        "cudaLaunchKernel")
        for _ in range(a.runtime_ptsz_launches):
            self._check(rt.cudaLaunchKernel_ptsz(None, self.grid, self.block, None, 0, None),
                        "cudaLaunchKernel_ptsz")
        for _ in range(a.runtime_ex_launches):
            self._check(rt.cudaLaunchKernelExC(ctypes.byref(self.rt_config), None, None),
                        "cudaLaunchKernelExC")
        for _ in range(a.driver_launches):
            self._check(cu.cuLaunchKernel(None, 64, 1, 1, 256, 1, 1, 0, None, None, None),
                        "cuLaunchKernel")
        for _ in range(a.driver_ptsz_launches):
            self._check(cu.cuLaunchKernel_ptsz(None, 64, 1, 1, 256, 1, 1, 0, None, None, None),
                        "cuLaunchKernel_ptsz")
        for _ in range(a.driver_ex_launches):
            self._check(cu.cuLaunchKernelEx(ctypes.byref(self.cu_config), None, None, None),
                        "cuLaunchKernelEx")
        for _ in range(a.graph_launches):
            self._check(rt.cudaGraphLaunch(None, None), "cudaGraphLaunch")
        synced = time.monotonic_ns()
        for _ in range(a.stream_syncs):
            self._check(rt.cudaStreamSynchronize(None), "cudaStreamSynchronize")
        for _ in range(a.device_syncs):
            self._check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        for _ in range(a.event_syncs):
            self._check(rt.cudaEventSynchronize(None), "cudaEventSynchronize")
        for _ in range(a.memcpys):
            self._check(rt.cudaMemcpy(self.host_dst, self.host_src, 4096, 0), "cudaMemcpy")
        self.sync_ns = time.monotonic_ns() - synced  # (the job's own clock of its waits)
        if self.nccl is not None:
            self._collectives()

    def _collectives(self) -> None:
        assert self.nccl is not None
        nccl, comm = self.nccl, self.comm
        size_t, c_int = ctypes.c_size_t, ctypes.c_int
        calls = {
            "all_reduce": lambda n, d: nccl.ncclAllReduce(None, None, size_t(n), c_int(d),
                                                          NCCL_SUM, comm, None),
            "all_reduce_config": lambda n, d: nccl.ncclAllReduceConfig(
                None, None, size_t(n), c_int(d), NCCL_SUM, comm, None, None),
            "reduce_scatter": lambda n, d: nccl.ncclReduceScatter(None, None, size_t(n),
                                                                  c_int(d), NCCL_SUM, comm, None),
            "all_gather": lambda n, d: nccl.ncclAllGather(None, None, size_t(n), c_int(d),
                                                          comm, None),
            "broadcast": lambda n, d: nccl.ncclBroadcast(None, None, size_t(n), c_int(d), 0,
                                                         comm, None),
            "reduce": lambda n, d: nccl.ncclReduce(None, None, size_t(n), c_int(d), NCCL_SUM, 0,
                                                   comm, None),
            "all_to_all": lambda n, d: nccl.ncclAlltoAll(None, None, size_t(n), c_int(d),
                                                         comm, None),
            "gather": lambda n, d: nccl.ncclGather(None, None, size_t(n), c_int(d), 0, comm,
                                                   None),
            "scatter": lambda n, d: nccl.ncclScatter(None, None, size_t(n), c_int(d), 0, comm,
                                                     None),
            "send": lambda n, d: nccl.ncclSend(None, size_t(n), c_int(d), 0, comm, None),
            "recv": lambda n, d: nccl.ncclRecv(None, size_t(n), c_int(d), 0, comm, None),
        }
        p2p = [c for c in self.args.nccl if c[0] in P2P]
        for op, count, dtype in self.args.nccl:
            if op not in P2P:
                self._check(calls[op](count, NCCL_DTYPES[dtype]), op)
        if p2p:
            self._check(nccl.ncclGroupStart(), "ncclGroupStart")
            for op, count, dtype in p2p:
                self._check(calls[op](count, NCCL_DTYPES[dtype]), op)
            self._check(nccl.ncclGroupEnd(), "ncclGroupEnd")


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gpu = FakeGpu(args)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stamps = open(args.timestamps, "a", buffering=1) if args.timestamps else None
    syncs = open(args.sync_log, "a", buffering=1) if args.sync_log else None
    returns = open(args.step_returns, "a", buffering=1) if args.step_returns else None
    iteration = 0
    while args.train_iters == 0 or iteration < args.train_iters:
        x = torch.randn(16, 32)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        gpu.iteration()
        if syncs:
            syncs.write(f"{iteration + 1} {gpu.sync_ns}\n")
        # Host-side work (logging, a data-loader wait) on both sides of the stamp,
        # so that no CUDA or NCCL call happens within idle_ms / 2 of it.
        time.sleep(args.idle_ms / 2000)
        if stamps:
            stamps.write(f"{iteration + 1} {time.monotonic_ns()}\n")
        optimizer.step()
        if returns:
            returns.write(f"{iteration + 1} {time.monotonic_ns()}\n")
        optimizer.zero_grad(set_to_none=True)
        iteration += 1
        time.sleep(args.idle_ms / 2000)


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
