#!/usr/bin/env bash
# A job that fails on purpose: some output on both streams, then exit code 3 (the FAILED path).
echo "starting a job that is meant to fail"
echo "loading configuration"
echo "warning: configuration file missing, continuing anyway" >&2
sleep 0.5
echo "step 1 of 3"
echo "error: cannot open training data at ${DATA_DIR:-./data}/missing.csv" >&2
exit 3
