"""The Kubernetes deployment (docs/deploy/): the fields that matter, checked against the
agent itself. No cluster runs here, so the manifest is not applied: its capabilities are
the systemd unit's, its arguments parse with the agent's own parser, its probes reach
the port the agent listens on, and the ServiceMonitor finds the pods' metrics."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from perfmon.agent.cli import build_parser
from perfmon.agent.daemon.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy"


def _documents() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def _unit_capabilities() -> set[str]:
    unit = (ROOT / "systemd" / "perfmon-agent.service").read_text()
    (line,) = re.findall(r"^CapabilityBoundingSet=(.*)$", unit, re.M)
    return {c.removeprefix("CAP_") for c in line.split()}


def test_the_daemonset_sees_the_nodes_processes_with_the_units_capabilities_and_no_more():
    pod = _documents()["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod.get("hostNetwork") is False
    (agent,) = pod["containers"]
    security = agent["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == _unit_capabilities()
    # What probing needs from the node: tracefs, and the kernel headers bcc compiles with.
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug", "/lib/modules", "/usr/src",
                 "/var/lib/perfmon-agent"):
        assert host_paths[mounts[path]["name"]] == path
    assert mounts["/lib/modules"]["readOnly"] and mounts["/usr/src"]["readOnly"]
    assert security["readOnlyRootFilesystem"] is True and "/tmp" in mounts


def test_the_daemonsets_arguments_are_the_agents_and_name_the_node_and_the_pods_address():
    pod = _documents()["DaemonSet"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"]
           if "valueFrom" in e}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    # Kubernetes fills in $(VAR); the agent's own parser takes what results.
    args = [re.sub(r"\$\((\w+)\)", lambda m: {"NODE_NAME": "gpu-node-7",
                                              "POD_IP": "10.1.2.3"}[m[1]], a)
            for a in agent["args"]]
    parsed = build_parser().parse_args(args)
    assert parsed.host == "gpu-node-7" and parsed.metrics_address == "10.1.2.3:9464"
    assert str(parsed.config) == "/etc/perfmon-agent/config.yaml"
    (port,) = agent["ports"]
    assert port == {"name": "metrics", "containerPort": 9464, "protocol": "TCP"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    # The config the pod mounts is the service's own schema's.
    config = _documents()["ConfigMap"]["data"]["config.yaml"]
    assert str(parse_config(config, "the ConfigMap").jobs_root) == "/var/lib/perfmon-agent/jobs"


def test_the_servicemonitor_scrapes_the_pods_and_keeps_the_agents_job_labels():
    docs = _documents()
    labels = docs["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    service, monitor = docs["Service"], docs["ServiceMonitor"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["name"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True


def test_the_image_has_bcc_and_runs_the_agent():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM debian:12", text, re.M)
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    assert 'ENTRYPOINT ["/opt/perfmon-agent/venv/bin/perfmon-agent"]' in text
    # Every folder it copies is the package's.
    for source in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / source).exists(), source
