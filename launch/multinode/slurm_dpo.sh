#!/usr/bin/env bash
# SLURM, N nodes x 8 GPUs, DeepSpeed's own launcher started on every node by srun (no ssh between the nodes):
#   sbatch --nodes 2 launch/multinode/slurm_dpo.sh recipes/nemotron12b/dpo_12k.yaml [--key value ...]
# Preemption and time limits: SLURM sends SIGUSR1 to this script 15 minutes before the end (--signal; leave room for
# one step and one checkpoint save), the script passes it to every training rank, they save a checkpoint at the next
# step and exit with status 75, and the job requeues itself and resumes from that checkpoint
# (--resume_from_checkpoint auto: the newest complete checkpoint, or step 0 on the first start), on whatever nodes it
# gets next: another number of ranks re-partitions the optimizer state and keeps the checkpoint's global batch.
# GPUS_PER_NODE (8), MASTER_PORT (29500) and MASTER_ADDR (the first node) may be set in the environment.
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
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/${SLURM_JOB_NAME}_${SLURM_JOB_ID}}
HOSTFILE=${OUTPUT_DIR}.hostfile  # on the shared filesystem: every node's launcher reads it
mkdir -p "$(dirname "$OUTPUT_DIR")"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$GPUS_PER_NODE/" > "$HOSTFILE"
MASTER_ADDR=${MASTER_ADDR:-$(head -n1 "$HOSTFILE" | cut -d' ' -f1)}
# One pair per GPU on the first start; a requeue resumes with the checkpoint's global batch, whatever its nodes.
BATCH=(--data.global_batch_size $((SLURM_JOB_NUM_NODES * GPUS_PER_NODE)))
ls "$OUTPUT_DIR"/checkpoint-*/checkpoint_complete.json > /dev/null 2>&1 && BATCH=()

# The ranks (and only they: a launcher killed by the signal would take its ranks down) get SIGUSR1 on every node.
forward_usr1() {
    echo "SIGUSR1 from SLURM: asking every rank to save and stop"
    srun --overlap --ntasks-per-node=1 pkill -USR1 -f 'train_dpo.py --local_rank' || true
}
trap forward_usr1 USR1

# One launcher per node, each told its node's rank (srun sets SLURM_NODEID in each task)
srun --ntasks-per-node=1 bash -c 'exec deepspeed --hostfile "$0" --no_ssh --node_rank "$SLURM_NODEID" \
    --master_addr "$1" --master_port "$2" launch/train_dpo.py ds_configs/zero3.json "${@:3}"' \
    "$HOSTFILE" "$MASTER_ADDR" "${MASTER_PORT:-29500}" --recipe "$RECIPE" --output_dir "$OUTPUT_DIR" \
    "${BATCH[@]}" --resume_from_checkpoint auto "$@" &
LAUNCHER=$!
wait $LAUNCHER; rc=$?
while kill -0 $LAUNCHER 2>/dev/null; do wait $LAUNCHER; rc=$?; done  # `wait` returns early when the trap runs
if [ -f "$OUTPUT_DIR/preempted.json" ] || [ "$rc" -eq 75 ]; then
    echo "saved at $(cat "$OUTPUT_DIR/preempted.json" 2>/dev/null); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
