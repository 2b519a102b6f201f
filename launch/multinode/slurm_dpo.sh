#!/usr/bin/env bash
# SLURM, 2 nodes x 8 GPUs, DeepSpeed's own launcher (no home-made rendezvous): the first node builds a hostfile
# from the allocation and starts all ranks with `deepspeed --hostfile`.
#   sbatch launch/multinode/slurm_dpo.sh recipes/nemotron12b/dpo_12k.yaml
#SBATCH --job-name=dpo-zero3
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
RECIPE=${1:?usage: sbatch launch/multinode/slurm_dpo.sh <recipe.yaml> [--key value ...]}
shift
HOSTFILE=$(mktemp)
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/$/ slots=8/' > "$HOSTFILE"
MASTER=$(head -n1 "$HOSTFILE" | cut -d' ' -f1)
deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER" --master_port 29500 \
    launch/train_dpo.py ds_configs/zero3.json --recipe "$RECIPE" \
    --data.global_batch_size $((SLURM_JOB_NUM_NODES * 8)) "$@"
