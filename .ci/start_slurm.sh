#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for the SLURM tests (tests/e2e/test_slurm*.py).
#
#   bash .ci/start_slurm.sh [start]   # install if missing, configure, start, wait until both nodes are idle
#   bash .ci/start_slurm.sh stop      # cancel its jobs, stop the daemons started here (pid files)
#   bash .ci/start_slurm.sh status    # exit 0 when the cluster is up and both nodes respond
#   bash .ci/start_slurm.sh install   # only install slurm-wlm and munge if they are missing
#
# Clients then need: export SLURM_CONF=$SLMOE_SLURM_DIR/slurm.conf (printed on the last line).
#
# How two nodes live on one host: Debian's slurm-wlm 22.05 is built without
# --enable-multiple-slurmd, so two NodeName entries may not share a NodeHostname ("Duplicated
# NodeHostName"). Each node therefore gets its own NodeHostname (n1, n2) but the same NodeAddr
# (127.0.0.1) and its own slurmd Port; each slurmd is started with -N <name>, which tells it which
# entry it is (so neither needs to resolve its NodeHostname), and the per-node paths (spool
# directory, pid and log files) use %n so the two never share a file. Everything, munge
# included (a private munged with its own key and socket), lives under SLMOE_SLURM_DIR and runs
# as root; nothing in /etc is touched and nothing listens beyond 127.0.0.1's ports below.
#
# Environment: SLMOE_SLURM_DIR (default /tmp/slmoe-slurm), SLMOE_SLURM_PORT (slurmctld port,
# default 16817; the two slurmd listen on the next two ports), SLMOE_SLURM_WAIT (seconds to wait
# for idle nodes, default 60).
set -euo pipefail

dir=${SLMOE_SLURM_DIR:-/tmp/slmoe-slurm}
ctld_port=${SLMOE_SLURM_PORT:-16817}
wait_s=${SLMOE_SLURM_WAIT:-60}
nodes=(n1 n2)
conf=$dir/slurm.conf
export SLURM_CONF=$conf

say() { echo "[start_slurm] $*" >&2; }
die() { echo "[start_slurm] error: $*" >&2; exit 1; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    local missing=()
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    for bin in slurmctld slurmd sbatch; do
        command -v "$bin" >/dev/null 2>&1 || { missing+=(slurm-wlm); break; }
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" = 0 ] || die "slurm-wlm/munge are not installed and installing them needs root"
    command -v apt-get >/dev/null 2>&1 || die "slurm-wlm/munge are not installed and there is no apt-get"
    say "installing ${missing[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
        || die "apt-get install ${missing[*]} failed"
}

write_config() {
    mkdir -p "$dir/state" "$dir/munge" "$dir/log"
    for n in "${nodes[@]}"; do mkdir -p "$dir/spool/$n"; done
    chmod 700 "$dir/munge"
    if [ ! -s "$dir/munge/munge.key" ]; then
        head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    fi
    chmod 400 "$dir/munge/munge.key"
    local cpus=1
    cat > "$conf" <<CONF
# Written by .ci/start_slurm.sh: two nodes (n1, n2) on this one machine.
ClusterName=slmoe-ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=20
NodeName=n1 NodeHostname=n1 NodeAddr=127.0.0.1 Port=$((ctld_port + 1)) CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=127.0.0.1 Port=$((ctld_port + 2)) CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=ci Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
    for n in "${nodes[@]}"; do
        grep -qE "^$n (idle|mix|alloc)\$" <<<"$states" || return 1
    done
}

start() {
    if [ "$(id -u)" != 0 ]; then die "needs root (daemons run as root here)"; fi
    install_packages
    if pid_alive "$dir/munged.pid" && pid_alive "$dir/slurmctld.pid" \
        && pid_alive "$dir/slurmd-n1.pid" && pid_alive "$dir/slurmd-n2.pid" && nodes_idle; then
        say "already running"
        echo "SLURM_CONF=$conf"
        return 0
    fi
    stop quiet
    write_config
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" || die "munged did not start (see $dir/log/munged.log)"
    slurmctld -f "$conf" -i || die "slurmctld did not start (see $dir/log/slurmctld.log)"
    for n in "${nodes[@]}"; do
        slurmd -f "$conf" -N "$n" || die "slurmd -N $n did not start (see $dir/log/slurmd-$n.log)"
    done
    local deadline=$((SECONDS + wait_s))
    until nodes_idle; do
        if [ $SECONDS -ge $deadline ]; then
            sinfo -N >&2 || true
            die "nodes not idle after ${wait_s}s (logs in $dir/log)"
        fi
        sleep 1
    done
    say "two nodes idle: $(sinfo -h -N -o '%N=%t' | sort -u | tr '\n' ' ')"
    echo "SLURM_CONF=$conf"
}

stop_pid() {  # stop_pid FILE: TERM, then KILL after 10 s, the daemon named in FILE
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

stop() {
    if pid_alive "$dir/slurmctld.pid" && [ -f "$conf" ]; then
        # Jobs outlive slurmd (slurmstepd is its own process): cancel them and let them end.
        squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null || true
        for _ in $(seq 30); do
            [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    for n in "${nodes[@]}"; do stop_pid "$dir/slurmd-$n.pid"; done
    stop_pid "$dir/slurmctld.pid"
    stop_pid "$dir/munged.pid"
    [ "${1:-}" = quiet ] || say "stopped (state kept in $dir)"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    status) pid_alive "$dir/slurmctld.pid" && nodes_idle ;;
    install) install_packages ;;
    *) die "usage: $0 [start|stop|status|install]" ;;
esac
