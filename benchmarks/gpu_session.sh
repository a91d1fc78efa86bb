#!/usr/bin/env bash
# The GPU checks the open issues wait for, as one prepared run (a lent GPU has 15 device-minutes
# a session, machine start included, and a command at most 10 minutes). Run from the repository
# root on the GPU machine, in a device call with timeout_s 600:
#
#   bash benchmarks/gpu_session.sh [next|issue19|max_tokens|peers_7b|rss32|peers]
#
# Carry .whl/ with transformers 5.24 (the tests' pin; the machine has 5.17), and for "peers" DeepSpeed
# and its needs: `bash benchmarks/prepare_device.sh [--peers]` fills it, here; this script installs
# .whl/*.whl into /tmp/site there.
#
# What issue 17 still waits for, in order (15 device-minutes: the two fit one machine held warm between calls, about
# 240 + 530 s): "rss32" (timeout_s 240), then at once "max_tokens" (timeout_s 530). Name kind nvidia-h100-x1 where the
# status offers it: the issue's targets are an H100's, and every 7B row so far ran on an H200.
#
# "next" (default, at most 585 s; what the second session of 2026-11-26 left unmeasured; peers.py now reports the
#   worker's own peak RSS and its process tree's with descendants by PSS, and the first step's compile_times):
#   1. tests/test_cuda.py -k host_lead: the bound on the host's lead (option host_lead_layers, new, never run on a GPU);
#   2. issue 17 at its target shape: megatrain alone, Llama-2-7B's 32 layers, 8 x 4096 tokens, 60 GiB, with the host's
#      lead bounded (RSS: landing buffers of 18 layers' gradients were 7.65 GiB), the planner's streamed mixes above
#      recompute-all's peak (keep 11, streamed 26: 52.5 GiB planned instead of 15.3) and the corrected cost model
#      (2.87 s predicted; the 3.23 s step of 2026-11-26 re-priced at 2.96 s): step, TFLOPS, RSS, the host thread's own
#      work apart from its waits, and the host AdamW's in-step rate (2.87 G params/s then, 0.6x the calibrated idle
#      rate; blocking events, query() before synchronize() and the lead bound may change it);
#   3. the same 7B step with host_activation_budget=0 (activations on the device: the RSS target; since bb5578b bf16
#      gradients land in their weights' bf16 copies, so the 3.3 GiB of landing buffers of 2026-11-27 should be gone:
#      report.gradient_landing_bytes and optimizer["landed_in_weight_copies"]);
#   4. megacompile calibrate (its host AdamW is megatrain's kernel now: against the in-step rate);
#   5. the same at 8 layers, the depth of the peers' rows of 2026-11-24 (then "peers" on the same machine);
#   6. the rest of tests/test_cuda.py in what is left, and tests/test_kernel_dtypes.py (its rule against CUDA's kernels).
# "issue19": the long-context checks of 2026-11-26 (4 layers at 131,072 tokens fused and unfused, the head's forms,
#   the flash pair and autocast tests), about 7 minutes.
# "max_tokens" (about 6 minutes): issue 17's "largest tokens per step that fits", planned on the CPU and not yet run:
#   Llama-2-7B at 8 x 13,440 = 107,520 tokens, 60 GiB, activations on the host capped at 32 GiB (the host's 126 GiB
#   less the 88 GiB of state and 6 GiB for the process): the runtime planner's plan (token-chunked layers, keep 3,
#   recompute 20, streamed 14: 59.26 GiB, 29.69 GiB on the host, predicted 9.52 s;
#   benchmarks/results/runtime_plan-2026-11-26-*-llama2-7b-max-tokens-reconciled.txt).
# "peers_7b" (at most 585 s): issue 17's side by side at 32 layers, megatrain first; of 2026-11-27 (H200) megatrain took
#   170 s, FSDP2 111 s, MegaTrain's code 115 s, and DeepSpeed was cut inside its initialize at 109 s.
# "rss32" (about 200 s; the next session's first call, then "max_tokens" on the same machine): 7B with
#   host_activation_budget=0, issue 17's RSS target. Since 2026-11-28 bf16 7B steps are planned on the template (marked
#   layers kept as regions): on the CPU this plan is keep 4 / recompute 28 decoder layers, 52.39 GiB, 2.913 s predicted
#   (the flat planner's peak and step), and the default 60 GiB plan keep 7 / recompute 5 / streamed 20 at 2.868 s, each
#   compiled in about a third of the flat planner's time (runtime_plan-2026-11-28-*-template-mixes.txt). DeepSpeed's 32-layer row is settled: of 2026-11-27 (H200) it was
#   killed at 123.4 GiB RSS at 24 layers and ran at 16 (peers-2026-11-27-nvidia-h200-peers-ds-*layers.txt).
# "peers" (about 10 minutes): the other systems of benchmarks/peers.py at 8 layers, on the machine
#   that ran "next" (merge the two files with peers.py --merge-into). It needs
#   the peers' code carried beside the checkout (not in the repo): DeepSpeed and its needs as
#   wheels in .whl/, MegaTrain's checkout in .peers/MegaTrain (fetch github:DLYuanGod/MegaTrain);
#   name both in `carry`.
# Every step's output is appended to $OUT/session.log (the device tool brings back at most 8 files);
# results go to $OUT, else to benchmarks/results/gpu-session.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu-session}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
part="${1:-next}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-100000} ))
step() {  # step NAME SECONDS COMMAND...: one check, cut to what is left of the call; never stops the rest
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
if [ "$part" = next ]; then
    DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-585} ))
    step test_cuda_host_lead 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k host_lead
    PEERS_MEGATRAIN_TRACE="$OUT/megatrain-32layers-trace.json" \
    step peers_32_layers 230 "$PY" benchmarks/peers.py --systems megatrain --layers 32 --seq 4096 --batch 8 \
        --steps 4 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 220 --out-dir "$OUT" --tag megatrain-32layers
    # The same 7B step with activations kept on the device (host_activation_budget=0: keep 8, recompute 29, 52.4 GiB
    # planned, predicted 2.91 s): host RSS against issue 17's 14 B/param x N + 6 GiB = 93.9 GiB.
    PEERS_MEGATRAIN_OPTIONS='{"host_activation_budget": 0}' \
    step peers_32_layers_device_activations 200 "$PY" benchmarks/peers.py --systems megatrain --layers 32 --seq 4096 \
        --batch 8 --steps 4 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 190 --out-dir "$OUT" --tag megatrain-32layers-device-activations
    step calibrate 60 "$PY" -m megacompile calibrate --out "$OUT/calibrate.json"
    PEERS_MEGATRAIN_TRACE="$OUT/megatrain-8layers-trace.json" \
    step peers_8_layers 120 "$PY" benchmarks/peers.py --systems megatrain --layers 8 --seq 4096 --batch 8 \
        --steps 5 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 110 --out-dir "$OUT" --tag megatrain-8layers
    step test_cuda_rest 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not host_lead" \
        tests/test_kernel_dtypes.py
