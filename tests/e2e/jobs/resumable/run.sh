#!/usr/bin/env bash
# A test job that resumes: it counts to $1 steps, writes its step to a checkpoint after each one
# (to a temporary name, then renamed, so a cut-short write is never "last good"), stops cleanly on
# SIGTERM, and starts from the checkpoint's step when RESUME_FROM is set.
set -euo pipefail
steps=${1:-20}
step=0
if [ -n "${RESUME_FROM:-}" ]; then
    step=$(cat "$RESUME_FROM")
    echo "resuming from step ${step} ($(basename "$RESUME_FROM"))"
fi
stopping=0
trap 'stopping=1' TERM
while [ "$step" -lt "$steps" ]; do
    sleep 0.3 || true  # a halt signals the whole group: sleep dies, the step still gets its checkpoint
    step=$((step + 1))
    echo "step ${step}/${steps} on GPU ${CUDA_VISIBLE_DEVICES:-none}"
    echo "$step" > "$CHECKPOINT_DIR/.step.tmp" && mv "$CHECKPOINT_DIR/.step.tmp" "$CHECKPOINT_DIR/step-$(printf %04d "$step").txt"
    if [ "$stopping" = 1 ]; then
        echo "checkpointed at step ${step}; stopping"
        exit 0
    fi
done
echo "finished ${steps} steps"
