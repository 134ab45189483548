#!/usr/bin/env bash
# The same command on every worker of a Cloud TPU pod slice (one JAX process per host).
#
#   launch/tpu_pod.sh --tpu NAME --zone ZONE [--project P] [--workdir ~/jaxrlhf] [--dry-run] \
#       -- python -m jaxrlhf.train --config=configs/x.py --config.mesh=fsdp=-1 --workdir=/shared/run
#
# Runs `gcloud compute tpus tpu-vm ssh NAME --worker=all --command "..."`: every worker
# cds into --workdir (the repo, already copied/installed on each worker, e.g. with
# `gcloud compute tpus tpu-vm scp --worker=all`) and starts the command with
# JAXRLHF_DISTRIBUTED=auto, so `jaxrlhf.parallel.distributed.initialize()` calls
# `jax.distributed.initialize()`, which finds the coordinator from the TPU metadata.
# Give each worker's output a file with --log (default: stream everything to this terminal).
set -euo pipefail

tpu=""; zone=""; project=""; workdir="~/jaxrlhf"; dry_run=0; log=""
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) tpu="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "error: no command given (… -- python -m jaxrlhf.train --config=…)" >&2; usage 2; }
[[ -n "$tpu" && -n "$zone" ]] || { echo "error: --tpu and --zone are required" >&2; usage 2; }

remote="cd ${workdir} && JAXRLHF_DISTRIBUTED=auto $(printf '%q ' "$@")"
[[ -n "$log" ]] && remote="${remote} > ${log} 2>&1"
cmd=(gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="$remote")
[[ -n "$project" ]] && cmd+=(--project="$project")

if [[ $dry_run == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
