"""The suite's own guard on its time: a test (its set-up, call and tear-down together)
over LIMIT_S fails the run unless it is marked ``long`` with its reason, so that the
suite does not creep back to an hour one slow test at a time.

A module-scoped scenario's set-up counts on the module's first test: mark the module
(``pytestmark = pytest.mark.long(reason=...)``). Under pytest-xdist the workers report
to the controller, which judges; the reports carry the marks as keywords.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

LIMIT_S = 60.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "long(reason): a test that may take over 60 s (benchmark-grade: a scenario "
        "of real jobs whose rule needs that long), with the reason; unmarked ones fail the run")
    config.pluginmanager.register(TimeGuard(), "perfmon_time_guard")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is not None and not mark.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: pytest.mark.long needs reason=")


class TimeGuard:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.marked: set[str] = set()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if "long" in report.keywords:
            self.marked.add(report.nodeid)

    def over(self) -> list[tuple[str, float]]:
        return sorted(((n, s) for n, s in self.seconds.items()
                       if s > LIMIT_S and n not in self.marked), key=lambda x: -x[1])

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: object, config: pytest.Config) -> None:
        if hasattr(config, "workerinput"):
            return  # (a worker: the controller judges)
        over = self.over()
        if not over:
            return
        writer = config.get_terminal_writer()
        writer.sep("=", f"tests over {LIMIT_S:.0f} s not marked long", red=True)
        for nodeid, seconds in over:
            writer.line(f"{seconds:7.1f}s {nodeid}")
        writer.line("the run fails: make them shorter, or mark them "
                    "pytest.mark.long(reason=...) with why they need that long", red=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not hasattr(session.config, "workerinput") and self.over() and \
                session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
