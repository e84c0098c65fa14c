"""The serving image built and run on this machine: scripts/build-image.sh, one test per step, in its order.

Opt-in (root, Debian's container tools, PyPI, 15-25 minutes on 2 CPUs cold, a few with the caches):

    make test-image        # = SPECSERVE_IMAGE=1 .venv/bin/python -m pytest -q tests/deploy/test_image.py

Not under scripts/in-netns.sh: the steps fetch Debian packages and PyPI wheels. Ray starts only in the `once` step,
inside a container with `--network none` (loopback only), token auth on. A step that fails, or that the machine
refuses, fails its test with the script's own line naming the step and why; the steps after it skip, so everything
before a refused step still runs. The last test checks the image's `up --once` against the host's in-process greedy
decoding of the same prompt (same code, same CPU, same kernels: the same tokens).
Without the opt-in only the script's own checks run (no root, no network, seconds).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy.rendering import REPO, pyproject
from tests.deploy.test_dockerfile import run_hadolint

SCRIPT = REPO / "scripts" / "build-image.sh"
STANDIN = REPO / "deploy" / "image" / "standin-base.Containerfile"
OPT_IN = "SPECSERVE_IMAGE"
WORK = Path(os.environ.get("SPECSERVE_IMAGE_WORK", "/var/tmp/specserve-image"))
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 24
STEP_TIMEOUT_S = 3600  # a cold `kernels` step took 7.5 min on 2 busy CPUs


@dataclass
class Steps:
    """The script's steps run so far (one owner: the module's fixture) and the first one that did not pass."""

    outputs: dict[str, str] = field(default_factory=dict)
    stopped: str | None = None

    def run(self, step: str) -> str:
        if self.stopped is not None:
            pytest.skip(f"an earlier step did not pass: {self.stopped}")
        env = {**os.environ, "SPECSERVE_IMAGE_WORK": str(WORK), "SPECSERVE_IMAGE_PROMPT": PROMPT,
               "SPECSERVE_IMAGE_MAX_TOKENS": str(MAX_TOKENS)}
        result = subprocess.run([str(SCRIPT), step], capture_output=True, text=True, env=env,
                                timeout=STEP_TIMEOUT_S)
        output = result.stdout + result.stderr
        last = [line for line in result.stdout.splitlines() if line.startswith("build-image: ")][-1:]
        if result.returncode != 0:
            self.stopped = last[0] if last else f"{step}: exit {result.returncode}"
            pytest.fail(f"{self.stopped}\n{output[-4000:]}")
        assert last and last[0].startswith(f"build-image: {step} ok in "), output[-2000:]
        self.outputs[step] = output
        return output


@pytest.fixture(scope="module")
def steps() -> Iterator[Steps]:
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"the image build is opt-in: {OPT_IN}=1 (make test-image; root, Debian's packages, minutes)")
    if os.geteuid() != 0:
        pytest.skip("the image build needs root (mmdebstrap, buildah's chroot isolation, podman's storage)")
    yield Steps()


def pins() -> dict[str, str]:
    return {dep.split("==")[0].split("[")[0]: dep.split("==")[1]
            for dep in pyproject()["project"]["dependencies"] if "==" in dep}


# -- without the opt-in: the script and the stand-in's Containerfile -----------------------------------------------


def test_script_parses_and_refuses_an_unknown_step() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    result = subprocess.run([str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "SPECSERVE_IMAGE_WORK": "/tmp/specserve-image-parse"})
    assert result.returncode == 2 and "unknown step nonsense" in result.stderr
    assert "tools rootfs base image models kernels list once" in result.stderr


def test_standin_base_is_hadolint_clean() -> None:
    result = run_hadolint(STANDIN)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_standin_base_mirrors_rays_image() -> None:
    """The user, the Ray pin and the writable Python the Dockerfile relies on, as Ray's image has them."""
    text = STANDIN.read_text()
    assert f"ARG RAY_VERSION={pins()['ray']}" in text
    assert "--uid 1000 --gid 100 ray" in text and "USER 1000:100" in text
    assert "PATH=/home/ray/venv/bin:" in text and "python3 -m venv /home/ray/venv" in text
    script = SCRIPT.read_text()
    assert "--build-arg \"RAY_IMAGE=$BASE_IMAGE\"" in script and "--isolation chroot" in script


# -- opt-in: the steps, in the script's order ---------------------------------------------------------------------


def test_tools(steps: Steps) -> None:
    output = steps.run("tools")
    assert re.search(r"buildah version \d", output) and re.search(r"podman version \d", output)
    assert re.search(r"mmdebstrap \d", output) and re.search(r"runc version \d", output)


def test_rootfs(steps: Steps) -> None:
    output = steps.run("rootfs")
    assert "skipped: SPECSERVE_IMAGE_BASE" in output or re.search(r"^Python 3\.11\.\d+$", output, re.M), output


def test_base(steps: Steps) -> None:
    output = steps.run("base")
    if "skipped: SPECSERVE_IMAGE_BASE" not in output:
        expected = rf"^ray {re.escape(pins()['ray'])} torch {re.escape(pins()['torch'])}(\+cpu)?$"
        assert re.search(expected, output, re.M), output[-2000:]


def test_image(steps: Steps) -> None:
    output = steps.run("image")
    assert re.search(r"^image \w+: user 1000:100, \d+ bytes$", output, re.M), output[-2000:]


def test_models(steps: Steps) -> None:
    output = steps.run("models")
    assert re.search(r"^smollm2-135m: (cached in )?/models/smollm2-135m\b", output, re.M), output[-2000:]
    assert (WORK / "models" / "smollm2-135m").is_dir()


def test_kernels(steps: Steps) -> None:
    output = steps.run("kernels")
    ran = re.search(r"^SPECSERVE_CPU_KERNEL=auto: this process runs (\w+)$", output, re.M)
    assert ran is not None and ran.group(1) != "torch", output[-2000:]  # our own kernels, built in the image
    assert "suffix trie: C++" in output
    for row in re.findall(r"^  \w+ +cpu yes  (.*)$", output, re.M):  # every build of a path this CPU has: built
        statuses = re.findall(r"\): ([^;]+)", row)
        assert all(status == "built" for status in statuses), row
    assert list((WORK / "models" / "kernels").glob("torch-*/*"))  # the builds, on the cache volume


def test_list(steps: Steps) -> None:
    output = steps.run("list")
    (row,) = [line for line in output.splitlines() if line.startswith("smollm2-135m ")]
    assert "no (run:" not in row and "/models/smollm2-135m" in row, output
    assert "cache: /models" in output


@pytest.mark.model
def test_once_equals_the_hosts_greedy_decoding(steps: Steps) -> None:
    output = steps.run("once")
    assert "Ray authentication: token in /home/ray/.ray/auth_token" in output  # token auth on in the image
    image = json.loads((WORK / "once.json").read_text())
    assert image["prompt"] == PROMPT and image["grpc"] == "127.0.0.1:9000"
    stats = image["stats"]
    assert stats["model"] == "smollm2-135m" and stats["draft"] == "ngram" and stats["contract"] == "greedy"
    host = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", PROMPT, "--model", "smollm2-135m", "--draft", "none",
         "--dtype", "bfloat16", "--max-tokens", str(MAX_TOKENS), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert host.returncode == 0, host.stderr[-3000:]
    (sample,) = json.loads(host.stdout)["samples"]
    assert image["token_ids"] == sample["token_ids"] and image["text"] == sample["text"]
    assert stats["finish_reason"] == sample["finish_reason"] and stats["output_tokens"] == len(sample["token_ids"])