fi
if [ "$part" = issue19 ]; then
    DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-585} ))
    step long_context_131k 250 "$PY" benchmarks/long_context.py --device cuda --layers 4 --seq 131072 \
        --budget 60GiB --steps 3 --compare-unfused --out "$OUT/long_context_131k.txt"
    if ! grep -q "fused / unfused" "$OUT/long_context_131k.txt" 2>/dev/null; then  # the unfused head did not fit
        step long_context_32k 120 "$PY" benchmarks/long_context.py --device cuda --layers 4 --seq 32768 \
            --budget 60GiB --steps 4 --compare-unfused --out "$OUT/long_context_32k.txt"
    fi
    step fused_head_forms 60 "$PY" benchmarks/fused_head_forms.py --device cuda --tokens 32768 --hidden 4096 \
        --vocab 32000 --chunk 4096 --out "$OUT/fused_head_forms.txt"
    step test_cuda_flash_autocast 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "autocast or flash_pair"
fi
if [ "$part" = max_tokens ]; then
    DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-585} ))
    PEERS_MEGATRAIN_OPTIONS='{"host_activation_budget": "32GiB"}' \
    step peers_32_layers_max_tokens 500 "$PY" benchmarks/peers.py --systems megatrain --layers 32 --seq 13440 \
        --batch 8 --steps 3 --budget 60GiB --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json \
        --timeout 490 --out-dir "$OUT" --tag megatrain-32layers-max-tokens
