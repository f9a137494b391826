# Set-up, demo and tests. Everything here runs as root on a fresh Debian 12
# machine and is safe to re-run.
#
#   make demo   install, start the bundled demo training job, attach for ~20 s,
#               then write the HTML report and say where it is
#   make test   install (with test tools), then ruff, mypy and the whole suite
#               (tests/unit and tests/e2e)
#   make test-fast  the pure tests only (tests/unit: no eBPF, no process started),
#                   no ruff or mypy; needs the venv with the test tools (make test)
#   make install    the node service: its own venv in $(PREFIX), the systemd unit,
#                   an example config in $(SYSCONFDIR) (kept if present)
#   make uninstall  removes the venv and the unit (config and job data stay)

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
KERNEL := $(shell uname -r)
DEMO_SECONDS ?= 20
DEMO_OUT ?= outputs/demo
# The CPU build of PyTorch: a plain `torch` would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEB_PACKAGES := bpfcc-tools python3-bpfcc python3-venv python3-dev gcc make libc6-dev
# The suite's workers (pytest-xdist, a test file each at a time): most e2e tests wait on
# real jobs' wall-clock seconds, so more workers than cores; the pure tests are CPU-bound.
TEST_WORKERS ?= 4
FAST_WORKERS ?= 2
# ... and the tests that judge a job's timing (tests/conftest.py TIMING_FILES), after the
# rest, two at a time (a load of ~2: most of their jobs wait as GPU jobs do): beside
# three other workers their jobs were starved of CPU. One at a time: ~17 minutes.
TIMING_WORKERS ?= 2
# What the tests run for real: a Prometheus server (and promtool), headless
# Chromium for the HTML report, systemd-analyze for the unit, tmux for `top`, sudo
# for `run` started the way users start it, Slurm (its controller, node daemon and
# commands, with munge) for jobs that Slurm starts; the tests start the daemons.
TEST_DEB_PACKAGES := prometheus chromium systemd tmux sudo slurmctld slurmd slurm-client munge

# make install: where the service goes.
PREFIX ?= /opt/perfmon-agent
SYSCONFDIR ?= /etc/perfmon-agent
UNITDIR ?= /etc/systemd/system
SERVICE_DOCS := docs/service.md docs/prometheus.md docs/security.md docs/requirements.md

.PHONY: setup setup-system setup-test-system setup-headers setup-venv demo test test-fast summary-types lint typecheck clean install uninstall

setup: setup-system setup-headers setup-venv

setup-system:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# bcc compiles BPF programs against the running kernel's headers. Use the
# matching package when Debian has one; otherwise (a custom kernel, as on many
# cloud and container hosts) link Debian's generic amd64 headers into place:
# uprobe programs only need the common uapi/arch headers.
setup-headers:
	@if [ -d /lib/modules/$(KERNEL)/build/include ]; then exit 0; fi; \
	if apt-cache show linux-headers-$(KERNEL) >/dev/null 2>&1; then \
	  echo "installing linux-headers-$(KERNEL)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q linux-headers-$(KERNEL); \
	else \
	  echo "no header package for kernel $(KERNEL): linking Debian's linux-headers-amd64"; \
	  dpkg-query -W -f='$${Status}' linux-headers-amd64 2>/dev/null | grep -q "ok installed" || \
	    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q linux-headers-amd64; }; \
	  hdr=$$(ls -d /usr/src/linux-headers-*-amd64 | sort -V | tail -n 1); \
	  common=$$(ls -d /usr/src/linux-headers-*-common | sort -V | tail -n 1); \
	  mkdir -p /lib/modules/$(KERNEL); \
	  ln -sfn "$$hdr" /lib/modules/$(KERNEL)/build; \
	  ln -sfn "$$common" /lib/modules/$(KERNEL)/source; \
	  echo "linked /lib/modules/$(KERNEL)/build -> $$hdr"; \
	fi

# A virtualenv from Debian's python3 with --system-site-packages, so that it
# sees bcc (python3-bpfcc is not on PyPI).
$(PY):
	/usr/bin/python3 -m venv --system-site-packages $(VENV)

setup-venv: $(PY)
	$(PY) -m pip install -q --upgrade "pip>=23" "setuptools>=68"
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[demo]"
	@$(PY) -c "import bcc, torch, perfmon.agent" || \
	  { echo "set-up incomplete: bcc, torch or perfmon.agent does not import"; exit 1; }

