"""Backends are looked up by name: the CLI and the supervisor find the built-in ones and any
other that registers itself; a bad name or a missing engine is a one-line user error."""

from __future__ import annotations

import pytest

from graphdist._cli.main import EXIT_USAGE, main
from graphdist._cli.parser import build_parser
from graphdist._detached.supervisor import SupervisorSpec
from graphdist._exceptions import ArgumentError
from graphdist._fleet import backends
from graphdist._local.fleet import LocalFleet
from graphdist._ray.fleet import RayFleet


def test_the_built_in_backends_are_registered_by_name():
    assert backends.names()[:2] == ("local", "ray")
    assert backends.backend("local") is LocalFleet
    assert backends.backend("ray", check=False) is RayFleet
    assert backends.start_timeouts().startswith("local 60 s, ray 180 s")
    assert LocalFleet.DEFAULT_START_TIMEOUT_S == 60.0 and RayFleet.DEFAULT_START_TIMEOUT_S == 180.0


def test_every_engine_is_a_backend_and_a_run_backend_by_its_name():
    """One registry of engines (issue 53): each built-in engine's fleet and run are found by its
    name, its own halves (local, Ray) or the engine-free ones over its primitives (Slurm)."""
    from graphdist import _engine
    from graphdist._distribute import runbackends
    from graphdist._distribute.commandrun import CommandRun
    from graphdist._fleet.command import CommandFleet, SlurmFleet
    from graphdist._local.run import LocalRun

    assert _engine.names()[:3] == ("local", "ray", "slurm")
    assert backends.names()[:3] == runbackends.names()[:3] == ("local", "ray", "slurm")
    assert backends.backend("local") is LocalFleet and runbackends.run_backend("local") is LocalRun
    assert backends.backend("slurm") is SlurmFleet and issubclass(SlurmFleet, CommandFleet)
    slurm_run = runbackends.run_backend("slurm")
    assert issubclass(slurm_run, CommandRun) and slurm_run.ENGINE is SlurmFleet.ENGINE


def test_the_built_in_engines_come_first_whichever_module_was_imported_first():
    import subprocess
    import sys

    code = "import graphdist._proc.slurm; from graphdist import _engine; print(*_engine.names())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split()[:3] == ["local", "ray", "slurm"], done.stderr


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(
        ArgumentError, match="No backend is named 'nope'; the backends are local, ray"
    ):
        backends.backend("nope")


def test_a_third_backend_is_one_module_that_registers_itself(monkeypatch):
    monkeypatch.setattr(backends._registry, "_classes", backends._registry.classes())

    class CopyFleet(LocalFleet):
        backend_name = "copy"
        summary = "a copy of the local backend"

    backends.register(CopyFleet)
    assert backends.backend("copy") is CopyFleet
    assert (
        "copy" in build_parser().parse_args(["up", "--cluster", "a=1", "--backend", "copy"]).backend
    )
    assert backends.describe("copy") == "copy: a copy of the local backend"

    class Impostor(LocalFleet):
        backend_name = "copy"

    with pytest.raises(ArgumentError, match="Two backends are named 'copy'"):
        backends.register(Impostor)


def test_a_missing_engine_says_what_to_install(monkeypatch):
    monkeypatch.setattr(RayFleet, "requires", ("graphdist_no_such_module", "pip install x"))
    with pytest.raises(ArgumentError, match="needs graphdist_no_such_module: pip install x"):
        backends.backend("ray")


def test_cli_refuses_options_a_backend_does_not_take(capsys):
    """The CLI, not the backend, refuses another backend's option: LocalFleet.for_command never
    sees `address`."""
    assert main(["up", "--cluster", "local=1", "--address", "ray://h:1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == (
        "Error: --address is an option of the ray backend, not of local (whose options are: none)\n"
    )
    assert main(["up", "--cluster", "local=1", "--backend", "nope"]) == EXIT_USAGE


def test_each_backend_declares_its_options_and_the_cli_makes_their_flags():
    assert [o.name for o in LocalFleet.options] == []
    assert [o.flag for o in RayFleet.options] == ["--address", "--strategy"]
    up = build_parser().commands["up"]
    assert "with --backend ray: the Ray cluster to join" in up.format_help().replace("\n ", "")
    args = build_parser().parse_args(
        ["up", "--cluster", "a=1", "--backend", "ray", "--strategy", "STRICT_SPREAD"]
    )
    assert args.backend_option_strategy == "STRICT_SPREAD"
    assert backends.check_options("ray", {"strategy": "PACK"}) == {"strategy": "PACK"}
    with pytest.raises(ArgumentError, match="strategy is an option of the ray backend, not "):
        backends.check_options("local", {"strategy": "PACK"})
    with pytest.raises(ArgumentError, match="colour is no backend's, not of ray"):
        backends.check_options("ray", {"colour": "red"})


def test_a_supervisor_spec_carries_its_backend_and_its_typed_cluster(tmp_path):
    spec = SupervisorSpec(
        str(tmp_path), "worker=2,ps=1", backend="ray", options={"address": "auto"}
    )
    assert spec.cluster == {"worker": 2, "ps": 1} and spec.start_timeout_s == 180.0
    assert spec.options == {"address": "auto"}
    with pytest.raises(ArgumentError, match="address is an option of the ray backend, not of"):
        SupervisorSpec(str(tmp_path), "worker=2", options={"address": "auto"})
    assert SupervisorSpec.from_json(spec.to_json()) == spec
    local = SupervisorSpec(str(tmp_path), {"local": ["localhost:2020"]})
    assert local.cluster.task("local", 0).port == 2020 and local.start_timeout_s == 60.0
    with pytest.raises(ArgumentError, match="No backend is named 'nope'"):
        SupervisorSpec(str(tmp_path), {}, backend="nope")
