#!/usr/bin/env bash
# N processes of the same command on this machine, each with D CPU devices, joined by
# jax.distributed on 127.0.0.1 with gloo collectives: a multi-host run without a cluster.
#
#   launch/local_multiprocess.sh [-n 2] [-d 4] [--dry-run] -- python -m jaxrlhf.train --config=configs/x.py \
#       --config.mesh=fsdp=2,tensor=2 --workdir=/tmp/run     # one mesh over the n × d devices
#
# Each process gets JAXRLHF_COORDINATOR_ADDRESS / JAXRLHF_NUM_PROCESSES / JAXRLHF_PROCESS_ID,
# which `jaxrlhf.parallel.distributed.initialize()` reads. Logs: $LOG_DIR/process_<i>.log
# (default ./workdirs/local_multiprocess); process 0 also prints to the terminal. If one
# process fails, the others are stopped.
set -euo pipefail

nproc=2
devices=4
dry_run=0
log_dir="${LOG_DIR:-workdirs/local_multiprocess}"
port="${PORT:-}"
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--num-processes) nproc="$2"; shift 2 ;;
    -d|--devices-per-process) devices="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "error: no command given (… -- python -m jaxrlhf.train --config=…)" >&2; usage 2; }
if [[ -z "$port" ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

env_for() {  # the environment of process $1
  echo "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=${devices}" \
       "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo JAXRLHF_COORDINATOR_ADDRESS=127.0.0.1:${port}" \
       "JAXRLHF_NUM_PROCESSES=${nproc} JAXRLHF_PROCESS_ID=$1"
}

if [[ $dry_run == 1 ]]; then
  for ((i = 0; i < nproc; i++)); do
    echo "$(env_for "$i") $(printf '%q ' "$@")> ${log_dir}/process_${i}.log 2>&1 &"
  done
  echo "wait"
  exit 0
fi

mkdir -p "$log_dir"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
for ((i = 0; i < nproc; i++)); do
  # shellcheck disable=SC2046
  env $(env_for "$i") "$@" > "${log_dir}/process_${i}.log" 2>&1 &
  pids+=($!)
done
tail -n +1 -f "${log_dir}/process_0.log" --pid="${pids[0]}" &
tail_pid=$!
status=0
for ((i = 0; i < nproc; i++)); do
  if ! wait "${pids[$i]}"; then
    status=1
    echo "process $i failed; see ${log_dir}/process_${i}.log" >&2
    cleanup
  fi
done
wait "$tail_pid" 2>/dev/null || true
trap - EXIT
exit $status
