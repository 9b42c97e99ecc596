"""Mutation testing of graphdist's pure modules (``make mutants``): mutmut plants one small bug
at a time (a changed operator, constant, string or argument) in a module whose logic is pure and
fast to test, and runs that module's own unit tests against it; a bug no test notices survives.

Each module runs on its own, in a scratch copy of the checkout (graphdist/, tests/, setup.cfg and
a pyproject.toml that holds only mutmut's settings), so its kill rate is that of its own tests,
never of another module's, and nothing in the checkout is touched: mutmut writes its mutants
under the scratch folder, which is removed afterwards unless ``--keep``.

Every survivor is printed with its diff. A survivor listed in :data:`EQUIVALENT` (the module, the
function and the mutated line) is a mutant that behaves as the original, with the reason; any
other survivor is a test to write, and makes the run exit 1. ``--record docs/mutants.md``
rewrites the page's record (between its two marker lines) from the run.

Only tests that need no TensorFlow (no server process, no import) are run: those are fast, and
the mutants of the code that talks to TensorFlow are left to the integration tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The tests' pytest settings come from setup.cfg ([tool:pytest]: markers, timeouts) but its
# addopts (-n 2 for xdist) do not apply: mutmut runs each mutant's tests in a fork of its own.
PYTEST_ARGS = ["-p", "no:xdist", "-p", "no:randomly", "-p", "no:cacheprovider", "-o", "addopts="]
# What counts as caught: a test failed, or the tests ran past mutmut's time limit (a mutant that
# makes a test hang, say a lock taken without LOCK_NB).
CAUGHT = ("killed", "timeout")
RECORD_BEGIN = "<!-- mutants: begin (written by make mutants RECORD=1) -->"
RECORD_END = "<!-- mutants: end -->"


@dataclasses.dataclass(frozen=True)
class Module:
    key: str
    path: str  # relative to the checkout
    tests: tuple[str, ...]  # pytest arguments: the module's own unit tests


MODULES = {
    m.key: m
    for m in (
        Module("restarts", "graphdist/_proc/restarts.py", ("tests/proc/test_restarts.py",)),
        Module(
            "cluster",
            "graphdist/_cluster.py",
            ("tests/test_cluster.py", "-k", "not matches_tensorflow"),
        ),
        Module(
            "spectext",
            "graphdist/_spectext.py",
            ("tests/test_cluster.py", "-k", "not matches_tensorflow"),
        ),
        Module(
            "placement",
            "graphdist/_graph/placement.py",
            ("tests/graph/test_placement.py", "-k", "not agrees_with_tensorflow"),
        ),
        Module("members", "graphdist/_net/members.py", ("tests/net/test_members.py",)),
        Module(
            "ports", "graphdist/_ports.py", ("tests/net/test_ports.py", "-m", "not integration")
        ),
        Module("failures", "graphdist/_failures.py", ("tests/test_failures.py",)),
    )
}

# Survivors that behave as the original: (module key, function, the mutated line as mutmut
# writes it, stripped) -> why no test can tell them apart. docs/mutants.md prints this table.
_SEEN = "the set of devices found fine only spares a device's second check, which finds it fine"
_TWO_COLONS = (
    "with two colons or more in a part, its job or its count fails its check whichever colon "
    "splits it"
)
_BYTES_LATER = (
    "the lower bound only decides when bytes are counted: text of at most MAX_SPEC_BYTES / 4 "
    "characters cannot take more than MAX_SPEC_BYTES bytes"
)
_HAS_CLOEXEC = "Linux has O_CLOEXEC: getattr's default is never used"
_PATH_MAX = (
    "a path that opens is shorter than PATH_MAX (4096), so it is shown whole with a width of "
    "4096 or 4097"
)
_ZONE = (
    "Python 3.7 and later give an IPv6 zone as the scope id, never inside the address: there is "
    "no '%' to split at"
)
_ALL_CLAIMED = (
    "every port _unclaim is given is claimed (claim_ports' own list, release_claims' claims)"
)
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (
        "cluster",
        "_colon_counts",
        'parts = [part.strip().rpartition(":") for part in text.split(",")]',
    ): _TWO_COLONS,
    ("spectext", "_json_depth", 'if token in "XX[{XX":'): (
        "a token is one bracket or a quoted string, and no quoted string is in 'XX[{XX'"
    ),
    ("spectext", "_json_depth", 'elif token in "XX]}XX":'): (
        "a token is one bracket or a quoted string, and no quoted string is in 'XX]}XX'"
    ),
    (
        "cluster",
        "_parse_counts",
        'job, _, count_text = (s.strip() for s in part.rpartition("="))',
    ): ("only text whose every part has one '=' gets here (_looks_like_counts)"),
    (
        "spectext",
        "check_size",
        "if MAX_SPEC_BYTES / 4 < size <= MAX_SPEC_BYTES:  # a character takes 1 to 4 bytes",
    ): _BYTES_LATER,
    (
        "spectext",
        "check_size",
        "if MAX_SPEC_BYTES // 5 < size <= MAX_SPEC_BYTES:  # a character takes 1 to 4 bytes",
    ): _BYTES_LATER,
    (
        "spectext",
        "check_size",
        "if MAX_SPEC_BYTES // 4 <= size <= MAX_SPEC_BYTES:  # a character takes 1 to 4 bytes",
    ): _BYTES_LATER,
    (
        "spectext",
        "read_text_file",
        'fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", None))',
    ): _HAS_CLOEXEC,
    (
        "spectext",
        "read_text_file",
        'fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", ))',
    ): _HAS_CLOEXEC,
    (
        "spectext",
        "read_text_file",
        'fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 1))',
    ): _HAS_CLOEXEC,
    (
        "spectext",
        "read_text_file",
        "while left >= 0:  # a file that grows while it is read is still read within the bound",
    ): ("the read at left == 0 asks for 0 bytes and gets none: the loop ends there as well"),
    ("spectext", "read_text_file", 'return data.decode("UTF-8-SIG")'): "codec names ignore case",
    ("cluster", "Cluster.__hash__", "return hash(self.to_json(sort_keys=None))"): (
        "as_dict() is in sorted order already: the JSON is the same"
    ),
    ("cluster", "Cluster.__hash__", "return hash(self.to_json(sort_keys=False))"): (
        "as_dict() is in sorted order already: the JSON is the same"
    ),
    ("cluster", "Cluster.__init__", 'key = f"{host.upper()}:{port}"'): (
        "hosts are ASCII (checked before): upper case folds them as lower case does"
    ),
    (
        "cluster",
        "Cluster._from_file",
        'data = load_json(text, f"cluster file {show(path, 4097)}")',
    ): _PATH_MAX,
    (
        "cluster",
        "Cluster._from_file",
        'f"Cluster file {show(path, 4097)} holds {type(data).__name__}, not a JSON object",',
    ): _PATH_MAX,
    (
        "cluster",
        "Cluster.parse",
        'return cls.parse(load_json(text, "cluster spec text"), host=None)',
    ): ("JSON text gives a mapping, which names its addresses: host is for job=N text only"),
    ("cluster", "Cluster.parse", 'return cls.parse(load_json(text, "cluster spec text"), )'): (
        "JSON text gives a mapping, which names its addresses: host is for job=N text only"
    ),
    ("cluster", "Cluster.to_cluster_spec", "return ClusterSpec(None)"): (
        "not run here: its test (test_to_cluster_spec_matches_tensorflow) imports TensorFlow, "
        "which the mutation run leaves out; that test kills it"
    ),
    (
        "placement",
        "_int_part",
        "if not is_ascii_digits(text) or len(text) > 11 or int(text) > MAX_TASK_INDEX:",
    ): (
        "an 11-digit number is over MAX_TASK_INDEX anyway: the length check only spares int() "
        "a long string"
    ),
    ("placement", "check_device", "text = parsed.to_string() or repr(None)"): (
        "an empty device (None, '') never fails a check, so its text is never shown"
    ),
    ("placement", "check_ops", "if not text and text in seen:"): _SEEN,
    ("placement", "check_ops", "seen.add(None)"): _SEEN,
    ("members", "member_addresses", "infos = socket.getaddrinfo(host, None, )"): (
        "without type= each address comes once per socket type, and is kept once"
    ),
    (
        "members",
        "member_addresses",
        "ip = ipaddress.ip_address(str(info[4][0]).split(None, 1)[0])",
    ): _ZONE,
    (
        "members",
        "member_addresses",
        'ip = ipaddress.ip_address(str(info[4][0]).split("%", )[0])',
    ): _ZONE,
    (
        "members",
        "member_addresses",
        'ip = ipaddress.ip_address(str(info[4][0]).rsplit("%", 1)[0])',
    ): _ZONE,
    (
        "members",
        "member_addresses",
        'ip = ipaddress.ip_address(str(info[4][0]).split("XX%XX", 1)[0])',
    ): _ZONE,
    (
        "members",
        "member_addresses",
        'ip = ipaddress.ip_address(str(info[4][0]).split("%", 2)[0])',
    ): _ZONE,
    ("members", "parse_allow", "network = ipaddress.ip_network(text, strict=None)"): (
        "None is false, as False is"
    ),
    ("ports", "_claim", "return PortTaken(port, pid or port_holder(None), starting=True)"): (
        "a lock reads 'starting' only where a live pid wrote it (_written gives no kind "
        "without one): port_holder is never asked here"
    ),
    ("ports", "_lock_file", "if holder[1] is not None:"): (
        "a holder that wrote its pid but no kind is read 20 more times, 1 ms apart, with the "
        "same answer: only 20 ms slower"
    ),
    ("ports", "_mark", "os.ftruncate(fd, 1)"): (
        "what is written next starts at byte 0 and is longer than one byte: the byte left is "
        "overwritten"
    ),
    ("ports", "_reserve", "if port in _held and port in _claims:"): (
        "a port held or claimed here is refused by its lock file as well: flock refuses a "
        "second open file of the same process too"
    ),
    ("ports", "_unclaim", "claim = _claims.pop(port, )"): _ALL_CLAIMED,
    ("ports", "_unclaim", "break"): _ALL_CLAIMED,
    ("ports", "_unclaim", "fd = _held.pop(port, )"): (
        "a claim that took the lock put its file in _held, and only release_ports takes it out, "
        "with the claim"
    ),
    (
        "ports",
        "_unclaim",
        "elif claim[1] == _HELD or port in _held:  # reserved before: it stays reserved",
    ): (
        "a port handed over is never in _held (another process holds its lock): only a held "
        "claim gets here with its port in _held"
    ),
    ("ports", "_unlock", "with contextlib.suppress(None):"): (
        "LOCK_UN fails only on a file that is not open, and os.close() then raises all the same"
    ),
    ("ports", "_written", 'fields = os.pread(fd, 64, 0).decode("ASCII", "replace").split()'): (
        "codec names ignore case"
    ),
    ("ports", "_written", 'fields = os.pread(fd, 65, 0).decode("ascii", "replace").split()'): (
        "a holder writes 'PID KIND', under 30 bytes: there is no 65th byte to read"
    ),
    ("ports", "_written", "if pid < 0 or not psutil.pid_exists(pid):"): (
        "pid 0 is no process: psutil.pid_exists(0) is false on Linux"
    ),
    ("ports", "is_port_free", "sock = socket.socket(family, )"): (
        "SOCK_STREAM is socket()'s default type"
    ),
    ("ports", "is_port_free", "sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 2)"): (
        "any value but 0 turns SO_REUSEADDR on"
    ),
}


@dataclasses.dataclass
class Survivor:
    name: str  # mutmut's name of the mutant
    function: str  # Class.method or function
    status: str  # survived, no tests, timeout, suspicious...
    diff: str
    line: str  # the mutated line, stripped
    why: str | None  # the reason it is equivalent, or None: a test is missing


@dataclasses.dataclass
class Result:
    module: Module
    total: int
    killed: int
    survivors: list[Survivor]
    seconds: float

    @property
    def rate(self) -> float:
        return self.killed / self.total if self.total else 1.0

    @property
    def missing(self) -> list[Survivor]:
        return [s for s in self.survivors if s.why is None]


def _function(name: str) -> str:
    """``Backoff.delay`` from mutmut's ``graphdist._proc.restarts.xǁBackoffǁdelay__mutmut_19``."""
    short = name.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    if short.startswith("xǁ"):
        return ".".join(short[2:].split("ǁ"))
    return short[2:] if short.startswith("x_") else short


