#!/bin/sh
# What the Slurm test bed (tests/slurmbed.py) needs of the system: slurmctld, slurmd, the client
# commands (srun, sbatch, salloc, squeue, scancel, scontrol, sinfo) and munge. Installed with
# apt-get when one is missing and this is root on a Debian-like machine; otherwise (not root, no
# apt-get, apt-get failing) it says so and exits 0, so that `make test` goes on and the bed's
# promise tests fail naming what is missing.
#
# The bed runs daemons of its own (its own munged, slurm.conf and spool in a private folder):
# none of the distribution's services is wanted. Installing starts none (a policy-rc.d that
# refuses, for as long as apt-get runs, where the machine has none), and every run stops and
# disables any that runs (systemd or init scripts), so a machine set up otherwise is put right.
# Idempotent: with everything installed and nothing running it changes nothing (0.1 s).
set -u

PACKAGES="slurmd slurmctld slurm-client munge"
SERVICES="slurmctld slurmd munge"
NEEDED="slurmd slurmctld srun sbatch salloc squeue scancel scontrol sinfo munged munge"
PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"
export PATH

say() { echo "install-slurm.sh: $*" >&2; }

missing=""
for cmd in $NEEDED; do
    command -v "$cmd" >/dev/null 2>&1 || missing="$missing $cmd"
done

if [ "$(id -u)" != 0 ]; then
    [ -z "$missing" ] || say "not root: not installing $PACKAGES (missing:$missing)"
    exit 0
fi

policy=/usr/sbin/policy-rc.d
made_policy=""
cleanup() { [ -z "$made_policy" ] || rm -f "$policy"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -n "$missing" ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        say "no apt-get here: install $PACKAGES by hand (missing:$missing)"
        exit 0
    fi
    if [ ! -e "$policy" ]; then
        # invoke-rc.d and deb-systemd-invoke ask it before they start a service: 101 = no.
        printf '#!/bin/sh\n# install-slurm.sh: no service starts while apt-get runs\nexit 101\n' \
            >"$policy" && chmod 0755 "$policy" && made_policy=1
    fi
    say "installing $PACKAGES (missing:$missing)"
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            -o DPkg::Lock::Timeout=120 $PACKAGES >/dev/null
    }
    # A stale package list: updated once, and tried again.
    if ! apt_install && ! { apt-get update -q -o DPkg::Lock::Timeout=120 >/dev/null && apt_install; }; then
        say "apt-get could not install $PACKAGES: the Slurm bed's tests will say what is missing"
    fi
    cleanup
    made_policy=""
fi

# No distribution service of them runs, now or after a boot.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    for service in $SERVICES; do
        if [ -n "$(systemctl list-unit-files --no-legend "$service.service" 2>/dev/null)" ]; then
            systemctl disable --now -q "$service.service" 2>/dev/null || true
        fi
    done
fi
for service in $SERVICES; do
    if [ -x "/etc/init.d/$service" ]; then
        "/etc/init.d/$service" stop >/dev/null 2>&1 || true
        if command -v update-rc.d >/dev/null 2>&1; then
            update-rc.d "$service" disable >/dev/null 2>&1 || true
        fi
    fi
done
# Whatever started them, the distribution's daemons write these pid files (the bed's write
# theirs in its own folder): one still alive, and still that daemon (a stale file's pid may be
# another process's by now), is stopped.
for entry in munged:/run/munge/munged.pid slurmctld:/run/slurmctld.pid slurmd:/run/slurmd.pid; do
    name=${entry%%:*}
    pidfile=${entry#*:}
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile" 2>/dev/null || true)
    case "$pid" in '' | *[!0-9]*) continue ;; esac
    [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$name" ] || continue
    say "stopping the distribution's $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    i=0
    while [ -d "/proc/$pid" ] && [ $i -lt 50 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    if [ -d "/proc/$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
done
exit 0
