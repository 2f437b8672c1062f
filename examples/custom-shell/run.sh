#!/usr/bin/env bash
# A `custom` framework job: no Python framework at all, just a shell script. It "trains" for 10 steps
# (~5 s), computing a decaying loss with awk, reports each step as a TRAINYARD_METRIC line, and writes
# its result into $RESULT_DIR. On SIGTERM (halt) it stops at the next step and exits 0.
set -euo pipefail

steps=${STEPS:-10}
result_dir=${RESULT_DIR:-./results}
stopping=0
trap 'stopping=1' TERM

echo "custom job ${TRAINYARD_JOB_ID:-bare} attempt ${TRAINYARD_ATTEMPT:-1}: ${steps} steps"
loss=0
for step in $(seq 1 "$steps"); do
    sleep 0.5
    loss=$(awk -v s="$step" 'BEGIN { printf "%.4f", 2.5 * exp(-0.35 * s) + 0.05 * sin(s) ^ 2 }')
    echo "step ${step}/${steps} loss ${loss}"
    echo "TRAINYARD_METRIC {\"name\": \"loss\", \"value\": ${loss}, \"step\": ${step}}"
    if [ "$stopping" = 1 ]; then
        echo "stop requested after step ${step}; exiting"
        exit 0
    fi
done

mkdir -p "$result_dir"
printf '{"steps": %d, "final_loss": %s}\n' "$steps" "$loss" > "$result_dir/result.json"
echo "done: final loss ${loss}; wrote $result_dir/result.json"
