#!/usr/bin/env bash
# The GPU checks the open issues wait for, as one prepared run (a lent GPU has 15 device-minutes
# a session, and a command at most 10 minutes). Run from the repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh [first|second|peers|closing]
#
# "closing" (at most 585 s): the checks that can close issues first, each step cut to what is left
#   of the call: the data-parallel overhead at world size 1 (issue 21, item 5); 4 Llama-2-7B-shape
#   layers at 131,072 tokens, fused head against unfused (issue 19, item 5; at 32,768 tokens too if
#   the unfused head does not fit at 131k); megatrain alone at 8 of 32 layers (issue 17); the bf16
#   autocast policy (issue 17, item 2).
#
# "first" (default, about 9 minutes on an H100; give the device call timeout_s 600):
#   1. tests/test_cuda.py, the CUDA autocast ones first (the step traced with CUDA's lists, a step's
#      own and a caller's torch.autocast("cuda")), then the rest: the CUDA path after the changes
#      made without a GPU (loads allocated on the compute stream, merge_compute_runs, offload
#      arenas, gradient landing buffers, weight copies);
#   2. benchmarks/bf16_autocast_policy.py: first losses under CUDA's autocast lists (issue 17, item 2);
#      benchmarks/host_thread_ops.py on CUDA: ops run one by one and the host thread's busy share,
#      merge_compute_runs on and off;
#   3. benchmarks/peers.py, megatrain alone, 8 of 32 Llama-2-7B layers, 8 x 4096 tokens, 60 GiB:
#      step time, TFLOPS, reserved / budget (target <= 1.05), host thread busy, RSS.
# "second" (about 9.5 minutes): the 32-layer Llama-2-7B step with megatrain alone (issue 17's
#   target shape), the data-parallel path's overhead at world size 1 (issue 21, item 5) and the
#   long-context run at 131,072 tokens (issue 19).
# "peers" (about 10 minutes): the other systems of benchmarks/peers.py at 8 layers, on the machine
#   that ran "first" (merge the two files with peers.py --merge-into). It needs
#   the peers' code carried beside the checkout (not in the repo): DeepSpeed and its needs as
#   wheels in .whl/ (installed by the device tool's recipe before this script), MegaTrain's
#   checkout in .peers/MegaTrain (fetch github:DLYuanGod/MegaTrain); name both in `carry`.
# Every step's output is appended to $OUT/session.log; results go to $OUT (the device tool brings them back), else to benchmarks/results/gpu-session.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu-session}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
part="${1:-first}"
DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-100000} ))
step() {  # step NAME SECONDS COMMAND...: one check, its log in $OUT/NAME.log, never stops the rest
    local name="$1" seconds="$2" left=$(( DEADLINE - $(date +%s) ))
    shift 2
    if [ "$left" -lt 30 ]; then echo "== $name: skipped, ${left}s left of the call"; return; fi
    if [ "$left" -lt "$seconds" ]; then seconds=$left; fi
    echo "== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*"
    # One log for the whole run: the device tool brings back at most 8 files.
    timeout "$seconds" "$@" >"/tmp/gpu_session_step.log" 2>&1
    echo "== $name: exit $? at $(date -u +%H:%M:%S)"
    { echo "===== $name: $*"; cat /tmp/gpu_session_step.log; } >>"$OUT/session.log"
    tail -n 25 /tmp/gpu_session_step.log
}
nvidia-smi -L
# The device machine runs the checkout uninstalled: without pip's editable mapping, megacompile.passes and
# megacompile.runtime (top-level passes/ and runtime/, see pyproject.toml) are reached through links.
if ! "$PY" -c "import megacompile.passes, megacompile.runtime" 2>/dev/null; then
    ln -sfn ../passes megacompile/passes && ln -sfn ../runtime megacompile/runtime
    "$PY" -c "import megacompile.passes, megacompile.runtime" || exit 1
