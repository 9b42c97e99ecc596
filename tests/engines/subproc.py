"""A fourth engine, defined in the tests: every step a plain child process of this machine.

It subclasses nothing of graphdist's; it is the :class:`graphdist._engine.Engine` primitives
alone (one node, ``here``, at this machine's network address; ports from graphdist's picker;
a step is its own command line, signalled directly). Registered by the ``graphdist.engines``
entry point that ``tests/distribute/test_engines.py`` installs, it gives ``graphdist up
--backend subproc`` and ``graphdist run --backend subproc`` with no other code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from graphdist._engine import Engine, register
from graphdist._exceptions import ArgumentError
from graphdist._ports import pick_free_ports, release_ports
from graphdist._registry import Option

#: What the engine writes to a step's output when it was told its node is gone (``lost_line``).
LOST = b"subproc: node lost: "


class SubprocEngine:
    """Every step a child process of this machine (see the module docstring)."""

    name: ClassVar[str] = "subproc"
    summary: ClassVar[str] = "plain child processes of this machine (a test engine)"
    requires: ClassVar[tuple[str, str] | None] = None
    options: ClassVar[tuple[Option, ...]] = (Option("node", "the one node's name", "NAME"),)
    node_word: ClassVar[str] = "subproc node"
    DEFAULT_START_TIMEOUT_S: ClassVar[float] = 60.0
    tls: ClassVar[bool] = False
    more_nodes: ClassVar[str] = "raise ntasks_per_node"
    FLEET: ClassVar[str | None] = None  # graphdist's fleet and run over these primitives
    RUN: ClassVar[str | None] = None
    kill_wait_s = 2.0

    def __init__(self, node: str) -> None:
        from graphdist._net.tlsmode import tls_host

        self.node = node
        self.address = tls_host()  # a host's address, as a real node's: members only there

    @classmethod
    def join(cls, options: Mapping[str, Any], env: Mapping[str, str]) -> Engine:
        node = options.get("node") or "here"
        if not isinstance(node, str) or not node.isidentifier():
            raise ArgumentError(f"node must be a word, not {node!r}", name="node", value=node)
        return cls(node)

    def describe(self) -> str:
        return f"subproc node {self.node}"

    def addresses(self) -> Mapping[str, str]:
        return {self.node: self.address}

    def lost(self, nodes: Sequence[str]) -> dict[str, str]:
        return {}

    def free_ports(self, per_node: Mapping[str, int], tag: str) -> dict[str, list[int]]:
        ports = pick_free_ports(sum(per_node.values()))
        release_ports(ports)  # taken again by the steps a moment later, as on Slurm's nodes
        found, rest = {}, list(ports)
        for node, count in per_node.items():
            found[node], rest = rest[:count], rest[count:]
        return found

    def command(
        self, node: str, step: str, argv: Sequence[str], *, stdin: bool, grace_s: float
    ) -> list[str]:
        return list(argv)

    def signal(self, step: str, sig: int, local: Any) -> None:
        if local is not None and local.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                local.send_signal(sig)

    def cancel(self, prefix: str, lost: Collection[str] = ()) -> list[str]:
        return []  # a step is its own command line, which the fleet or the run ends

    def lost_line(self, line: bytes) -> str | None:
        return line[len(LOST) :].decode().strip() if line.startswith(LOST) else None

    def out_of_memory(self, line: bytes) -> str | None:
        return None


register(SubprocEngine)
