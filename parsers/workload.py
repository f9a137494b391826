"""What one iteration computes: the model's FLOPs and the batch (pure data).

The session works it out from the model's dimensions (perfmon.agent.measure.model)
and records it in session_info.workload; the reducers turn step times into
throughput and TFLOPS with it, live and in replay alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """What one iteration computes; None where unknown."""

    flops_per_sample: float | None = None
    hardware_flops_per_sample: float | None = None  # with recomputation; None without
    seq_length: int | None = None
    global_batch_size: int | None = None  # as given; else derived per iteration
    micro_batch_size: int | None = None
    data_parallel_size: int = 1
    world_size: int = 1
    peak_tflops: float | None = None

    def samples(self, microbatches: int | None) -> int | None:
        """Samples in one iteration: given, or micro batch x micro-batches x DP."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.micro_batch_size is not None and microbatches:
            return self.micro_batch_size * microbatches * self.data_parallel_size
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})  # type: ignore[arg-type]