def _mutated_line(diff: str) -> str:
    added = [
        line[1:].strip()
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    return " / ".join(added) if added else "(line removed)"


def _scratch(module: Module, base: Path) -> Path:
    """A copy of what the module's tests need, with mutmut's settings for it alone."""
    work = base / module.key
    ignore = shutil.ignore_patterns("__pycache__", "*.so", ".hypothesis", "mutants")
    shutil.copytree(REPO / "graphdist", work / "graphdist", ignore=ignore)
    shutil.copytree(REPO / "tests", work / "tests", ignore=ignore)
    shutil.copy(REPO / "setup.cfg", work / "setup.cfg")

    def toml(items: Sequence[str]) -> str:
        return (
            "["
            + ", ".join('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"' for s in items)
            + "]"
        )

    (work / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["graphdist/"]\n'
        f"only_mutate = {toml([module.path])}\n"
        f"pytest_add_cli_args = {toml(PYTEST_ARGS)}\n"
        f"pytest_add_cli_args_test_selection = {toml(module.tests)}\n"
        "use_git_change_detection = false\n",
        encoding="utf-8",
    )
    return work


# Every mutant's status and, for those not killed, its diff, read in one process with mutmut's
# own functions (one `mutmut show` per survivor takes a second and a half each): a JSON object
# name -> [status, diff].
_READ_RESULTS = """
import json
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

found = {}
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    for name, code in data.exit_code_by_key.items():
        status = status_by_exit_code[code]
        diff = "" if status == "killed" else get_diff_for_mutant(name, path=path)
        found[name] = [status, diff]
print(json.dumps(found))
"""


def _mutmut(
    work: Path, *args: str, log: Path | None = None, timeout_s: float = 3600, python: bool = False
) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)  # run from a test under xdist: mutmut's pytest is its own
    with open(log, "ab") if log else open(os.devnull, "wb") as sink:
        result = subprocess.run(
            [str(BIN / ("python" if python else "mutmut")), *args],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE if log is None else sink,
            stderr=subprocess.STDOUT if log is None else sink,
            timeout=timeout_s,
        )
    out = result.stdout.decode("utf-8", "replace") if result.stdout else ""
    if result.returncode != 0:
        tail = log.read_text("utf-8", "replace")[-3000:] if log else out[-3000:]
        raise RuntimeError(
            f"mutmut {' '.join(args)} failed in {work} (exit {result.returncode}):\n{tail}"
        )
    return out


