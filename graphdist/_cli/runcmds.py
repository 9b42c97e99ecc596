"""The ``graphdist`` commands of tf.distribute runs and real hosts: ``run`` (one process per
task), ``warm`` (the warm agent runs fork their tasks from), ``serve`` (one server of a
cluster), ``tf-config`` and ``certs``. Each calls the library and prints."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from graphdist._cli.parser import allow_text, given_backend_options, refuse_unused
from graphdist._cluster import Cluster
from graphdist._distribute.warmagent import IDLE_TIMEOUT_S
from graphdist._exceptions import ArgumentError, CredentialsError, UsageError
from graphdist._validate import MAX_TIMEOUT_S, timeout_s

__all__ = ["cmd_certs", "cmd_run", "cmd_serve", "cmd_tf_config", "cmd_warm"]


def cmd_run(args: argparse.Namespace) -> int:
    from graphdist._distribute.launcher import run_command

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise UsageError("No command to run; put it after `--`, e.g. -- python train.py")
    if not args.max_restarts:
        refuse_unused(
            args, "--max-restarts N", "restart_window_s", "min_uptime_s", "restart_stragglers"
        )
    given = {  # what was given: the library's defaults for the rest
        key: getattr(args, key)
        for key in ("max_restarts", "restart_window_s", "min_uptime_s")
        if getattr(args, key) is not None
    }
    if "preemption_exit_code" in vars(args):  # "none" is given too: None turns it off
        given["preemption_exit_code"] = args.preemption_exit_code
    if "heartbeat_timeout_s" in vars(args):  # "off" is given too: None turns it off
        given["heartbeat_timeout_s"] = args.heartbeat_timeout_s
    run_command(  # it says the run's success itself, as it does to the library's callers
        command,
        workers=args.workers,
        ps=args.ps,
        chief=args.chief,
        timeout_s=args.timeout_s,
        expose=args.expose,
        log_dir=args.log_dir,
        metrics_file=args.metrics_file,
        restart_stragglers=bool(args.restart_stragglers),
        output_format=args.output_format,
        backend=args.backend,
        tls=args.tls,
        **given,
        **given_backend_options(args),
    )
    return 0


def cmd_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from graphdist._proc import lean
    from graphdist._proc.serve import SLURM_PORT_BASE, serve, slurm_task

    lean.install()  # this process only serves: TensorFlow without Keras and SciPy

    for flag, given in (("--slurm", args.slurm), ("--cluster", args.cluster), ("--job", args.job)):
        if given is not None and not given.strip():
            raise UsageError(f"{flag} needs a value, not {given!r}")
    if args.slurm:
        if args.cluster or args.job or args.task is not None:
            raise UsageError("--slurm takes the cluster, job and task from Slurm; drop the others")
        counts = {job: int(n) for job, n in Cluster.parse_counts(args.slurm).items()}
        port_base = SLURM_PORT_BASE if args.port_base is None else args.port_base
        cluster, job, index = slurm_task(counts, port_base=port_base)
    else:
        if args.port_base is not None:
            raise UsageError("--port-base goes with --slurm only; a --cluster names every port")
        if not args.cluster or not args.job or args.task is None:
            raise UsageError("serve needs --cluster, --job and --task (or --slurm)")
        cluster = Cluster.parse_addresses(args.cluster, what="A served cluster")
        job, index = args.job, args.task
    return serve(
        cluster, job, index, bind_all=args.bind_all, argv=argv, allow=allow_text(args), tls=args.tls
    )


def cmd_tf_config(args: argparse.Namespace) -> int:
    from graphdist._distribute.tfconfig import tf_config

    print(tf_config(args.cluster, args.task).to_json())
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from graphdist._distribute.report import write_report

    print(write_report(args.run_dir, args.output))
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from graphdist._net.tlscerts import CLIENT, make_credentials

    cluster = Cluster.parse_addresses(args.cluster, what="A cluster to make credentials for")
    hosts = [task.host.removeprefix("[").removesuffix("]") for task in cluster.tasks]
    try:
        folders = make_credentials(list(dict.fromkeys(hosts)), args.out, days=args.days)
    except CredentialsError as exc:  # --days is the flag's name here, not the argument's
        raise UsageError(str(exc), name=None if exc.path else "days") from None
    for host, folder in folders.items():
        if host == CLIENT:
            print(f"client: {folder}  (for graphdist.connect(cluster, tls=...))")
        else:
            print(f"{host}: {folder}  (copy to {host}; graphdist serve --tls {folder})")
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    from graphdist._distribute.warm import check_preload
    from graphdist._distribute.warmagent import env_mismatch, live_agent, start_agent, stop_agent
    from graphdist._local.run import zygote_env

    preload = check_preload(args.preload)
    if not preload:
        raise UsageError("--preload none: a warm agent imports at least one module; name them")
    if args.idle_timeout_s is not None and args.action != "start":
        raise UsageError(f"--idle-timeout goes with start only, not with {args.action}")
    what = ",".join(preload)
    if args.action == "start":
        idle = IDLE_TIMEOUT_S if args.idle_timeout_s is None else args.idle_timeout_s
        if idle != 0:  # 0: never; else a finite, bounded number of seconds (not nan or inf)
            try:
                idle = timeout_s(idle, "--idle-timeout", IDLE_TIMEOUT_S)
            except ArgumentError:
                raise UsageError(
                    f"--idle-timeout must be 0 or more seconds (0: never), finite and at most "
                    f"{MAX_TIMEOUT_S:g}, not {idle:g}"
                ) from None
        env = zygote_env({**os.environ, "TF_USE_LEGACY_KERAS": "1"})
        record, started = start_agent(preload, env, idle)
        said = "started" if started else "already running"
        other = "" if started else env_mismatch(preload, env, record)
        if other:  # a run from this shell would pass it over: say so now, not at each run
            other = f"; runs from this shell pass it over: {other}"
        print(f"graphdist: warm agent {said}: pid {record.pid}, preloads {what}{other}")
        return 0
    if args.action == "stop":
        stopped = stop_agent(preload)
        if stopped is None:
            print(f"graphdist: no warm agent runs (preloads {what})")
        else:
            print(f"graphdist: warm agent pid {stopped.pid} stopped (preloads {what})")
        return 0
    found = live_agent(preload)
    if found is None:
        print(f"graphdist: no warm agent runs (preloads {what})")
        return 2
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.started))
    idle = "never" if not found.idle_timeout_s else f"after {found.idle_timeout_s:g} s idle"
    print(
        f"graphdist: warm agent pid {found.pid}, preloads {what}, since {since}, "
        f"served {found.served} run{'' if found.served == 1 else 's'}, exits {idle}; "
        f"log {found.log}"
    )
    return 0
