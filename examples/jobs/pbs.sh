#!/bin/bash
# A 2-node hybrid run under PBS / Torque: 2 nodes × 4 ranks = 2 pipeline stages × 4 replicas.
# Submit with:  qsub examples/jobs/pbs.sh
# PBS lists one line per slot in $PBS_NODEFILE; hybridpipe-run hands it to mpirun as the hostfile
# (ranks fill each node's slots in order, so each pipeline stays on one node).
# HYBRIDPIPE_DRY_RUN=1 prints the command instead of running it.
#PBS -N hybridpipe-lm
#PBS -l select=2:ncpus=4:mpiprocs=4
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

#   module load openmpi/5.0
#   source ~/venvs/hybridpipe/bin/activate
export OMP_NUM_THREADS=1
NP=$(wc -l < "${PBS_NODEFILE:?PBS_NODEFILE is not set: submit with qsub}")

hybridpipe-run -np "$NP" --stages 2 --hostfile "$PBS_NODEFILE" \
    ${HYBRIDPIPE_DRY_RUN:+--dry-run} \
    python -m hybridpipe examples/train_lm.py --steps 2000 --save lm.pt
