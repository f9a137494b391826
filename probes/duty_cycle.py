"""Probes attached for a sample of whole iterations, detached between: sampled probing.

A uprobe traps at every call of its function, and a detached one costs the job
nothing; so where probing every iteration would cost too much, a probe is attached
for one sample of whole iterations in every N and detached for the rest.
:class:`DutyCycle` is that cycle, counted in iterations of one rank (the primary);
each owner says when a sample is whole, how long the rest between two samples is,
and chooses N: the CUDA launch probes (:mod:`perfmon.probes.cuda_sampling`) and the
collective-wait probes (perfmon.agent.measure.wait_sampling).
"""

from __future__ import annotations

from collections.abc import Callable

from perfmon.probes.sampler import monotonic_ns


class DutyCycle:
    """Attaches (``set_on(True)``) and detaches (``set_on(False)``) a probe, one poll's
    decision at a time (:meth:`cycle`), starting ``on`` or not.

    ``switched_ns``: when it was last switched (None: never), taken after attaching
    and before detaching, so that from an attach's time to the next detach's the probe
    was on throughout. ``begun`` counts the samples begun (attached by :meth:`cycle`),
    ``ended`` those ended (detached by it).
    """

    def __init__(self, set_on: Callable[[bool], None], *, on: bool) -> None:
        self.on = on
        self.switched_ns: int | None = None
        self.iterations_at_switch = 0  # the primary's iterations when last switched
        self.begun = 0
        self.ended = 0
        self._set_on = set_on

    @property
    def on_since_ns(self) -> int | None:
        """When the probe was attached, while it is (None while detached, or on from the
        start)."""
        return self.switched_ns if self.on else None

    def cycle(self, iterations: int, sample_whole: bool, rest: int) -> bool | None:
        """One poll's decision, from the primary rank's ``iterations`` so far: attached,
        detach once the sample is whole (``sample_whole``); detached, attach once
        ``rest`` iterations passed since. Returns the switch made (True: attached,
        False: detached), None when none."""
        if self.on:
            if not sample_whole:
                return None
            self.switch(False, iterations)
            self.ended += 1
        elif iterations - self.iterations_at_switch >= rest:
            self.switch(True, iterations)
            self.begun += 1
        else:
            return None
        return self.on

    def switch(self, on: bool, iterations: int) -> None:
        """Attach or detach now (outside the cycle too: probes held on for a while)."""
        if on:
            self._set_on(True)
            self.switched_ns = monotonic_ns()
        else:
            self.switched_ns = monotonic_ns()
            self._set_on(False)
        self.on, self.iterations_at_switch = on, iterations
