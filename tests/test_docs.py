"""The docs hold together: links and paths in README.md and docs/*.md exist, and the commands they show parse.

    - every relative Markdown link (and image) points at a file that exists, and its #anchor at a heading there;
    - every `docs/...` path and every repository file path (cluster/..., model_runtime/..., tests/..., ...) named
      in the text exists;
    - every command of the README's quick start is one the CLI accepts (the `specserve` argument parser, in
      process: nothing runs, Ray is not started) or a Makefile target; every `.venv/bin/specserve ...` command
      shown in a code block of the docs parses too;
    - the README stays short (<= 200 lines), and so does every page in docs/ (<= 400 lines: a page answers one
      question and opens with its latest figures; history goes to git, reference to pages of its own).

Fast (about a second) and marked `unit`.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200
DOCS_PAGE_MAX_LINES = 400

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w/.$~-])docs/[\w./-]*")
# a file path inside the repository: a top-level folder of it, then a name with an extension
TOP_DIRS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "bench_results")
REPO_FILE = re.compile(r"(?<![\w/.$~<-])(?:" + "|".join(map(re.escape, TOP_DIRS)) + r")/[\w./-]*\.[a-z]{1,5}\b")
FENCE = re.compile(r"```(?:bash|sh|console)?\n(.*?)```", re.S)


def text_outside_code_blocks(text: str) -> str:
    """The text without fenced blocks and inline code spans, where brackets are not links."""
    return re.sub(r"`[^`]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces -> -."""
    heading = re.sub(r"[`*]", "", heading.strip().lower())
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def page_ids(pages: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in pages]


@pytest.mark.parametrize("page", PAGES, ids=page_ids(PAGES))
def test_relative_links_exist(page: Path) -> None:
    broken = []
    for target in LINK.findall(text_outside_code_blocks(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_ids(PAGES))
def test_named_paths_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    named = {m.rstrip(".,:;") for m in DOCS_PATH.findall(text)} | {m.rstrip(".,:;") for m in REPO_FILE.findall(text)}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def parse_cli(argv: list[str]) -> str | None:
    """None if the `specserve` parser accepts argv, else its error message."""
    from cluster.cli.main import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            if exc.code in (0, None):  # --help
                return None
            return err.getvalue().strip() or f"exit {exc.code}"
    return None


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, one argv per line."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a plain command
            continue
        if argv:
            commands.append(argv)
    return commands


def specserve_argv(argv: list[str]) -> list[str] | None:
    """The arguments after the `specserve` executable, when argv runs it (directly or through a wrapper)."""
    for i, word in enumerate(argv):
        if word == "specserve" or word.endswith("/bin/specserve"):
            return argv[i + 1:]
    return None


def quick_start_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "README.md has no '## Quick start' section"
    return FENCE.findall(match.group(1))


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}); move detail to docs/"


@pytest.mark.parametrize("page", PAGES[1:], ids=page_ids(PAGES[1:]))
def test_docs_page_is_short(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").count("\n")
    assert lines <= DOCS_PAGE_MAX_LINES, (
        f"{page.relative_to(ROOT)} has {lines} lines (at most {DOCS_PAGE_MAX_LINES}): split it by the question each "
        "part answers, summarise old runs in a line each (their detail stays in git history), or move reference "
        "sections to a page of their own and link them")


def test_quick_start_commands_parse() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    commands = [argv for block in quick_start_blocks() for argv in shell_commands(block)]
    assert any(argv[:2] == ["make", "setup"] for argv in commands), "the quick start shows no `make setup`"
    assert any(argv[:2] == ["make", "test"] for argv in commands), "the quick start shows no `make test`"
    runs = [argv for argv in commands if specserve_argv(argv) is not None]
    assert any((specserve_argv(a) or [""])[0] == "generate" for a in runs), "no in-process `specserve generate`"
    assert any((specserve_argv(a) or [""])[0] == "up" for a in runs), "no `specserve up` through the cluster"
    problems = []
    for argv in commands:
        if argv[0] == "make":
            problems += [f"make {t}: no such Makefile target" for t in argv[1:] if t not in targets]
            continue
        args = specserve_argv(argv)
        if args is None:
            problems.append(f"{shlex.join(argv)}: neither make nor specserve")
            continue
        for word in argv[:argv.index(args[0]) if args else len(argv)]:
            if "/" in word and not (ROOT / word).exists():
                problems.append(f"{shlex.join(argv)}: {word} does not exist")
        if (error := parse_cli(args)) is not None:
            problems.append(f"{shlex.join(argv)}: {error}")
    assert not problems, "\n".join(problems)


PLACEHOLDER = re.compile(r"^(?:\[.*|.*\.\.\.|[A-Z][A-Z_]*|-{1,2}[\w-]+=?[A-Z][A-Z_]*)$")


@pytest.mark.parametrize("page", PAGES, ids=page_ids(PAGES))
def test_shown_commands_parse(page: Path) -> None:
    """Every `.venv/bin/specserve` command shown (code blocks and inline spans) parses, unless it shows a placeholder
    (NAME, [flags], ...)."""
    text = page.read_text(encoding="utf-8")
    blocks = FENCE.findall(text)
    # inline commands too: a code span that starts with the executable or the netns wrapper
    blocks += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))
               if re.match(r"(?:scripts/in-netns\.sh |/usr/bin/time -v )*\.venv/bin/specserve ", span)]
    problems = []
    for block in blocks:
        for argv in shell_commands(block):
            args = specserve_argv(argv)
            if args is None or any(PLACEHOLDER.match(word) for word in args):
                continue
            if (error := parse_cli(args)) is not None:
                problems.append(f"{shlex.join(argv)}: {error}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_commands_table_names_real_subcommands() -> None:
    """Each `specserve SUBCOMMAND` of the README's commands table is one the parser knows."""
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## Commands\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "README.md has no '## Commands' section"
    names = set(re.findall(r"^\| `specserve ([a-z-]+)", match.group(1), re.M))
    assert names, "the commands table names no `specserve` subcommand"
    unknown = sorted(name for name in names if parse_cli([name, "--help"]) is not None)
    assert not unknown, f"unknown subcommands in the README's commands table: {unknown}"
