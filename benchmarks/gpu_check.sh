#!/usr/bin/env bash
# Every GPU check of issue 34 in one go, written as one Markdown report.
#
#   benchmarks/gpu_check.sh REPORT.md            # on a machine with one CUDA device
#   benchmarks/gpu_check.sh REPORT.md cpu        # the same steps on the CPU (a smoke run of this script)
#
# Steps, each under its own timeout (GPU_CHECK_TIMEOUT seconds, default 300), each one's output
# and exit status in the report, a summary table at the end; the script exits non-zero if any
# step failed:
#   1. the environment: date, torch, CUDA, the device, transformers;
#   2. pytest tests/test_gpu.py --device DEVICE (correctness at world size 1, against the unsharded model);
#   3. benchmarks/tp_step.py at world size 1: apply_fn against model(...) (the per-call overhead
#      budget), DTensor, and torch.compile with Inductor;
#   4. benchmarks/train_step.py at world size 1: hpf.fsdp against FSDP2 (a training step with AdamW);
#   5. benchmarks/agree_values.py at world size 1: shard()'s value checksum on the device.
# One device only: NCCL refuses two ranks on one GPU, so nothing here runs more than one rank.
# GPU_CHECK_QUICK=1 passes --quick and the tiny size to the benchmarks; PYTHON picks the interpreter.
set -u -o pipefail

report=${1:?usage: benchmarks/gpu_check.sh REPORT.md [device]}
device=${2:-cuda}
python=${PYTHON:-python}
limit=${GPU_CHECK_TIMEOUT:-300}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$report" in /*) ;; *) report="$PWD/$report" ;; esac
cd "$root" || exit 2
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
quick=()
sizes=tiny,large
if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then quick=(--quick); sizes=tiny; fi

statuses=()
step() {  # step TITLE COMMAND...: run it under the timeout, its output fenced in the report
    local title=$1 start rc
    shift
    start=$(date +%s)
    {
        echo
        echo "## $title"
        echo
        echo "\`$*\`"
        echo
        echo '```'
    } >>"$report"
    timeout "$limit" "$@" >>"$report" 2>&1
    rc=$?
    {
        echo '```'
        echo
        echo "exit status $rc, $(($(date +%s) - start)) s$([ $rc = 124 ] && echo ", timed out after $limit s")"
    } >>"$report"
    statuses+=("| $title | $([ $rc = 0 ] && echo pass || echo "FAIL ($rc)") | $(($(date +%s) - start)) s |")
    echo "$title: exit $rc" >&2
}

{
    echo "# GPU check: device $device"
    echo
    echo "Written by \`benchmarks/gpu_check.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)."
} >"$report"

step "Environment" "$python" -c "
import platform, torch, transformers
print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| transformers', transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('device', p.name, f'{p.total_memory / 2**30:.0f} GiB', 'capability', f'{p.major}.{p.minor}',
          '| driver CUDA', torch._C._cuda_getDriverVersion() if hasattr(torch._C, '_cuda_getDriverVersion') else '?')
else:
    print('no CUDA device visible')
"
step "Correctness: tests/test_gpu.py" "$python" -m pytest tests/test_gpu.py --device "$device" -v -rs -p no:cacheprovider
step "tp_step at world size 1 (apply_fn vs model(...), DTensor, Inductor)" \
    "$python" benchmarks/tp_step.py --device "$device" --worlds 1 --sizes "$sizes" --compile inductor "${quick[@]}"
step "train_step at world size 1 (hpf.fsdp vs FSDP2, AdamW)" \
    "$python" benchmarks/train_step.py --device "$device" --worlds 1 --sizes "$sizes" "${quick[@]}"
step "agree_values at world size 1 (the value checksum on the device)" \
    "$python" benchmarks/agree_values.py --device "$device" --world 1

{
    echo
    echo "## Summary"
    echo
    echo "| step | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${statuses[@]}"
} >>"$report"
! printf '%s\n' "${statuses[@]}" | grep -q FAIL
