"""Which GPUs of an NVML sample are the job's (pure: sample maps in)."""

from __future__ import annotations

from typing import Any


def job_gpu_indices(gpus: list[dict[str, Any]]) -> tuple[set[int], str]:
    """The GPUs of one ``gpu`` record that are the job's, and how that was decided.

    The sampler lists only the job's processes in ``process_memory_bytes``:
    GPUs showing one are the job's (``processes``). When NVML lists no compute
    process on any GPU (a container with its own PID namespace, or a driver
    that does not say), every GPU counts as the job's (``all_gpus``). Otherwise
    other processes use the GPUs and the job none of them (``none``: a CPU job
    on a GPU host gets no GPU figures and no MFU).
    """
    alive = [g for g in gpus if not g.get("lost")]
    mine = {g["index"] for g in alive if g.get("process_memory_bytes")}
    if mine:
        return mine, "processes"
    if not any(g.get("process_count") for g in gpus):
        return {g["index"] for g in alive}, "all_gpus"
    return set(), "none"
