# Sourced by scripts/pretrain_lora.sh: small helpers of the launcher (no Python here).

slmoe_die() {  # one line on stderr, exit 2 (a setting is wrong; nothing was started)
    echo "error: $*" >&2
    exit 2
}

# slmoe_opt ARRAY --flag VALUE: append "--flag VALUE" to ARRAY when VALUE is not empty.
slmoe_opt() {
    local -n _slmoe_arr=$1
    if [ -n "${3:-}" ]; then _slmoe_arr+=("$2" "$3"); fi
}

# slmoe_opt_words ARRAY --flag "V1 V2": append "--flag V1 V2" (a flag taking several values).
slmoe_opt_words() {
    local -n _slmoe_arr=$1
    local words
    if [ -n "${3:-}" ]; then read -r -a words <<<"$3"; _slmoe_arr+=("$2" "${words[@]}"); fi
}

# slmoe_switch ARRAY --flag VALUE: append "--flag" when VALUE is 1/true/yes.
slmoe_switch() {
    local -n _slmoe_arr=$1
    case "${3:-}" in 1|true|yes) _slmoe_arr+=("$2") ;; esac
}

slmoe_require_int() {  # slmoe_require_int NAME VALUE MIN
    [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] || slmoe_die "$1=$2 must be an integer >= $3"
}

slmoe_count_list() {  # "0,1,3" -> 3
    local IFS=,
    local items
    read -r -a items <<<"$1"
    echo "${#items[@]}"
}

# Processes per node: the visible GPUs, else the visible NPUs, else 2 (CPU).
slmoe_detect_nproc() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
            n=$(slmoe_count_list "$CUDA_VISIBLE_DEVICES")
        else
            n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        fi
    fi
    if [ "$n" -eq 0 ] && [ -n "${ASCEND_RT_VISIBLE_DEVICES:-}" ]; then
        n=$(slmoe_count_list "$ASCEND_RT_VISIBLE_DEVICES")
    fi
    if [ "$n" -eq 0 ] && command -v npu-smi >/dev/null 2>&1; then
        n=$(npu-smi info -l 2>/dev/null | awk -F: '/Total Count/ {gsub(/ /, "", $2); print $2; exit}')
        n=${n:-0}
    fi
    [ "$n" -gt 0 ] 2>/dev/null || n=2
    echo "$n"
}

# slmoe_last_value --flag ARGS...: the value of the last "--flag V" / "--flag=V" in ARGS.
slmoe_last_value() {
    local flag=$1 value="" prev=""
    shift
    for arg in "$@"; do
        if [ "$prev" = "$flag" ]; then value=$arg; fi
        case "$arg" in "$flag"=*) value=${arg#*=} ;; esac
        prev=$arg
    done
    echo "$value"
}

# slmoe_run_logged LOG COMMAND...: run COMMAND with its output on the terminal and appended to
# LOG; return its exit code. SIGTERM/SIGINT/SIGHUP to the launcher stop it (torchrun passes them to
# its workers); a watchdog stops it if the launcher itself is killed (SIGKILL cannot be trapped).
# With SLMOE_END_REPORT set, the terminal stops showing the output once a rank has written the
# job's end there (the job ends on a failure that would repeat: the launcher prints its one line;
# the tracebacks of torchrun and of the ranks it stops go to LOG only).
SLMOE_CHILD=
slmoe_run_logged() {
    local log=$1 rc=0 watchdog
    shift
    "$@" > >(slmoe_tee_until_report "$log" "${SLMOE_END_REPORT:-}") 2>&1 &
    SLMOE_CHILD=$!
    trap 'slmoe_stop_child TERM' TERM HUP
    trap 'slmoe_stop_child INT' INT
    ( while kill -0 $$ 2>/dev/null; do sleep 1; done; kill -TERM "$SLMOE_CHILD" 2>/dev/null ) &
    watchdog=$!
    wait "$SLMOE_CHILD" || rc=$?
    kill "$watchdog" 2>/dev/null || true
    trap - TERM HUP INT
    SLMOE_CHILD=
    return "$rc"
}

slmoe_tee_until_report() {  # slmoe_tee_until_report LOG REPORT: stdin to LOG, and to the
    local log=$1 report=$2 line  # terminal until REPORT is not empty
    if [ -z "$report" ]; then exec tee -a "$log"; fi
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%s\n' "$line" >>"$log"
        [ -s "$report" ] || printf '%s\n' "$line"
    done
}

slmoe_stop_child() {  # the trap: stop the running command, wait for it, exit like it
    local signal=$1 rc=0
    echo "[launch] $(date '+%F %T') got SIG$signal: stopping torchrun and its workers" >&2
    if [ -n "$SLMOE_CHILD" ]; then
        kill -TERM "$SLMOE_CHILD" 2>/dev/null || true
        wait "$SLMOE_CHILD" || rc=$?
    fi
    exit $(( rc ? rc : 143 ))
}

# The environment that decides where and how ranks run, one NAME=value per line; values of
# variables that look like credentials are not shown.
slmoe_print_env() {
    local name
    local names=(NNODES NODE_RANK NPROC_PER_NODE MASTER_ADDR MASTER_PORT)
    if [ -n "${RDZV_ENDPOINT:-}" ]; then names+=(RDZV_BACKEND RDZV_ENDPOINT RDZV_ID RDZV_CONF); fi
    names+=(LOCAL_ADDR MAX_RESTARTS NETWORK_PROFILE DISTRIBUTED_TIMEOUT_MINUTES)
    # Where object storage is (never the credentials: those are not printed)
    names+=(AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3 AWS_REGION AWS_DEFAULT_REGION AWS_PROFILE MSC_CONFIG)
    for name in "${names[@]}"; do
        if [ -n "${!name:-}" ]; then printf '%s=%q\n' "$name" "${!name}"; fi
    done
    { env | LC_ALL=C sort | grep -E '^(NCCL_|HCCL_|GLOO_|TP_SOCKET_IFNAME=|CUDA_VISIBLE_DEVICES=|ASCEND_|SLMOE_|OMP_NUM_THREADS=|TORCH_NCCL_|TORCH_DISTRIBUTED_|TORCH_DISABLE_SHARE_RDZV_TCP_STORE=)' || true; } \
        | while IFS='=' read -r name value; do
            if slmoe_is_secret "$name"; then echo "$name=<hidden>"; continue; fi
            printf '%s=%q\n' "$name" "$value"
        done
}

slmoe_is_secret() {  # a variable name that suggests a credential
    [[ "${1^^}" =~ (SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|API_KEY) ]]
}

slmoe_print_cmd() {  # a command, shell-quoted on one line
    local out="" arg
    for arg in "$@"; do out+="$(printf '%q' "$arg") "; done
    echo "${out% }"
}
