"""When the CUDA launch probes are attached in launch mode "sampled", and how often.

Every probed kernel launch traps into the kernel, so :class:`~perfmon.probes.cuda.CudaSource`
attaches the launch probes for one whole iteration in every N and detaches them
between (:mod:`perfmon.probes.duty_cycle`); :class:`LaunchSampling` decides when, from
the primary rank's step snapshots, and adapts N from the step times seen with and
without the probes.
"""

from __future__ import annotations

from collections.abc import Callable

from perfmon.probes.duty_cycle import DutyCycle

# Sampled launch counting: one probed iteration in every N, N adapted (within these
# bounds) so that probing costs at most LAUNCH_BUDGET of the step time overall.
LAUNCH_BUDGET = 0.005
FIRST_SAMPLE_EVERY = 50
MIN_SAMPLE_EVERY = 10
MAX_SAMPLE_EVERY = 100_000


class LaunchSampling:
    """Attaches the launch probes (``attach``) every ``sample_every`` steps of the primary
    rank and detaches them (``detach``) after one whole step (a :class:`DutyCycle`);
    ``samples`` counts the times."""

    def __init__(self, primary: int, attach: Callable[[], None],
                 detach: Callable[[], None]) -> None:
        self.sample_every = FIRST_SAMPLE_EVERY
        self._primary = primary
        self._cycle = DutyCycle(lambda on: attach() if on else detach(), on=False)
        self._previous_ns: dict[int, int] = {}  # each rank's previous step snapshot
        self._steps = 0  # of the primary rank
        self._steps_probed = 0  # primary steps entered since the launch probes were attached
        self._unsampled: list[int] = []  # recent primary step times without launch probes
        self._sampled_steps: list[int] = []  # the primary's step times of this sample

    @property
    def samples(self) -> int:
        """Times the launch probes were attached (and detached again: whole samples)."""
        return self._cycle.ended

    def on_step(self, pid: int, t_mono_ns: int) -> bool:
        """Whether the launch probes were attached since this rank's previous snapshot
        (they are detached only after a poll, so they were up to this one)."""
        previous, self._previous_ns[pid] = self._previous_ns.get(pid), t_mono_ns
        attached = self._cycle.on_since_ns
        probed = attached is not None and previous is not None and previous >= attached
        if pid == self._primary:
            self._steps += 1
            if attached is not None and t_mono_ns > attached:
                self._steps_probed += 1
            if previous is not None:
                if probed:
                    self._sampled_steps.append(t_mono_ns - previous)
                elif attached is None:
                    self._unsampled = [*self._unsampled[-100:], t_mono_ns - previous]
        return probed

    def schedule(self) -> None:
        """Attach the launch probes every ``sample_every`` steps, for one whole step (a
        whole iteration inside, and all until this poll: two steps entered)."""
        switched = self._cycle.cycle(self._steps, self._steps_probed >= 2, self.sample_every)
        if switched:
            self._steps_probed = 0
        elif switched is False:
            self._adapt()
            self._sampled_steps = []

    def _adapt(self) -> None:
        """N such that this sample's extra time (its probed steps' excess over the usual
        step), spread over N steps, is LAUNCH_BUDGET of them."""
        if not self._sampled_steps or len(self._unsampled) < 5:
            return
        median = sorted(self._unsampled)[len(self._unsampled) // 2]
        extra = sum(max(0, step - median) for step in self._sampled_steps)
        wanted = extra / (LAUNCH_BUDGET * median) if median > 0 else MAX_SAMPLE_EVERY
        self.sample_every = int(min(MAX_SAMPLE_EVERY, max(MIN_SAMPLE_EVERY, wanted)))
