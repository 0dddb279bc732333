# Sourced by the GPU call scripts (session 24 on): the environment, OUT and CAP defaults,
# `left N` (the seconds a step may take: N, or what is left of CAP if less) and G, the card's
# short name for result files (h200 / h100 / gpu), read from nvidia-smi.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
CAP=${CAP:-570}
# (never below 1: `timeout 0` would mean no limit at all, a negative one an error)
left() { local l=$((CAP - SECONDS)); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$DEV" in *H200*) G=h200 ;; *H100*) G=h100 ;; *) G=gpu ;; esac
echo "device: $DEV"
