"""The docs stay true: their routes, request fields, flags, metrics, profiles and paths are the code's, and the
quickstart's curl and SDK snippets run against the real server on the demo model."""
from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import typing

import httpx
import pytest

from tests.conftest import REPO

DOCS = REPO / "docs"
MINE = ("quickstart.md", "api.md", "parsers.md", "deployment.md", "architecture.md")
QUICKSTART_URL = "http://127.0.0.1:8000"
TOP_FOLDERS = ("server", "engine", "kernels", "parsers", "grammar", "tests", "benchmarks", "docs")


def text(name: str) -> str:
    return (DOCS / name).read_text()


def code_blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", doc, flags=re.S | re.M)


def without_code(doc: str) -> str:
    return re.sub(r"^```.*?^```", "", doc, flags=re.S | re.M)


def section(doc: str, heading: str) -> str:
    """The text under the heading line ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    lines = doc.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if re.match(rf"#{{1,{len(level)}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def table_names(block: str, prefix: str = "") -> list[str]:
    """The backticked names in the first cell of each table row (skipping the header and separator rows)."""
    names = []
    for line in block.splitlines():
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        first = line.split("|")[1]
        names += [n for n in re.findall(r"`([^`]+)`", first) if n.startswith(prefix)]
    return names


def shell_lines(doc: str) -> list[str]:
    """Logical lines of the bash blocks (continuations joined)."""
    out = []
    for block in code_blocks(doc, "bash"):
        out += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def slug(heading: str) -> str:
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


# ------------------------------------------------------------------------------------------------- the live server

@pytest.fixture(scope="module")
def live(demo_model_dir, tmp_path_factory):
    """The real app on the demo model, served as `ember serve` serves it: from a directory called `demo`, so the
    served name is `demo` by the same rule as for `~/.cache/ember/demo`."""
    from ember.server.app import BackgroundServer, create_app, load_runtime
    from ember.server.config import ServeConfig

    model_dir = tmp_path_factory.mktemp("docs") / "demo"
    model_dir.symlink_to(demo_model_dir, target_is_directory=True)
    config = ServeConfig(model_dir=model_dir, max_num_seqs=4, runtime_lora_updating=True)  # every route served
    app = create_app(load_runtime(config), config)
    server = BackgroundServer(app).start()
    yield server, app
    server.stop()


def test_quickstart_has_the_readme_commands():
    readme = (REPO / "README.md").read_text()
    quick = code_blocks(text("quickstart.md"), "bash")
    commands = [b for b in code_blocks(readme, "bash")]
    assert len(commands) == 2
    for cmd in commands:
        assert cmd in quick, cmd


def test_quickstart_curl_answers(live):
    server, _ = live
    (curl,) = [line for line in shell_lines(text("quickstart.md")) if line.startswith("curl ")]
    assert QUICKSTART_URL in curl
    r = subprocess.run(["bash", "-c", curl.replace(QUICKSTART_URL, server.url)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion" and body["model"] == "demo"
    assert body["usage"]["completion_tokens"] <= 32


@pytest.mark.parametrize("index", range(5))
def test_quickstart_python_snippets_run(live, index, capsys):
    server, _ = live
    snippets = code_blocks(text("quickstart.md"), "python")
    assert len(snippets) == 5  # openai chat + stream, forced tool call, responses, embeddings; anthropic
    code = snippets[index]
    assert QUICKSTART_URL in code
    exec(compile(code.replace(QUICKSTART_URL, server.url), f"quickstart.md snippet {index}", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), "the snippet printed nothing"
    if "get_weather" in code:
        name, args = out.split(" ", 1)
        assert name == "get_weather" and args.strip() in ("{'unit': 'celsius'}", "{'unit': 'fahrenheit'}")


# ---------------------------------------------------------------------------------------------------------- api.md

def test_every_route_is_documented_and_every_documented_route_exists(live):
    _, app = live
    routes = {(m, re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path))  # `{model_id:path}` is written `{model_id}`
              for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    documented = set(re.findall(r"`(GET|POST|PUT|DELETE|PATCH) (/[^`\s]*)`", text("api.md")))
    assert documented == routes


def test_request_field_tables_match_the_request_models(live):
    from fastapi.routing import APIRoute

    _, app = live
    doc = text("api.md")
    posts = [r for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods
             and "body" in typing.get_type_hints(r.endpoint)]  # not `POST .../cancel`, which takes none
    assert len(posts) >= 5
    for route in posts:
        model = typing.get_type_hints(route.endpoint)["body"]
        body = section(doc, f"## `POST {route.path}`")
        alias = re.search(r"An alias of `POST (/[^`]+)`", body)  # another path of a documented route
        if alias:
            body = section(doc, f"## `POST {alias.group(1)}`")
        fields = section(body, "### Request fields")
        documented = table_names(fields)
        assert len(documented) == len(set(documented)), f"{route.path}: a field is listed twice"
        assert set(documented) == set(model.model_fields), route.path


def test_error_examples_are_what_the_server_answers(live):
    server, _ = live
    openai_example, anthropic_example = (json.loads(b) for b in code_blocks(section(text("api.md"), "## Errors"),
                                                                               "json"))
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "usr", "content": "x"}]})
    assert r.status_code == 400 and r.json() == openai_example
    r = httpx.post(server.url + "/v1/messages", json={"model": "demo", "messages": [{"role": "user", "content": "x"}]})
    assert re.fullmatch(r"req_[0-9a-f]{32}", anthropic_example["request_id"])
    assert r.status_code == 400 and r.json() == {**anthropic_example, "request_id": r.headers["request-id"]}


# --------------------------------------------------------------------------------------------------- deployment.md

def _parsed(monkeypatch, args: list[str]):
    from ember.server import cli

    seen = []
    monkeypatch.setattr(cli, "serve", lambda config: seen.append(config) or 0)
    assert cli.main(["serve", *args]) == 0, args
    return seen[-1]


def test_flag_table_is_the_cli(capsys):
    from ember.server import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    real = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", capsys.readouterr().out)) - {"--help"}
    table = table_names(section(text("deployment.md"), "## `ember serve` flags"), prefix="--")
    assert len(table) == len(set(table))
    assert set(table) == real


def test_every_documented_command_line_parses(monkeypatch):
    checked = 0
    for name in MINE:
        for line in shell_lines(text(name)):
            for part in line.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["ember", "serve"]:
                    _parsed(monkeypatch, words[2:])
                    checked += 1
                elif words[:2] == ["docker", "run"] and "ember" in words:
                    config = _parsed(monkeypatch, words[words.index("ember") + 1:])
                    assert config.host == "0.0.0.0", line  # reachable from outside the container
                    checked += 1
    assert checked >= 3


def test_metrics_table_is_what_the_server_exports(live):
    server, _ = live
    httpx.get(server.url + "/health")
    exported = dict(re.findall(r"^# TYPE (ember_\w+) (\w+)$", httpx.get(server.url + "/metrics").text, flags=re.M))
    exported = {k: v for k, v in exported.items() if not k.endswith("_created")}
    rows = [line.split("|") for line in section(text("deployment.md"), "## Metrics").splitlines()
            if line.startswith("| `ember_")]
    documented = {cells[1].strip().strip("`"): cells[2].strip() for cells in rows}
    assert documented == exported


def test_dockerfile_facts_in_deployment_md():
    dockerfile = (REPO / "Dockerfile").read_text()
    doc = " ".join(text("deployment.md").split())  # line breaks of the prose do not matter
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, flags=re.M))
    assert f"nvidia/cuda:{args['CUDA_VERSION']}-runtime-ubuntu{args['UBUNTU_VERSION']}" in doc
    assert f"torch {args['TORCH_VERSION']}" in doc and args["TORCH_INDEX_URL"] in doc
    for name in ("CUDA_VERSION", "UBUNTU_VERSION", "TORCH_VERSION", "TORCH_INDEX_URL"):
        assert f"`{name}`" in doc
    for instruction in ("ENTRYPOINT", "CMD"):
        (value,) = re.findall(rf"^{instruction} (\[.*\])$", dockerfile, flags=re.M)
        assert f"`{instruction} {value}`" in doc or f"`{value}`" in doc, instruction
    (health,) = re.findall(r"(http://127\.0\.0\.1:\d+/\w+)", dockerfile)
    assert health in doc


# -------------------------------------------------------------------------------------------------- the rest

def test_parsers_md_example_prints_what_it_says(demo_model_dir, capsys):
    doc = text("parsers.md")
    (code,) = [c for c in code_blocks(doc, "python") if "demo.ensure()" in c]
    (promised,) = re.findall(r"^prints `(.*)`:", doc, flags=re.M)
    exec(compile(code.replace("demo.ensure()", repr(str(demo_model_dir))), "parsers.md example", "exec"), {})
    assert capsys.readouterr().out.strip() == promised


def test_parser_profiles_are_the_code_s():
    from ember.parsers.profiles import PROFILE_NAMES

    table = table_names(section(text("parsers.md"), "## Formats (profiles)"))
    profiles = [n for n in table if not n.startswith("<")]
    assert profiles == list(PROFILE_NAMES)
    (listed,) = re.findall(r"Parser profiles: ([^;]*);", text("deployment.md"))
    assert re.findall(r"`(\w+)`", listed) == list(PROFILE_NAMES)


def test_supported_architectures_are_the_registry():
    from ember.engine.models import MODEL_REGISTRY

    found = 0
    for name in MINE:
        for listed in re.findall(r"(?:Supported|Served) architectures[^:]*:([^.]*)\.", text(name).replace("\n", " ")):
            names = [n for n in re.findall(r"`(\w+)`", listed)
                     if n.endswith(("ForCausalLM", "ForConditionalGeneration"))]
            assert sorted(names) == sorted(MODEL_REGISTRY), name
            found += 1
    assert found >= 2


def test_named_paths_modules_and_links_exist():
    for name in MINE:
        doc = text(name)
        prose = without_code(doc)
        for token in re.findall(r"`([^`\s]+)`", prose):
            if token.split("/")[0] in TOP_FOLDERS and "/" in token:
                assert (REPO / token).exists(), f"{name}: {token}"
            elif re.fullmatch(r"ember(\.\w+)+", token):
                parts = token.split(".")
                for k in range(len(parts), 0, -1):
                    try:
                        obj = importlib.import_module(".".join(parts[:k]))
                    except ImportError:
                        continue
                    for attr in parts[k:]:
                        obj = getattr(obj, attr)
                    break
                else:
                    raise AssertionError(f"{name}: {token} does not resolve")
        for target, anchor in re.findall(r"\]\(([^)#\s:]+\.md)(?:#([^)]+))?\)", doc):
            assert (DOCS / target).exists(), f"{name}: link to {target}"
            if anchor:
                headings = [slug(h) for h in re.findall(r"^#+ (.*)$", text(target), flags=re.M)]
                assert anchor in headings, f"{name}: link to {target}#{anchor}"


def test_tables_render():
    """Every row of a table has as many cells as its header (a bare `|` inside a cell would split it)."""
    for name in MINE:
        header = None
        for n, line in enumerate(without_code(text(name)).splitlines(), 1):
            if not line.startswith("|"):
                header = None
                continue
            cells = len(re.findall(r"(?<!\\)\|", line))
            header = header or cells
            assert cells == header, f"{name}: table row {n} has {cells - 1} cells, its header {header - 1}"
