#!/usr/bin/env bash
# A DFlash head for smollm2-135m-instruct on one CUDA GPU: the GPU recipe of the shipped CPU head.
#
#     scripts/train_dflash_gpu.sh OUT [TOKENS]      # default 19738311: the shipped EAGLE-3 head's tokens
#
# Not run yet (the head shipped in outrider/heads/shipped/dflash/ was trained on a CPU; its
# train_info.json says how). Needs the model pulled (`outrider models pull smollm2-135m-instruct`;
# without network, copy its original.gguf into $OUTRIDER_CACHE/models/smollm2-135m-instruct/ first)
# and the toolcall data in the cache. Two phases, as scripts/train_eagle3_gpu.sh: the target writes
# every response itself (--regenerate --regenerate-only, into OUT.responses/; RESPONSES=FILE skips
# this, e.g. the EAGLE-3 run's regenerated.jsonl: same target, same data), then the head trains on
# them for TOKENS training tokens (32 x 1024 a step: 603 steps), and is exported in z-lab's layout
# (bf16, OUT.zlab/, with its golden tau) for `outrider check-head OUT.zlab`.
#
# The head: LAYERS (3) draft layers reading DFlash's default taps (1, 14, 27 for 3 layers), block
# BLOCK (16, DFlash's), ANCHORS (128) random blocks per sequence (SpecForge uses 512 on bigger
# GPUs), loss weights exp(-(k-1)/7), lr LR (6e-4, SpecForge's DFlash recipe), the target's own
# vocabulary and lm_head (so z-lab's DFlash, vLLM and SGLang all load it; 3 layers in bf16 are
# 23 MB). Environment: DATA, TARGET, BATCH, LAYERS, BLOCK, ANCHORS, LR, REGEN_BATCH, DEVICE (cuda)
# and PYTHON as named.
set -euo pipefail
out=${1:?usage: $0 OUT [TOKENS]}
tokens=${2:-19738311}
python=${PYTHON:-python3}
common=(--target "${TARGET:-smollm2-135m-instruct}" --data "${DATA:-code,code-prompts,code-completions,toolcall}"
        --regenerate --max-response-tokens 256 --device "${DEVICE:-cuda}" --target-dtype bfloat16 --precision bf16
        --seq-len 1024)
responses=${RESPONSES:-}
if [ -z "$responses" ]; then
    "$python" -m outrider.cli train dflash "${common[@]}" --regenerate-only --no-progress --out "$out.responses" \
        ${REGEN_BATCH:+--regenerate-batch "$REGEN_BATCH"}
    responses=$out.responses/regenerated.jsonl
fi
"$python" -m outrider.cli train dflash "${common[@]}" --responses "$responses" \
    --batch-size "${BATCH:-32}" --layers "${LAYERS:-3}" --block-size "${BLOCK:-16}" --anchors "${ANCHORS:-128}" \
    --gamma 7 --lr "${LR:-6e-4}" --seed 0 --tokens "$tokens" --warmup-steps 30 --checkpoint-every 200 \
    --no-progress --out "$out"
exec "$python" -m outrider.cli export dflash "$out" --format zlab --dtype bf16 --out "$out.zlab"
