#!/usr/bin/env bash
# SLURM, 2 nodes x 8 GPUs, DeepSpeed's own launcher (no home-made rendezvous): the first node builds a hostfile
# from the allocation and starts all ranks with `deepspeed --hostfile`.
#   sbatch launch/multinode/slurm_dpo.sh recipes/nemotron12b/dpo_12k.yaml [--key value ...]
# Preemption and time limits: SLURM sends SIGUSR1 to this script 15 minutes before the end (--signal; leave room for
# one step and one checkpoint save), the script passes it to every training rank, they save a checkpoint at the next
# step and exit with status 75, and the job requeues itself and resumes from that checkpoint
# (--resume_from_checkpoint auto: the newest complete checkpoint, or step 0 on the first start).
#SBATCH --job-name=dpo-zero3
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
set -uo pipefail
RECIPE=${1:?usage: sbatch launch/multinode/slurm_dpo.sh <recipe.yaml> [--key value ...]}
shift
OUTPUT_DIR=${OUTPUT_DIR:-outputs/${SLURM_JOB_NAME}_${SLURM_JOB_ID}}
HOSTFILE=$(mktemp)
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/$/ slots=8/' > "$HOSTFILE"
MASTER=$(head -n1 "$HOSTFILE" | cut -d' ' -f1)

# The ranks (and only they: a launcher killed by the signal would take its ranks down) get SIGUSR1 on every node.
forward_usr1() {
    echo "SIGUSR1 from SLURM: asking every rank to save and stop"
    srun --overlap --ntasks-per-node=1 pkill -USR1 -f 'train_dpo.py --local_rank' || true
}
trap forward_usr1 USR1

deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER" --master_port 29500 \
    launch/train_dpo.py ds_configs/zero3.json --recipe "$RECIPE" --output_dir "$OUTPUT_DIR" \
    --data.global_batch_size $((SLURM_JOB_NUM_NODES * 8)) --resume_from_checkpoint auto "$@" &
LAUNCHER=$!
wait $LAUNCHER; rc=$?
while kill -0 $LAUNCHER 2>/dev/null; do wait $LAUNCHER; rc=$?; done  # `wait` returns early when the trap runs
if [ -f "$OUTPUT_DIR/preempted.json" ] || [ "$rc" -eq 75 ]; then
    echo "saved at $(cat "$OUTPUT_DIR/preempted.json" 2>/dev/null); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
