"""Exits (perfmon.agent.reducers.exits) on records as the exit source gives them: which rank
ended the job (real ranks and kernel hooks: tests/e2e/test_exits.py)."""

from __future__ import annotations

from perfmon.agent.reducers.exits import Exits


def _exit(pid: int, t: int, rank: int, **fields) -> dict:
    return {"type": "rank_exit", "t_mono_ns": t, "pid": pid, "rank": rank, "exit_code": None,
            "signal": None, "core_dumped": False, "oom_killed": False, "log_tail_cause": None,
            "source": "proc_connector", **fields}


def test_ranks_a_launcher_stops_after_a_failure_are_never_the_cause():
    exits = Exits()
    exits.on_exit(_exit(12, 300, 2, signal="SIGTERM"))
    exits.on_exit(_exit(11, 200, 1, exit_code=1, log_tail_cause={
        "cause": "nccl_error", "exception_type": "torch.distributed.DistBackendError",
        "message": "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited",
        "line": "..."}))
    exits.on_exit(_exit(10, 100, 0, exit_code=3))
    exits.on_exit(_exit(13, 50, 3, exit_code=0))  # finished cleanly before: not a failure
    assert exits.summary()["cause"] == {"pid": 10, "rank": 0, "what": "exit code 3"}
    assert exits.ranks[11]["what"] == ("NCCL error in: ProcessGroupNCCL.cpp:3356, remote "
                                       "process exited (exit code 1)")
    assert [exits.ranks[p]["failed"] for p in (10, 11, 12, 13)] == [True, True, True, False]


def test_at_an_equal_time_a_failure_of_its_own_wins_over_a_stop_signal():
    exits = Exits()
    exits.on_exit(_exit(20, 100, 0, signal="SIGKILL"))
    exits.on_exit(_exit(21, 100, 1, signal="SIGSEGV", core_dumped=True))
    assert exits.summary()["cause"] == {"pid": 21, "rank": 1,
                                        "what": "killed by SIGSEGV (core dumped)"}


def test_no_failure_no_cause_and_an_unobserved_exit_is_a_failure_only_with_evidence():
    exits = Exits()
    exits.on_exit(_exit(30, 100, 0, exit_code=0))
    exits.on_exit(_exit(31, 110, 1, source="unobserved", core_dumped=None))
    assert exits.summary()["cause"] is None
    exits.on_exit(_exit(32, 120, 2, source="unobserved", core_dumped=None, log_tail_cause={
        "cause": "python_exception", "exception_type": "ValueError", "message": "bad shard"}))
    assert exits.summary()["cause"] == {"pid": 32, "rank": 2,
                                        "what": "ValueError: bad shard (exit status unknown)"}
