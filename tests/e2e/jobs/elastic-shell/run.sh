#!/usr/bin/env bash
# A test elastic job without a framework: each step "trains" one global batch
# ($TRAINYARD_GLOBAL_BATCH_SIZE samples over $WORLD_SIZE learners); rank 0 reports the job's
# cumulative samples and checkpoints that count after every step (a temporary name, then renamed),
# every learner stops cleanly on SIGTERM (a halt or a resize), and a new attempt goes on from
# RESUME_FROM's count, so progress continues across resizes.
set -euo pipefail
steps=${1:-100000}
batch=${TRAINYARD_GLOBAL_BATCH_SIZE:-64}
samples=0
if [ -n "${RESUME_FROM:-}" ]; then
    samples=$(cat "$RESUME_FROM")
fi
echo "rank ${RANK:-0} of ${WORLD_SIZE:-1}: batch ${batch}, from ${samples} samples"
stopping=0
trap 'stopping=1' TERM
step=0
while [ "$step" -lt "$steps" ]; do
    sleep 0.25 || true  # a signal to the group ends sleep early; the step still completes
    step=$((step + 1))
    samples=$((samples + batch))
    if [ "${RANK:-0}" = 0 ]; then
        echo "TRAINYARD_METRIC {\"name\": \"samples\", \"value\": ${samples}, \"step\": ${step}}"
        echo "$samples" > "$CHECKPOINT_DIR/.samples.tmp" && mv "$CHECKPOINT_DIR/.samples.tmp" "$CHECKPOINT_DIR/samples.txt"
    fi
    if [ "$stopping" = 1 ]; then
        echo "checkpointed at ${samples} samples; stopping"
        exit 0
    fi
done
