"""The documentation site's sources (docs/, built by ``make docs``) cover what they promise: the API
reference documents every name of ``graphdist.__all__`` and nothing else, the CLI reference every
subcommand of the parser, the tutorial runs on every build and uses public names only, and README
is a front page that links to the pages. Cheap: no Sphinx build here (CI runs ``make docs``)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import graphdist
from graphdist._cli.parser import build_parser
from tests.conftest import REPO

DOCS = Path(REPO, "docs")
README_MAX_LINES = 150


def _subcommands() -> set[str]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_the_api_reference_documents_every_public_name_and_only_those():
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    directive = r"^\.\. auto(?:class|function|data|exception):: graphdist\.(\w+)$"
    documented = re.findall(directive, text, re.M)
    assert len(documented) == len(set(documented)), "a name documented twice"
    assert set(documented) == set(graphdist.__all__), set(graphdist.__all__) ^ set(documented)


def test_the_cli_reference_has_a_section_generated_for_every_subcommand():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    paths = re.findall(r"^:path: (\S+)$", text, re.M)
    assert sorted(paths) == sorted(_subcommands()), set(paths) ^ _subcommands()
    for name in paths:
        assert f"## graphdist {name}\n" in text, name  # the heading guides link to (cli.md#...)
    # every section is generated from the one parser, never typed
    assert text.count(":func: build_parser") == len(paths) + 1  # + the top-level options


def test_the_build_executes_the_tutorial_and_fails_on_a_warning_or_a_failing_cell():
    conf = (DOCS / "conf.py").read_text(encoding="utf-8")
    assert 'nb_execution_mode = "force"' in conf
    assert "nb_execution_raise_on_error = True" in conf
    assert "intersphinx" not in conf.replace("no intersphinx", "")  # offline: nothing fetched
    makefile = Path(REPO, "Makefile").read_text(encoding="utf-8")
    assert "sphinx-build -E -W --keep-going" in makefile
    assert (DOCS / "tutorial.ipynb").resolve() == Path(REPO, "examples", "tutorial.ipynb").resolve()
    assert "make docs" in Path(REPO, ".ci", "run").read_text(encoding="utf-8")


def test_the_tutorial_uses_public_names_only():
    notebook = json.loads(Path(REPO, "examples", "tutorial.ipynb").read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    assert not re.search(r"\bgraphdist\._", code)
    used = set(re.findall(r"\bgraphdist\.([A-Za-z]\w*)", code))
    assert used and used <= set(graphdist.__all__), used - set(graphdist.__all__)


def test_every_page_is_in_the_toctree():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^([a-z_]+)$", index, re.M))
    pages = {p.stem for p in DOCS.glob("*.md")} | {p.stem for p in DOCS.glob("*.ipynb")}
    assert pages - {"index"} == listed, pages ^ listed


def test_readme_is_a_front_page_that_links_to_the_docs():
    text = Path(REPO, "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    # the two set-up commands come first, as they always did
    assert lines[2] == "```sh" and lines[5] == "```"
    assert lines[3].startswith("make demo   # set up .venv, start a two-server fleet")
    assert lines[4].startswith("make test   # set up .venv with the test extras")
    links = re.findall(r"\]\(([^)#]+)\)", text)
    for link in links:
        assert Path(REPO, link).exists(), link
    linked = {Path(link).stem for link in links if link.startswith("docs/")}
    # changelog.md and architecture.md only include CHANGELOG.md and ARCHITECTURE.md, which
    # README links as they are
    guides = {p.stem for p in DOCS.glob("*.md")} - {"index", "changelog", "architecture"}
    assert guides <= linked, guides - linked


def test_the_docs_name_only_shipped_files_and_no_private_module():
    for page in DOCS.glob("*.md"):
        text = page.read_text(encoding="utf-8")
        shown = text.replace("graphdist._cli.parser", "")  # the CLI reference's own source
        assert not re.search(r"\bgraphdist\._[a-z]", shown), page
        for path in re.findall(r"`(examples/[\w.]+)`", text):
            assert Path(REPO, path).exists(), (page.name, path)


def test_every_name_the_docs_show_is_public():
    # test_api's check of README, for the pages README's guide material moved to
    shown: set[str] = set()
    for page in DOCS.glob("*.md"):
        shown |= set(re.findall(r"\bgraphdist\.([A-Za-z][A-Za-z0-9_]*)", page.read_text("utf-8")))
    shown -= {"pytest_plugin", "NAME"}  # the plugin module; api.md's "graphdist.NAME"
    assert shown <= set(graphdist.__all__), shown - set(graphdist.__all__)


def _error_classes() -> set[type[graphdist.GraphdistError]]:
    """Every subclass of GraphdistError, recursively, once every public name is loaded (the
    package loads its modules on first use: a class defined beside a public name counts too).
    None is skipped, private or not: whatever graphdist raises reaches a user as its message."""
    for name in graphdist.__all__:
        getattr(graphdist, name)
    found: set[type[graphdist.GraphdistError]] = set()
    todo = [graphdist.GraphdistError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return found


def _headings(text: str) -> list[str]:
    return re.findall(r"^#{2,6} (.+)$", text, re.M)


def test_every_error_class_has_a_troubleshooting_entry():
    from graphdist._cli import main as cli

    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    headings = _headings(text)
    classes = _error_classes()
    assert len(classes) >= 27  # the tree of graphdist._exceptions' docstring, root included
    missing = {
        cls.__name__
        for cls in classes
        if not any(re.search(rf"\b{cls.__name__}\b", h) for h in headings)
    }
    assert not missing, f"no heading of docs/troubleshooting.md names {sorted(missing)}"
    # the CLI's error classes: its table lists as exit status 2 exactly the classes main()
    # exits 2 for (a user mistake), and TaskExitError as the task's own status
    rows = {
        row.split("|")[1].strip(): set(re.findall(r"`(\w+Error)`", row.split("|")[2]))
        for row in re.findall(r"^\|.*\|$", text, re.M)
    }
    usage = {cls.__name__ for cls in classes if issubclass(cls, cli.USER_MISTAKES)}
    assert rows.get("2") == usage, usage ^ rows.get("2", set())
    assert rows.get("the task's own status") == {"TaskExitError"}
    assert cli.EXIT_USAGE == 2 and cli.EXIT_FAILURE == 1
    assert "Error: interrupted" in text  # Ctrl-C and signals: 130, 128 + N
    # TensorFlow's own messages that users meet, each under a heading of its words
    for words in (
        "Cannot assign a device for operation",
        "unknown device",
        "No session factory registered",
        "Could not start gRPC server",
        "No module named 'tf_keras'",
        "unsupported type PerReplica",
        "Socket closed",
        "Deadline Exceeded",
        "Port already in use",
    ):
        assert any(words in h for h in headings), words