def run_module(
    module: Module,
    base: Path,
    *,
    only: Sequence[str] = (),
    children: int = 1,
    reuse: bool = False,
) -> Result:
    """Mutate ``module`` (only the mutants whose names match the globs ``only``, if given) and
    run its own tests against each mutant; ``reuse``: read what a former run left in ``base``
    instead (to write the record again without running every mutant again)."""
    start = time.monotonic()
    work = base / module.key
    if not (reuse and (work / "mutants").is_dir()):
        shutil.rmtree(work, ignore_errors=True)
        work = _scratch(module, base)
        log = work / "mutmut-run.log"
        _mutmut(work, "run", "--max-children", str(children), *only, log=log)
    found = json.loads(_mutmut(work, "-c", _READ_RESULTS, python=True))
    if only:
        found = {n: v for n, v in found.items() if any(fnmatch.fnmatch(n, g) for g in only)}
    statuses = {n: status for n, (status, _) in found.items() if status != "not checked"}
    survivors = []
    for name, status in sorted(statuses.items(), key=lambda kv: _order(kv[0])):
        if status in CAUGHT:
            continue
        diff = found[name][1]
        function, line = _function(name), _mutated_line(diff)
        why = EQUIVALENT.get((module.key, function, line))
        survivors.append(Survivor(name, function, status, diff.strip(), line, why))
    killed = sum(1 for s in statuses.values() if s in CAUGHT)
    return Result(module, len(statuses), killed, survivors, time.monotonic() - start)


