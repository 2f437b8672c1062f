#!/usr/bin/env bash
# A test job for comparing runs: a learning-rate sweep in miniature. `--lr X --steps N` reports `loss`
# and `val_acc` at each step, both shaped by the learning rate, so each run draws a different line.
set -euo pipefail
lr=0.1
steps=6
while [ $# -gt 0 ]; do
    case "$1" in
        --lr) lr=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        *) shift ;;
    esac
done
for step in $(seq 1 "$steps"); do
    sleep 0.1
    read -r loss acc < <(awk -v s="$step" -v lr="$lr" 'BEGIN { l = 2.3 * exp(-lr * 4 * s) + 0.1;
                                                               printf "%.4f %.4f\n", l, 1 - l / 2.4 }')
    echo "TRAINYARD_METRIC {\"name\": \"loss\", \"value\": ${loss}, \"step\": ${step}}"
    echo "TRAINYARD_METRIC {\"name\": \"val_acc\", \"value\": ${acc}, \"step\": ${step}}"
done
echo "done: lr ${lr}, ${steps} steps, final loss ${loss}"
