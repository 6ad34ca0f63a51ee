#!/usr/bin/env bash
# The shipped EAGLE-3 head for smollm2-135m-instruct: its training run on one CUDA GPU.
#
#     scripts/train_eagle3_gpu.sh OUT [SECONDS]      # default 420 s of training steps
#
# Needs the model pulled (`outrider models pull smollm2-135m-instruct`; on a machine without
# network, copy its original.gguf into $OUTRIDER_CACHE/models/smollm2-135m-instruct/ first: the
# pull then only converts it) and the toolcall data in the cache. Two phases: the target writes
# every response itself (--regenerate --regenerate-only, greedy, REGEN_BATCH prompts at a time,
# into OUT.responses/), then the head trains on them (--responses) for SECONDS; the step count is
# planned from the first steps and OUT/train_info.json's "reproduce" is the same run with that
# count fixed. Snapshots every 100 steps feed scripts/eagle3_tau_curve.py.
#
# Environment: INIT=HEAD continues a head (--init-from: its weights and draft vocabulary, a new
# optimizer), e.g. INIT=smollm2-135m-instruct to add a GPU run's tokens to the shipped head. DATA
# overrides the sources, CODE_ROOTS (folders, ':'-separated) the code sources' folders
# (--code-root), RESPONSES hands in responses already written (phase 1 is skipped), BY (a Unix
# time) ends training 60 s before it whatever SECONDS says (a lease that ends), TARGET, BATCH,
# LR, REGEN_BATCH, DEVICE (cuda) and PYTHON as named.
set -euo pipefail
out=${1:?usage: $0 OUT [SECONDS]}
budget=${2:-420}
python=${PYTHON:-python3}
data=${DATA:-code,code-prompts,code-completions,toolcall}
roots=()
IFS=: read -ra dirs <<< "${CODE_ROOTS:-}"
for d in "${dirs[@]}"; do [ -n "$d" ] && roots+=(--code-root "$d"); done
common=(--target "${TARGET:-smollm2-135m-instruct}" --data "$data" --regenerate --max-response-tokens 256
        --device "${DEVICE:-cuda}" --target-dtype bfloat16 --precision bf16 --seq-len 1024 "${roots[@]}")
responses=${RESPONSES:-}
if [ -z "$responses" ]; then
    "$python" -m outrider.cli train eagle3 "${common[@]}" --regenerate-only --no-progress --out "$out.responses" \
        ${REGEN_BATCH:+--regenerate-batch "$REGEN_BATCH"}
    responses=$out.responses/regenerated.jsonl
fi
if [ -n "${BY:-}" ]; then
    left=$(( BY - $(date +%s) - 60 ))
    [ "$left" -lt "$budget" ] && budget=$left
    [ "$budget" -lt 30 ] && { echo "no time left to train (BY is in $(( BY - $(date +%s) )) s)" >&2; exit 1; }
fi
exec "$python" -m outrider.cli train eagle3 "${common[@]}" --responses "$responses" \
    --batch-size "${BATCH:-32}" --ttt-steps 7 --draft-vocab 8192 --lr "${LR:-1e-3}" --seed 0 \
    --time-budget "$budget" --checkpoint-every 500 --snapshot-every 100 --no-progress --out "$out" \
    ${INIT:+--init-from "$INIT"}