def _order(name: str) -> tuple[str, int]:
    head, _, number = name.rpartition("__mutmut_")
    return head, int(number) if number.isdigit() else 0


def report(results: Sequence[Result]) -> str:
    lines = []
    for r in results:
        lines.append(
            f"{r.module.path}: {r.killed}/{r.total} killed ({100 * r.rate:.1f} %), "
            f"{len(r.survivors) - len(r.missing)} equivalent, {len(r.missing)} not killed "
            f"({r.seconds:.0f} s)"
        )
        for s in r.survivors:
            tag = f"equivalent: {s.why}" if s.why else f"{s.status.upper()}: a test is missing"
            lines.append(f"  {s.function}: {s.line}  [{tag}]")
            if s.why is None:
                lines.extend("      " + d for d in s.diff.splitlines())
    killed = sum(r.killed for r in results)
    total = sum(r.total for r in results)
    lines.append(f"all: {killed}/{total} killed ({100 * killed / max(total, 1):.1f} %)")
    return "\n".join(lines)


def record(results: Sequence[Result], page: Path) -> None:
    """Rewrite the record between the marker lines of ``page`` (docs/mutants.md)."""
    rows = [
        "| module | mutants | killed | kill rate | equivalent | not killed |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| `{r.module.path.removeprefix('graphdist/')}` | {r.total} | {r.killed} | "
            f"{100 * r.rate:.1f} % | {len(r.survivors) - len(r.missing)} | {len(r.missing)} |"
        )
    killed, total = sum(r.killed for r in results), sum(r.total for r in results)
    missing = sum(len(r.missing) for r in results)
    equivalent = sum(len(r.survivors) for r in results) - missing
    rows.append(
        f"| all | {total} | {killed} | {100 * killed / max(total, 1):.1f} % | {equivalent} | "
        f"{missing} |"
    )
    rows += ["", "The equivalent mutants, each with why no test can tell it from the original:", ""]
    rows += ["| module | function | the mutated line | why it is equivalent |", "|---|---|---|---|"]
    for r in results:
        for s in r.survivors:
            cell = s.line.replace("|", "\\|")
            why = (s.why or "**not killed: a test is missing**").replace("|", "\\|")
            rows.append(f"| `{r.module.key}` | `{s.function}` | `{cell}` | {why} |")
    text = page.read_text(encoding="utf-8")
    begin, end = text.index(RECORD_BEGIN) + len(RECORD_BEGIN), text.index(RECORD_END)
    page.write_text(text[:begin] + "\n\n" + "\n".join(rows) + "\n\n" + text[end:], encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutants", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--module", action="append", choices=sorted(MODULES), help="(default: all)")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB", help="mutant names")
    parser.add_argument("--children", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (mutmut browse)")
    parser.add_argument("--record", metavar="PAGE", help="rewrite PAGE's record (docs/mutants.md)")
    parser.add_argument(
        "--reuse", action="store_true", help="with --keep: report what a former run left in DIR"
    )
    args = parser.parse_args(argv)
    if args.reuse and not args.keep:
        parser.error("--reuse needs --keep DIR")
    modules = [MODULES[k] for k in (args.module or MODULES)]
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="graphdist-mutants-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        results = []
        for module in modules:
            print(f"mutating {module.path} ...", flush=True)
            results.append(
                run_module(module, base, only=args.only, children=args.children, reuse=args.reuse)
            )
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(report(results))
    if args.record:
        record(results, Path(args.record))
    return 1 if any(r.missing for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
