"""``perfmon-agent merge DIR...``: the summaries one job's nodes wrote, as one job summary.

Each node's agent (``attach``, ``run`` or the node service) writes its own
``perf_summary_*.json`` with ``session_info.job.id`` (the job id every node derives
alike: ``TORCHELASTIC_RUN_ID``, else the rendezvous address; see docs/service.md).
``merge`` reads every summary under the folders given (and their sub-folders, 3
levels: the service's ``<root>/<host>/<job>/``), groups them by job id and host,
and writes ``job_summary.json`` (schema: docs/job_summary.schema.json):

- ``job_info``: job id and name, nodes, ranks, the time span, the inputs;
- ``iteration_logs``: per log interval, aligned by iteration number (the job's own
  numbering when every node read it, else the count since each node's attach,
  said in ``job_info.aligned_by``) on the grid of the log interval L (an entry
  ending at iteration n counts for the interval ending at ceil(n / L) x L, as the
  nodes' agents attached at different iterations): the job's step time (the
  slowest node's: a synchronous job waits for it), each node's step time,
  tokens/s and TFLOPS per GPU over all GPUs;
- ``final_statistics``: the job's average and percentile step times over the
  aligned intervals, tokens/s, TFLOPS per GPU and MFU, a per-node table, the
  slowest node (the one whose ranks compute longest, else whose step is longest)
  and by how much, the slow host when one stands out by the rank rule (``slow_host``),
  every node's stragglers and fail-slow events (with their host),
  and the job's exit cause (the earliest failing rank of any node).

Throughput: every node computes tokens/s and TFLOPS from the job's global batch
over its own step time, so the job's figures are a node's figure scaled by
node step / job step, never a sum of the nodes' figures.

The folders may be shared (issue 36): a summary is believed only when root or the
job's own user owns its file (perfmon.agent.record.runs.distrust); one that is not
is a warning line, listed in ``job_info.refused``, and gives no figure. Figures out
of the summary schema's range (10^18 GPUs) are unknown, with a warning.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from perfmon.agent import agent_version
from perfmon.agent.argtypes import Command
from perfmon.agent.console import printable, warn
from perfmon.agent.record.layout import SUMMARY_GLOB
from perfmon.agent.record.outputs import json_bytes, write_user_file
from perfmon.agent.record.runs import RecordedRun, distrust, find_runs, read_summary_run
from perfmon.agent.reducers.goodput import Ledger, combined, recorded_ledger
from perfmon.agent.reducers.iterations import percentile
from perfmon.agent.reducers.ranks import StragglerRule
from perfmon.parsers.errors import InputFileError, PerfmonError
from perfmon.parsers.figures import finite, mean, render

MAX_DEPTH = 3
MERGE_DESCRIPTION = ("Combine the perf summaries of one job written on several nodes (matched "
                     "by session_info.job.id) into one job summary.")
MERGE_EPILOG = """\
examples:
  perfmon-agent merge /shared/perfmon/jobs/*/ -o job_summary.json
  perfmon-agent merge node0/ node1/ --job my-run-17 --json

Figures: docs/merge.md. Schema: docs/job_summary.schema.json.
"""


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folders", nargs="+", type=Path, metavar="DIR",
                   help=f"folders holding {SUMMARY_GLOB} (searched 3 levels deep)")
    p.add_argument("-o", "--output", type=Path, default=Path("job_summary.json"),
                   help="where to write the job summary (default: %(default)s)")
    p.add_argument("--job", help="the job id to merge, when the folders hold several")
    p.add_argument("--user", help="the owner of the job to merge, when two users' jobs have "
                   "that id")
    p.add_argument("--json", action="store_true", help="also print the job summary on stdout")


def find_summaries(folder: Path) -> list[Path]:
    """perf_summary_*.json files under ``folder`` (never through links), sorted."""
    if folder.is_symlink() or not folder.is_dir():
        raise InputFileError(f"folder {folder}: not a folder")
    return find_runs(folder, MAX_DEPTH, logs=False)


JobKey = tuple[str, str | None]  # (job id, owner): two users' jobs of one id are two jobs


def _job_key(run: RecordedRun) -> JobKey | None:
    job = run.info.get("job")
    if not isinstance(job, dict) or job.get("id") is None:
        return None
    user = job.get("user")
    return str(job["id"]), str(user) if user is not None else None


def _shown(key: JobKey) -> str:
    return key[0] if key[1] is None else f"{key[0]} (user {key[1]})"


def _whole_ledger(goodput: Any) -> bool:
    """Whether a session's goodput holds the figures its ledger is made of: its GPUs and
    seconds (read_summary makes one out of range unknown, e.g. 10^18 GPUs)."""
    if not isinstance(goodput, dict):
        return False
    ledger = goodput["job"] if isinstance(goodput.get("job"), dict) else goodput
    return isinstance(ledger.get("gpus"), int) and all(
        finite(ledger.get(k)) is not None for k in ("wall_seconds", "productive_seconds"))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Node:
    """One host's summaries of the job (several when its agent restarted)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.runs: list[RecordedRun] = []

    @property
    def own_numbering(self) -> bool:
        return all(r.info.get("iteration_numbering") == "job_counter" for r in self.runs)

    def entries(self) -> list[dict[str, Any]]:
        out = [e for r in self.runs for e in r.entries
               if isinstance(e.get("iteration"), int)
               and finite(e.get("step_time_ms")) is not None]
        return sorted(out, key=lambda e: e["iteration"])

    def stat(self, key: str) -> float | None:
        """The iteration-weighted mean of a final statistic over this node's summaries."""
        pairs = [(v, finite(r.stats.get("measured_iterations")) or 1.0) for r in self.runs
                 if (v := finite(r.stats.get(key))) is not None]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if pairs and total else None

    def ranks(self) -> list[dict[str, Any]]:
        return [x for r in self.runs for x in r.stats.get("ranks") or [] if isinstance(x, dict)]

    def compute_ms(self) -> float | None:
        """Its slowest rank's mean compute per step (None without the rank analysis)."""
        values = self.rank_values("avg_compute_ms")
        return max(values) if values else None

    def rank_values(self, key: str) -> list[float]:
        return [v for r in self.ranks() if (v := finite(r.get(key))) is not None]

    def events(self, key: str) -> list[dict[str, Any]]:
        """Its summaries' ``key`` events (stragglers, fail_slow), each with its host."""
        return [{"host": self.host, **e} for r in self.runs for e in r.stats.get(key) or []
                if isinstance(e, dict)]

    def exit_causes(self) -> list[dict[str, Any]]:
        causes = []
        for run in self.runs:
            exits = run.info.get("exit") or {}
            cause = exits.get("cause")
            if isinstance(cause, dict):
                # When: the rank's exit record (wall clock: the nodes' clocks compare).
                rank = (exits.get("ranks") or {}).get(str(cause.get("pid"))) or {}
                causes.append({"host": self.host, **cause, "time": rank.get("time")})
        return causes

    def ledger(self) -> Ledger | None:
        """Its goodput ledger of the job: its sessions' in time order (a session whose
        ledger lost a figure to the schema's range is left out)."""
        runs = sorted(self.runs, key=lambda r: str(r.info.get("start_time") or ""))
        return recorded_ledger([g for r in runs if _whole_ledger(g := r.stats.get("goodput"))])

    def row(self) -> dict[str, Any]:
        infos, stats = [r.info for r in self.runs], [r.stats for r in self.runs]
        pids = sorted({p for i in infos for p in i.get("pids") or [] if isinstance(p, int)})
        ranks = sorted({r for i in infos for r in i.get("ranks") or [] if isinstance(r, int)})
        peaks = [v for st in stats if (v := finite(st.get("peak_memory_gb"))) is not None]
        return {
            "host": self.host, "summaries": [str(r.source) for r in self.runs],
            "pids": pids, "ranks": ranks,
            "iterations": sum(int(i.get("total_iterations") or 0) for i in infos),
            "avg_step_time_ms": self.stat("avg_step_time_ms"),
            "avg_compute_ms": self.compute_ms(),
            "pod": next((pod for r in self.runs
                         if isinstance(pod := (r.info.get("job") or {}).get("pod"), dict)), None),
            "median_compute_ms": _median(self.rank_values("avg_compute_ms")),
            "avg_tokens_per_sec": self.stat("avg_tokens_per_sec"),
            "avg_samples_per_sec": self.stat("avg_samples_per_sec"),
            "avg_tflops_per_gpu": self.stat("avg_tflops_per_gpu"),
            "mfu": self.stat("mfu"),
            "peak_memory_gb": max(peaks) if peaks else None,
            "stragglers": sum(len(st.get("stragglers") or []) for st in stats),
            "goodput_ratio": ledger.figures().ratio if (ledger := self.ledger()) else None,
            "fail_slow_events": sum(1 for st in stats for e in st.get("fail_slow") or []
                                    if isinstance(e, dict) and e.get("event") == "fail_slow"),
            "hung": any(bool(i.get("hung")) for i in infos),
            "end_reason": infos[-1].get("end_reason"),
        }


def _aligned_logs(nodes: dict[str, Node], grid: int) -> list[dict[str, Any]]:
    """Per interval, aligned by iteration number on the log-interval grid (the nodes'
    agents attached at different iterations, so their entries end at different ones):
    the job's step is its slowest node's, throughput over the job's step."""
    by_iteration: dict[int, dict[str, dict[str, Any]]] = {}
    for node in nodes.values():
        for entry in node.entries():
            slot = -(-entry["iteration"] // grid) * grid
            by_iteration.setdefault(slot, {})[node.host] = entry
    logs: list[dict[str, Any]] = []
    for iteration in sorted(by_iteration):
        per_node = by_iteration[iteration]
        steps = {h: float(e["step_time_ms"]) for h, e in per_node.items()}
        slowest = max(steps, key=steps.__getitem__)
        logs.append({
            "iteration": iteration, "timestamp": per_node[slowest].get("timestamp"),
            "step_time_ms": steps[slowest], "slowest_node": slowest,
            "node_step_time_ms": steps, "nodes": len(per_node),
            **{key: _scaled(per_node, steps, steps[slowest], key)
               for key in ("tokens_per_sec", "samples_per_sec", "TFLOPS_per_GPU")},
        })
    return logs


def _job_statistics(rows: list[dict[str, Any]], logs: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's step times over the aligned intervals, and its throughput over them: a
    node's figure x node step / job step (every node computes from the global batch)."""
    steps_sorted = sorted(e["step_time_ms"] for e in logs)
    avg_step = mean(steps_sorted)

    def job_rate(key: str) -> float | None:
        return mean([v * r["avg_step_time_ms"] / avg_step for r in rows
                      if avg_step and (v := finite(r.get(key))) is not None
                      and finite(r.get("avg_step_time_ms"))])

    tflops = job_rate("avg_tflops_per_gpu")
    peaks = [r["avg_tflops_per_gpu"] / r["mfu"] for r in rows
             if finite(r.get("avg_tflops_per_gpu")) and finite(r.get("mfu"))]
    return {
        "avg_step_time_ms": avg_step,
        "p50_step_time_ms": percentile(steps_sorted, 0.5),
        "p90_step_time_ms": percentile(steps_sorted, 0.9),
        "max_step_time_ms": steps_sorted[-1] if steps_sorted else None,
        "intervals": len(logs),
        "total_iterations": max((r["iterations"] for r in rows), default=0),
        "avg_tokens_per_sec": job_rate("avg_tokens_per_sec"),
        "avg_samples_per_sec": job_rate("avg_samples_per_sec"),
        "avg_tflops_per_gpu": tflops,
        "mfu": tflops / statistics.fmean(peaks) if tflops is not None and peaks else None,
    }


def merge(runs: list[RecordedRun], job_id: str, refused: list[str] | None = None
          ) -> dict[str, Any]:
    """The job summary of ``runs`` (all of job ``job_id``); ``refused``: a line for each
    summary of the job that was not believed (perfmon.agent.record.runs.distrust)."""
    nodes: dict[str, Node] = {}
    for run in runs:
        nodes.setdefault(run.host, Node(run.host)).runs.append(run)
    infos = [r.info for r in runs]
    job: dict[str, Any] = next((i["job"] for i in infos if isinstance(i.get("job"), dict)), {})
    grid = max((i["log_interval"] for i in infos
                if isinstance(i.get("log_interval"), int) and i["log_interval"] > 0), default=1)
    logs = _aligned_logs(nodes, grid)
    rows = [n.row() for n in sorted(nodes.values(), key=lambda n: n.host)]
    causes = sorted((c for n in nodes.values() for c in n.exit_causes()),
                    key=lambda c: str(c["time"] or "~"))
    return {
        "job_info": {
            "job_id": job_id, "name": job.get("name"), "id_from": job.get("id_from"),
            "user": job.get("user"),
            "slurm": job.get("slurm"),  # (its pods: each node's own, in nodes[])
            "nodes": len(nodes), "hosts": sorted(nodes),
            "ranks": sum(len(r["pids"]) for r in rows),
            "start_time": min((str(i.get("start_time")) for i in infos), default=None),
            "end_time": max((str(i["end_time"]) for i in infos if i.get("end_time")),
                            default=None),
            "aligned_by": ("job_counter" if all(n.own_numbering for n in nodes.values())
                           else "attach"),
            "inputs": [str(r.source) for r in runs],
            "refused": list(refused or []),
            "merged_by": f"perfmon-agent {agent_version()}",
        },
        "final_statistics": {
            **_job_statistics(rows, logs),
            "nodes": rows,
            "slowest_node": _slowest(rows),
            "goodput": (render(job_ledger.figures()) if (job_ledger := combined(
                [x for n in nodes.values() if (x := n.ledger()) is not None])) else None),
            "slow_host": slow_host(rows, [v for n in nodes.values()
                                           for v in n.rank_values("avg_step_time_ms")]),
            "stragglers": [e for n in nodes.values() for e in n.events("stragglers")],
            "fail_slow": [e for n in nodes.values() for e in n.events("fail_slow")],
            "exit_cause": causes[0] if causes else None,
        },
        "iteration_logs": logs,
    }


def _scaled(per_node: dict[str, dict[str, Any]], steps: dict[str, float], job_step: float,
            key: str) -> float | None:
    """A throughput figure over the job's step: each node's x its step / the job's."""
    if job_step <= 0:
        return None
    return mean([v * steps[h] / job_step for h, e in per_node.items()
                  if (v := finite(e.get(key))) is not None])


def _slowest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The node whose ranks compute longest (else whose step is longest), and by how
    much against the median of the other nodes."""
    for key in ("avg_compute_ms", "avg_step_time_ms"):
        values: dict[str, float] = {
            r["host"]: v for r in rows if (v := finite(r.get(key))) is not None}
        if len(values) < 2 or len(values) < len(rows):
            continue
        host = max(values, key=values.__getitem__)
        others = statistics.median(v for h, v in values.items() if h != host)
        return {"host": host, "by": key, "value_ms": values[host],
                "others_median_ms": others, "excess_ms": values[host] - others,
                "excess_pct": 100 * (values[host] / others - 1) if others else None}
    return None


def slow_host(rows: list[dict[str, Any]], rank_steps_ms: list[float]
               ) -> dict[str, Any] | None:
    """The host whose ranks' median compute stands out among the job's hosts: the rank
    rule's cross-host form (StragglerRule.across_hosts, as the Prometheus rule
    PerfmonSlowHost) over the ranks' mean step. None when no host does (or fewer than
    two have the figure)."""
    compute = {r["host"]: v for r in rows if (v := finite(r.get("median_compute_ms")))
               is not None}
    if not rank_steps_ms:
        return None
    slow = StragglerRule().across_hosts(compute, statistics.fmean(rank_steps_ms))
    if slow is None:
        return None
    return {"host": slow.host, "median_compute_ms": slow.compute_ms,
            "reference_ms": slow.reference_ms, "excess_ms": slow.excess_ms,
            "bar_ms": slow.bar_ms, "spread_ms": slow.spread_ms}


class _Found:
    """The summaries under the folders: believed ones by job, and a line for each other."""

    def __init__(self, paths: list[Path]) -> None:
        self.by_job: dict[JobKey, list[RecordedRun]] = {}
        self.refused: dict[JobKey | None, list[str]] = {}
        self.errors: list[PerfmonError] = []
        for path in paths:
            try:
                run = read_summary_run(path)
            except PerfmonError as err:  # one bad file among several is a warning
                self.errors.append(err)
                continue
            key = _job_key(run)
            refusal = distrust(run)
            if refusal is not None:  # one line, and nothing of it
                warn(refusal)
                self.refused.setdefault(key, []).append(refusal)
                continue
            for problem in run.warnings:
                warn(problem)
            if key is None:
                warn(f"{path}: no session_info.job.id (written by an older agent): left out")
                continue
            self.by_job.setdefault(key, []).append(run)


def _chosen_job(found: _Found, args: argparse.Namespace) -> JobKey:
    """The job to merge: the only one, or the one --job and --user name. InputFileError."""
    folders = " ".join(map(str, args.folders))
    if not found.by_job:
        if found.errors and not found.refused:
            raise found.errors[0]
        for error in found.errors:
            warn(str(error))
        if found.refused:
            count = sum(map(len, found.refused.values()))
            raise InputFileError(f"nothing to merge under {folders}: {count} summar"
                                 f"{'y' if count == 1 else 'ies'} refused (named above: owned "
                                 "by neither root nor the job's user)")
        raise InputFileError(f"no summary under {folders} names its job (session_info.job.id)")
    for error in found.errors:
        warn(str(error))
    chosen = [k for k in found.by_job if (args.job is None or k[0] == args.job)
              and (args.user is None or k[1] == args.user)]
    if not chosen:
        wanted = " ".join(([f"job {args.job!r}"] if args.job is not None else [])
                          + ([f"of user {args.user!r}"] if args.user is not None else []))
        held = ", ".join(sorted(map(_shown, found.by_job)))
        refused = sum(len(v) for k, v in found.refused.items() if k is not None
                      and (args.job is None or k[0] == args.job)
                      and (args.user is None or k[1] == args.user))
        raise InputFileError(f"{wanted} not found" + (
            f" ({refused} of its summaries refused, named above)" if refused else "")
            + f"; the folders hold: {held}")
    if len(chosen) > 1:
        # The count and the list are of the same jobs: those that could be meant.
        listed = ", ".join(sorted(map(_shown, chosen)))
        which = (f"--user (job {args.job!r} is {len(chosen)} users' jobs)"
                 if args.job is not None else "--job (and --user)")
        raise InputFileError(f"the folders hold {len(chosen)} jobs ({listed}): name one "
                             f"with {which}")
    return chosen[0]


def merge_main(args: argparse.Namespace) -> int:
    paths = [p for folder in args.folders for p in find_summaries(folder)]
    if not paths:
        raise InputFileError(f"no {SUMMARY_GLOB} under {' '.join(map(str, args.folders))}")
    found = _Found(paths)
    key = _chosen_job(found, args)
    job_id = key[0]
    result = merge(found.by_job[key], job_id, found.refused.get(key))
    data = json_bytes(result)
    write_user_file(args.output, data)
    if args.json:
        sys.stdout.write(data.decode())
        return 0
    stats = result["final_statistics"]
    slowest = stats["slowest_node"]
    print(printable(
        f"job {job_id}: {result['job_info']['nodes']} nodes, {result['job_info']['ranks']} "
        f"ranks, {stats['intervals']} aligned intervals, step "
        f"{stats['avg_step_time_ms'] or 0:.1f} ms"
        + (f"; slowest node {slowest['host']} (+{slowest['excess_ms']:.1f} ms)"
           if slowest else "")
        + (f"; slow host {slow['host']} (+{slow['excess_ms']:.1f} ms compute a step)"
           if (slow := stats["slow_host"]) else "")))
    print(printable(f"job summary: {args.output}"))
    return 0


COMMAND = Command("merge", "one job summary from the summaries of several nodes",
                  add_merge_arguments, merge_main, description=MERGE_DESCRIPTION,
                  epilog=MERGE_EPILOG)
