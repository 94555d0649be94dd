#!/usr/bin/env bash
# A real single-node Slurm cluster for the tests (issue 10): Debian's munge, slurmctld,
# slurmd and slurm-client, configured in a folder of its own.
#
#   .ci/slurm.sh start   # install (apt) if missing, write slurm.conf, start the daemons,
#                        # wait until the node is idle; prints `export SLURM_CONF=...`
#   .ci/slurm.sh stop    # stop ONLY the daemons start started (their recorded pids)
#   .ci/slurm.sh env     # print `export SLURM_CONF=...`
#
# Everything lives under $ATTNBENCH_SLURM_DIR (default /tmp/attnbench-slurm): slurm.conf,
# the munge key and socket, state and spool folders, logs, pid files. Clients (sbatch,
# squeue, scontrol, and submitit in the tests) find the cluster through SLURM_CONF.
# Config follows the slurm.conf man page (https://slurm.schedmd.com/slurm.conf.html):
# SlurmUser=root, ProctrackType=proctrack/linuxproc, TaskPlugin=task/none,
# SelectType=select/cons_tres, no accounting storage (squeue, not sacct, tells job states).
set -euo pipefail

DIR=${ATTNBENCH_SLURM_DIR:-/tmp/attnbench-slurm}
CONF=$DIR/slurm.conf

say() { echo "slurm.sh: $*" >&2; }

install_if_missing() {
    local missing=()
    for cmd in munged slurmctld slurmd sbatch; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [ ${#missing[@]} -eq 0 ] && return
    say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    [ "$(id -u)" -eq 0 ] || { say "need root to apt-get install"; exit 1; }
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >&2
}

write_conf() {
    local host node
    host=$(hostname -s)
    # slurmd -C prints this machine's node line (CPUs, sockets, cores, RealMemory in MB).
    node=$(slurmd -C | head -1)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
    chmod 700 "$DIR/munge"
    [ -f "$DIR/munge/munge.key" ] || {
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    }
    cat >"$CONF" <<EOF
ClusterName=attnbench
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ATTNBENCH_SLURMCTLD_PORT:-6817}
SlurmdPort=${ATTNBENCH_SLURMD_PORT:-6818}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
MinJobAge=600
KillWait=5
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install_if_missing
    write_conf
    export SLURM_CONF=$CONF
    if ! alive "$DIR/munged.pid"; then
        munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
            --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" \
            --seed-file="$DIR/munge/munged.seed"
    fi
    # -c: a clean start (no jobs or node states from an earlier cluster in this folder)
    alive "$DIR/slurmctld.pid" || slurmctld -c -f "$CONF"
    alive "$DIR/slurmd.pid" || slurmd -f "$CONF"
    for _ in $(seq 60); do
        state=$(sinfo -h -N -o %T 2>/dev/null | head -1 || true)
        if [ "$state" = idle ]; then
            say "node idle; cluster up (conf $CONF)"
            echo "export SLURM_CONF=$CONF"
            return
        fi
        sleep 0.5
    done
    say "the node did not become idle (state: ${state:-none}); logs in $DIR"
    tail -5 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
    exit 1
}

stop() {
    # Only what start started, by the pids it recorded; slurmd before slurmctld.
    for name in slurmd slurmctld munged; do
        pidfile=$DIR/$name.pid
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            say "stopped $name ($pid)"
        fi
        rm -f "$pidfile"
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