demo: setup
	@mkdir -p $(DEMO_OUT)
	@printf '%s\n' "global_batch_size: 8" > $(DEMO_OUT)/model.yaml
	@$(PY) tests/targets/train_gpt.py --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
	  --seq-length 128 --vocab-size 1024 --micro-batch-size 4 --grad-accum 2 \
	  > $(DEMO_OUT)/train.log 2>&1 & train=$$!; \
	for i in $$(seq 300); do grep -q training $(DEMO_OUT)/train.log 2>/dev/null && break; sleep 0.2; done; \
	echo "demo training job: pid $$train (model dimensions from its command line, batch from $(DEMO_OUT)/model.yaml)"; \
	$(VENV)/bin/perfmon-agent attach --pid $$train --model-config $(DEMO_OUT)/model.yaml \
	  --duration $(DEMO_SECONDS) --log-interval 25 --output-dir $(DEMO_OUT); rc=$$?; \
	kill $$train 2>/dev/null; wait $$train 2>/dev/null; [ $$rc -eq 0 ] || exit $$rc; \
	log=$$(ls -t $(DEMO_OUT)/perf_events_*.msgpack | head -1); \
	$(VENV)/bin/perfmon-agent report $$log -o $(DEMO_OUT)/report.html && \
	echo "open $$(realpath $(DEMO_OUT)/report.html) in a browser (self-contained, works offline)"

lint:
	$(VENV)/bin/ruff check .

typecheck:
	$(VENV)/bin/mypy agent probes parsers

setup-test-system:
	@missing=""; for p in $(TEST_DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages for the tests:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

test: setup setup-test-system
	$(PY) -m pip install -q -e ".[demo,test]"
	$(MAKE) lint typecheck
	export PERFMON_REQUIRE_EBPF=$${PERFMON_REQUIRE_EBPF:-1}; \
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder -m "not timing" tests; rest=$$?; \
	$(PY) -m pytest -q --durations=15 -n $(TIMING_WORKERS) --dist loadfile \
	  --no-loadscope-reorder -m timing tests; timing=$$?; \
	[ $$rest -eq 0 ] && [ $$timing -eq 0 ]

# tests/unit holds the tests that start no process (no agent, no training job, no eBPF):
# about 25 s on 2 workers; the few marked slow (5 s or more each) are left to `make test`.
test-fast:
	@$(PY) -c "import pytest, hypothesis, perfmon.agent" 2>/dev/null || { echo \
	  "test-fast: $(PY) lacks the test tools: run make test once, or make setup-venv and then $(PY) -m pip install -e '.[demo,test]'"; \
	  exit 1; }
	$(PY) -m pytest -q -m "not slow" -n $(FAST_WORKERS) tests/unit

# The summary's TypedDicts (agent/record/summary_types.py), written from its schema.
summary-types:
	$(PY) -c "import json, sys; from perfmon.parsers.schema_types import typed_dicts_source; \
	  sys.stdout.write(typed_dicts_source(json.load(open('parsers/data/perf_summary.schema.json'))))" \
	  > agent/record/summary_types.py

# The service's own virtualenv (Debian's python3, --system-site-packages for bcc),
# the package built from this tree, the unit with PREFIX and SYSCONFDIR filled in.
install: setup-system setup-headers
	/usr/bin/python3 -m venv --system-site-packages "$(PREFIX)/venv"
	"$(PREFIX)/venv/bin/python" -m pip install -q --upgrade "pip>=23" "setuptools>=68"
	"$(PREFIX)/venv/bin/python" -m pip install -q .
	install -d -m 0755 "$(PREFIX)/share/doc"
	install -m 0644 $(SERVICE_DOCS) "$(PREFIX)/share/doc/"
	install -d -m 0755 "$(SYSCONFDIR)" "$(UNITDIR)"
	@if [ -e "$(SYSCONFDIR)/config.yaml" ]; then echo "kept $(SYSCONFDIR)/config.yaml"; \
	else install -m 0644 systemd/config.yaml "$(SYSCONFDIR)/config.yaml"; fi
	sed -e 's|/opt/perfmon-agent|$(PREFIX)|g' -e 's|/etc/perfmon-agent|$(SYSCONFDIR)|g' \
	  systemd/perfmon-agent.service > "$(UNITDIR)/perfmon-agent.service"
	chmod 0644 "$(UNITDIR)/perfmon-agent.service"
	@if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "installed; start it with: systemctl enable --now perfmon-agent"

uninstall:
	@if [ -d /run/systemd/system ]; then systemctl disable --now perfmon-agent 2>/dev/null || true; fi
	rm -f "$(UNITDIR)/perfmon-agent.service"
	rm -rf "$(PREFIX)/venv" "$(PREFIX)/share/doc"
	-rmdir "$(PREFIX)/share" "$(PREFIX)" 2>/dev/null
	@if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "removed; kept $(SYSCONFDIR) and /var/lib/perfmon-agent (configuration and job data)"

clean:
	rm -rf $(VENV) outputs build *.egg-info tests/fakes/build
