# Sourced by the GPU call scripts (session 30 on): ncu_run, Nsight Compute on a command with
# XLA's command buffers off (with them the process segfaults under ncu, session 30), in its
# own process group under a hard kill (sessions 29 and 30 ran it in a pipeline under
# `timeout`, which killed ncu alone: the orphaned target held the pipe until the call's
# limit). Needs OUT, G and left() from gpu_call_setup.sh; NCU_TAG names the session;
# NCU_EXTRA adds ncu options (e.g. --profile-from-start off); the command's own XLA_FLAGS
# are kept.
NCU=/usr/local/cuda/bin/ncu
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
ncu_run() {  # ncu_run NAME SECONDS KERNEL_REGEX SKIP COUNT CMD...: report, raw CSV, summary
  local name=$1 lim=$(left $2) re=$3 skip=$4 count=$5; shift 5
  local R=$OUT/ncu_${name}${NCU_TAG:-}_$G log=$OUT/ncu_${name}_log.txt
  [ $lim -gt 0 ] || { echo "ncu_run $name: no time left"; return; }
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    setsid $NCU --target-processes application-only --clock-control none \
    --kernel-name regex:"$re" --launch-skip $skip --launch-count $count $SECTIONS \
    ${NCU_EXTRA:-} -f -o $R "$@" > $log 2>&1 &
  local P=$!
  # the watchdog: its sleep is killed with it and it holds no pipe of the caller's
  ( sleep $lim & s=$!; trap "kill $s 2>/dev/null; exit" TERM; wait $s
    kill -9 -- -$P 2>/dev/null && echo "KILLED at $lim s" >> $log ) > /dev/null 2>&1 &
  local K=$!; wait $P; kill $K 2>/dev/null
  grep -E "==ERROR==|KILLED|rror" $log | head -5
  local t=$(left 40)
  if [ -f $R.ncu-rep ] && [ $t -gt 0 ]; then
    timeout -s KILL $t $NCU --import $R.ncu-rep --csv --page raw > ${R}_raw.csv 2>&1
    python3 -m benchmarks.ncu_summary ${R}_raw.csv
    rm -f $R.ncu-rep  # (8 files come back: the CSV holds what the summary reads)
  fi
}