fi
if [ "$part" = first ]; then
    step test_cuda_autocast 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "autocast or flash_pair"
    step test_cuda 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -x -k "not autocast and not flash_pair"
    step bf16_autocast_policy 60 "$PY" benchmarks/bf16_autocast_policy.py --out "$OUT/bf16_autocast_policy.txt"
    step host_thread_ops 90 "$PY" benchmarks/host_thread_ops.py --device cuda --layers 4 --hidden 1024 \
        --seq 1024 --batch 4 --budget-fractions 1.0 0.45 --out "$OUT/host_thread_ops.txt"
    step peers_8_layers 170 "$PY" benchmarks/peers.py --systems megatrain --layers 8 --seq 4096 --batch 8 \
        --steps 5 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 160 --out-dir "$OUT" --tag megatrain-8layers
elif [ "$part" = closing ]; then
    DEADLINE=$(( $(date +%s) + 585 ))
    step data_parallel_overhead 60 "$PY" benchmarks/data_parallel_overhead.py --device cuda --steps 15 \
        --out "$OUT/data_parallel_overhead.txt"
    step long_context_131k 250 "$PY" benchmarks/long_context.py --device cuda --layers 4 --seq 131072 \
        --budget 60GiB --steps 3 --compare-unfused --out "$OUT/long_context_131k.txt"
    step peers_8_layers 170 "$PY" benchmarks/peers.py --systems megatrain --layers 8 --seq 4096 --batch 8 \
        --steps 5 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 160 --out-dir "$OUT" --tag megatrain-8layers
    if ! grep -q "fused / unfused" "$OUT/long_context_131k.txt" 2>/dev/null; then
        step long_context_32k 150 "$PY" benchmarks/long_context.py --device cuda --layers 4 --seq 32768 \
            --budget 60GiB --steps 3 --compare-unfused --out "$OUT/long_context_32k.txt"
    fi
    step bf16_autocast_policy 60 "$PY" benchmarks/bf16_autocast_policy.py --out "$OUT/bf16_autocast_policy.txt"
elif [ "$part" = rerun ]; then
    # The second call of 2026-11-26 (290 s left): what "closing" could not show. Before it, the command
    # installs transformers 5.24 (the tests' pin; carried in .whl/) over the machine's 5.17, whose causal
    # mask construction the mask elision does not follow (the mask stayed: 131k x 131k, 49 GiB).
    DEADLINE=$(( $(date +%s) + 285 ))
    step data_parallel_overhead 60 "$PY" benchmarks/data_parallel_overhead.py --device cuda --steps 15 \
        --out "$OUT/data_parallel_overhead.txt"
    step long_context_131k 200 "$PY" benchmarks/long_context.py --device cuda --layers 4 --seq 131072 \
        --budget 60GiB --steps 3 --compare-unfused --out "$OUT/long_context_131k.txt"
    step test_cuda_autocast 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "autocast or flash_pair"
elif [ "$part" = peers ]; then
    # megatrain's own row comes from "first" on the same machine (its compile alone took 99 s).
    step peers_others 590 "$PY" benchmarks/peers.py --layers 8 --seq 4096 --batch 8 --steps 5 --budget 60GiB \
        --systems fsdp2_cpu_offload,deepspeed_zero3_offload,megatrain_reference,resident_torch_compile \
        --timeout 140 --out-dir "$OUT" --tag peers-8layers
else
    step peers_32_layers 330 "$PY" benchmarks/peers.py --systems megatrain --layers 32 --seq 4096 --batch 8 \
        --steps 4 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 320 --out-dir "$OUT" --tag megatrain-32layers
    step data_parallel_overhead 50 "$PY" benchmarks/data_parallel_overhead.py --device cuda --steps 15 \
        --out "$OUT/data_parallel_overhead.txt"
    step long_context 200 "$PY" benchmarks/long_context.py --device cuda --seq 131072 --budget 60GiB --steps 2 \
        --out "$OUT/long_context.txt"
fi