fi
if [ "$part" = peers_7b ]; then
    # Issue 17's side-by-side at its target shape (32 layers, 6.74 B parameters, 8 x 4096 tokens), one system per
    # process, in the order of the targets that bind: megatrain, FSDP2 offload (1.5x), MegaTrain's code (1.0x),
    # DeepSpeed ZeRO-3 offload (1.3x) with what is left of the call. Results merge into one file after each system.
    DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-585} ))
    export TORCH_EXTENSIONS_DIR=/tmp/ds_ext MEGATRAIN_REF_OPTIMIZER=deepspeed_adam
    shape=(--layers 32 --seq 4096 --batch 8 --steps 4 --budget 60GiB
           --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json --out-dir "$OUT" --tag peers-32layers)
    PEERS_MEGATRAIN_TRACE="$OUT/megatrain-32layers-trace.json" \
    # The outer limit leaves peers.py its own start (~10 s) and the writing of its result past the worker's --timeout.
    step peers_7b_megatrain 270 "$PY" benchmarks/peers.py "${shape[@]}" --systems megatrain --timeout 240
    merged=$(ls "$OUT"/peers-*-peers-32layers.json 2>/dev/null | head -n 1)
    # PEERS_7B_SYSTEMS="name:seconds ...": the peers after megatrain, each with at most that many seconds.
    for system in ${PEERS_7B_SYSTEMS:-fsdp2_cpu_offload:150 megatrain_reference:160 deepspeed_zero3_offload:400}; do
        left=$(( DEADLINE - $(date +%s) - 30 ))
        limit=$(( ${system#*:} < left ? ${system#*:} : left ))
        step "peers_7b_${system%:*}" $(( limit + 30 )) "$PY" benchmarks/peers.py "${shape[@]}" --systems "${system%:*}" \
            --timeout "$limit" ${merged:+--merge-into "$merged"}
        merged=${merged:-$(ls "$OUT"/peers-*-peers-32layers.json 2>/dev/null | head -n 1)}
    done
    tar czf "$OUT/peer-logs.tgz" /tmp/peers-logs-* 2>/dev/null
fi
if [ "$part" = rss32 ]; then
    # Host RSS at 7B with the activations on the device (host_activation_budget=0) against issue 17's
    # 14 B/param x N + 6 GiB = 93.9 GiB; the run with them streamed to the host peaked at 118.2 GiB.
    DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-230} ))
    PEERS_MEGATRAIN_OPTIONS='{"host_activation_budget": 0}' \
    step rss_32_layers_device_activations 210 "$PY" benchmarks/peers.py --seq 4096 --batch 8 --budget 60GiB \
        --hardware benchmarks/results/calibrate-2026-11-22-nvidia-h100-80gb-hbm3.json --out-dir "$OUT" --layers 32 \
        --steps 3 --systems megatrain --timeout 190 --tag megatrain-32layers-device-activations
fi
if [ "$part" = next ] || [ "$part" = issue19 ] || [ "$part" = max_tokens ] || [ "$part" = peers_7b ] \
        || [ "$part" = rss32 ]; then :
elif [ "$part" = peers ]; then
    # megatrain's own row comes from "next" on the same machine (its compile alone took 99 s).
    step peers_others 590 "$PY" benchmarks/peers.py --layers 8 --seq 4096 --batch 8 --steps 5 --budget 60GiB \
        --systems fsdp2_cpu_offload,deepspeed_zero3_offload,megatrain_reference,resident_torch_compile \
        --timeout 140 --out-dir "$OUT" --tag peers-8layers
else
    echo "gpu_session.sh: unknown part '$part' (next, issue19, max_tokens, peers_7b, rss32 or peers)" >&2
    exit 2
fi
