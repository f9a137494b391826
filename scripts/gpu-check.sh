#!/usr/bin/env bash
# GPU check, for an NVIDIA machine: the GPU-side tests, then a short real CUDA
# training job under the agent, with the figures it measured printed next to
# what the job and the driver say. Finishes in under 8 minutes.
#
#   scripts/gpu-check.sh            # uses python3; OUT=<dir> keeps the files
#
# Needs python3 with torch (CUDA), nvidia-ml-py, psutil, msgpack, PyYAML,
# jsonschema, rich, py-spy and zstandard; wheels found in .whl/ are installed into a
# private folder first (for machines without a package registry). Without bcc
# the agent falls back to py-spy for iterations, and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()  # what went wrong; the script exits non-zero when anything did
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

# perfmon.* without installing: a folder whose perfmon/ links to the three code folders.
shim=$(mktemp -d)
mkdir -p "$shim/perfmon"
for d in agent probes parsers; do ln -s "$PWD/$d" "$shim/perfmon/$d"; done
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/perfmon-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/perfmon-site" && export PATH="/tmp/perfmon-site/bin:$PATH"
fi

echo "== driver"
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total,power.draw --format=csv

echo "== health check against the real driver"
timeout 60 "$PY" -m perfmon.agent.cli health --window 3 --json > "$OUT/health.json"
rc=$?; echo "exit $rc"; [ "$rc" -le 1 ] || failed+=("health exit $rc")
"$PY" - "$OUT/health.json" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
print("status", report["status"])
for gpu in report["gpus"]:
    for check in gpu["checks"]:
        print(f"  gpu {gpu['index']} {check['name']:<20} {check['status']:<8} {check['reason']}")
PYEOF

echo "== GPU-side tests (fake NVML, fake CUDA/NCCL; uprobe tests need bcc)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_nvml_sampler.py tests/e2e/test_health.py \
  tests/e2e/test_attach_gpu.py tests/e2e/test_cuda_probe.py > "$OUT/pytest.log" 2>&1
rc=$?; tail -n 15 "$OUT/pytest.log"; [ "$rc" -eq 0 ] || failed+=("GPU-side tests exit $rc")

echo "== a CUDA training job under the agent"
"$PY" tests/targets/train_gpt.py --device cuda --num-layers 8 --hidden-size 1024 \
  --num-attention-heads 16 --seq-length 512 --vocab-size 32000 --micro-batch-size 8 \
  --timestamps "$OUT/stamps.txt" > "$OUT/train.log" 2>&1 &
job=$!
trap 'kill $job 2>/dev/null; wait $job 2>/dev/null' EXIT
for _ in $(seq 300); do [ -s "$OUT/stamps.txt" ] && break; sleep 0.2; done
printf 'num_layers: 8\nhidden_size: 1024\nnum_attention_heads: 16\nseq_length: 512\nvocab_size: 32000\nglobal_batch_size: 8\n' \
  > "$OUT/model.yaml"
timeout 180 "$PY" -m perfmon.agent.cli attach --pid "$job" --duration 45 --log-interval 50 \
  --model-config "$OUT/model.yaml" --dtype tf32 --output-dir "$OUT" --json > "$OUT/summary.json"
rc=$?; echo "attach exit $rc"; [ "$rc" -eq 0 ] || failed+=("attach exit $rc")
smi_mem=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F, -v p="$job" '$1==p {print $2}')
"$PY" - "$OUT" "${smi_mem:-}" <<'PYEOF'
import itertools, json, re, statistics, sys
out, smi_mib = sys.argv[1], sys.argv[2]
s = json.load(open(f"{out}/summary.json"))
info, f = s["session_info"], s["final_statistics"]
stamps = [int(l.split()[1]) for l in open(f"{out}/stamps.txt") if l.strip()]
window = [t for t in stamps if info["attach_monotonic_ns"] <= t <= info["detach_monotonic_ns"]]
truth = statistics.fmean((b - a) / 1e6 for a, b in itertools.pairwise(window))
reserved = re.findall(r"max_memory_reserved ([\d.]+) GB", open(f"{out}/train.log").read())
print(f"iteration source     {info['iteration_source']}  warnings: {info['warnings']}")
print(f"device               {info['gpu'].get('device')}  peak {info['gpu'].get('peak_tflops')} TFLOPS ({info['gpu'].get('dtype')})")
print(f"iterations           agent {info['total_iterations']}  job {len(window)}")
print(f"mean step time       agent {f['avg_step_time_ms']:.3f} ms  job {truth:.3f} ms  "
      f"ratio {f['avg_step_time_ms'] / truth:.4f}")
print(f"TFLOPS/GPU, MFU      {f['avg_tflops_per_gpu']}  {f['mfu']}")
print(f"GPU memory           agent peak {f['peak_memory_gb']} GB ({f['memory_kind']})  "
      f"nvidia-smi {smi_mib or '?'} MiB  torch max_memory_reserved {reserved[-1] if reserved else '?'} GB")
print(f"GPU util, power      {f['avg_gpu_utilization_pct']} %  {f['avg_gpu_power_w']} W  "
      f"throttle {f['gpu_throttle_reasons']}")
print(f"phases               {f['phases_source']}: " + ", ".join(
    f"{k} {v['share']:.0%}" for k, v in (f["phases"] or {}).items()))
print(f"CUDA per iteration   {f.get('kernels_per_iter')} launches, "
      f"{f.get('cpu_sync_wait_ms')} ms sync wait")
# The check fails when the agent's step time or count disagrees with the job's own.
sys.exit(0 if abs(f["avg_step_time_ms"] / truth - 1) <= 0.02
         and abs(info["total_iterations"] - len(window)) <= 1 else 1)
PYEOF
rc=$?; [ "$rc" -eq 0 ] || failed+=("summary check exit $rc")
if [ ${#failed[@]} -gt 0 ]; then
  printf 'GPU check FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "GPU check passed"
