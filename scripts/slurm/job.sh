# Sourced by the batch files in this folder (pretrain_lora_{gpu,npu,cpu}.sbatch), on the job's
# first node: one launcher per node through srun, requeue on USR1, automatic resume.
#
# From SLURM:  NNODES=$SLURM_NNODES, NODE_RANK=$SLURM_NODEID (per node, inside srun),
#              MASTER_ADDR = the first host of the allocation (its NodeAddr when the name does
#              not resolve), MASTER_PORT = 20000 + job id % 20000 (or SLMOE_MASTER_PORT).
# Resume:      OUTPUT_DIR defaults to runs/<job name>: a requeued job (same name) finds its
#              checkpoints there and the entry point resumes from the newest by itself.
# Cache:       SLMOE_CACHE_DIR (default /tmp/slmoe-cache-$USER) is the node-local object cache.
# Requeue:     the batch files ask for --requeue and --signal=B:USR1@<secs>; on USR1 (the time
#              limit is near, or `scancel --batch --signal=USR1 <job>`) this requeues the job
#              with `scontrol requeue`; SLURM stops the running step and starts the job again.
# The repository: SLMOE_REPO, else the directory sbatch was called from (submit from the root).

slmoe_slurm_die() { echo "[slurm] error: $*" >&2; exit 2; }

SLMOE_REPO=${SLMOE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
[ -f "$SLMOE_REPO/scripts/pretrain_lora.sh" ] \
    || slmoe_slurm_die "no scripts/pretrain_lora.sh under $SLMOE_REPO: submit from the repository root or set SLMOE_REPO"
cd "$SLMOE_REPO"
[ -n "${SLURM_JOB_ID:-}" ] || slmoe_slurm_die "not inside a SLURM job (submit with sbatch)"

export NNODES=$SLURM_NNODES
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_ADDR=$first_node
if ! getent hosts "$MASTER_ADDR" >/dev/null 2>&1; then
    # Node names that are not host names (e.g. several slurmd on one host): SLURM's own address.
    MASTER_ADDR=$(scontrol show node "$first_node" | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2)
    [ -n "$MASTER_ADDR" ] || slmoe_slurm_die "cannot resolve the first node $first_node"
fi
export MASTER_ADDR
export MASTER_PORT=${SLMOE_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OUTPUT_DIR=${OUTPUT_DIR:-runs/$SLURM_JOB_NAME}
# Node-local cache of s3:// and msc:// data (megatron_slmoe/storage): one copy per node, shared by
# its ranks and kept across requeues. Point it at the nodes' local NVMe (e.g. /raid, /local/nvme);
# it must not be a shared file system. The same path is used on every node.
export SLMOE_CACHE_DIR=${SLMOE_CACHE_DIR:-/tmp/slmoe-cache-${USER:-$(id -un)}}
# srun of SLURM >= 22.11 no longer inherits --cpus-per-task from sbatch
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi

slmoe_slurm_requeue() {
    echo "[slurm] $(date '+%F %T') USR1: requeueing job $SLURM_JOB_ID; it resumes from $OUTPUT_DIR/checkpoints"
    scontrol requeue "$SLURM_JOB_ID"
}

# slmoe_slurm_run [flags...]: the launcher on every node (one task each), flags passed through.
slmoe_slurm_run() {
    echo "[slurm] $(date '+%F %T') job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST:" \
         "$NNODES nodes, master $MASTER_ADDR:$MASTER_PORT, output $OUTPUT_DIR"
    trap slmoe_slurm_requeue USR1
    # Backgrounded + wait: bash runs a trap only between commands, and `wait` is one it leaves.
    srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        bash -c 'export NODE_RANK=$SLURM_NODEID; exec bash scripts/pretrain_lora.sh "$@"' node "$@" &
    local step=$! rc=0
    while :; do
        wait "$step" && rc=0 || rc=$?
        kill -0 "$step" 2>/dev/null || break  # still running: the wait was cut short by the trap
    done
    echo "[slurm] $(date '+%F %T') step finished with exit code $rc"
    return "$rc"
}
