"""The documents say what the code does: every command flag, `make` target, Helm value and
worker route they name exists, and every figure they quote from a committed result file is
that file's figure (issue 59: 19 claims had drifted from the code, the chart and the data).

What is checked, in README.md, docs/*.md, the packages' READMEs and the chart's README
(BENCHMARKS.md is the benchmarks' dated history, and quotes its own runs):
- a `kvtopo ...`, `kvtopo-operator ...` or `kvtopo-worker ...` command line in code (inline
  or in a block): its verbs exist (`kvtopo bench operator`) and each `--flag` is one of the
  options of that command;
- `make TARGET`: a target of the Makefile;
- a Helm value in backticks (`networkPolicy.enabled`, `nodes.watch`): a key of the chart's
  values.yaml;
- a worker route in backticks (`GET /v1/state`, `/v1/peers/{engine_id}`): a route the
  worker's control API serves;
- `FIGURES`: each figure a document quotes from a result file, rendered from that file.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "worker" / "README.md",
    ROOT / "operator" / "README.md",
    ROOT / "docker" / "README.md",
    ROOT / "helm" / "kvtopo" / "README.md",
]

# (document, result file, where in it (dotted; [name] picks a list item by its "variant",
# "size" or "name"), how the document writes it)
FIGURES: list[tuple[str, str, str, str]] = [
    ("README.md", "bench/results/vllm.json", "ratios.kvtopo.kv_bytes_per_s_ratio_large", "{:.2f}x"),
    ("README.md", "bench/results/vllm.json", "variants[kvtopo].first_request_s", "{:.3f} s"),
    ("README.md", "bench/results/vllm.json", "variants[nixl].first_request_s", "{:.3f} s"),
    ("README.md", "bench/results/vllm.json", "variants[kvtopo].replaced_prefill_s", "{:.3f} s"),
    ("docs/vllm.md", "bench/results/vllm.json", "variants[kvtopo].replaced_prefill_s", "{:.2f} s"),
    (
        "docs/vllm.md",
        "bench/results/vllm.json",
        "variants[kvtopo_no_operator].replaced_prefill_s",
        "{:.2f} s",
    ),
    ("README.md", "docs/drill-report.json", "requests_total", "{:,}"),
    (
        "README.md",
        "bench/results/operator.json",
        "sizes[64x2000].ready_to_connected_p99_s",
        "{:.3f} s",
    ),
    (
        "README.md",
        "bench/results/operator.json",
        "sizes[64x2000].rollout_vs_control_plane_only",
        "{:.2f}x",
    ),
    ("docs/drill.md", "docs/drill-report.json", "requests_total", "{:,}"),
    ("docs/drill.md", "docs/drill-report.json", "verified_bytes", "{:,}"),
    ("docs/vllm.md", "docs/drill-vllm-server.json", "requests_total", "{:,}"),
    ("docs/vllm.md", "docs/drill-vllm-server-3prompts.json", "requests_total", "{:,}"),
    ("docs/drill.md", "docs/drill-vllm-server.json", "requests_total", "{:,}"),
]


def code_spans(text: str) -> Iterator[str]:
    """The code of a document: each line of a fenced block, and each inline span."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield line
        else:
            yield from re.findall(r"`([^`]+)`", line)


# --- commands ------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _tree(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], set[str]]]:
    yield path, _options(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _tree(sub, (*path, name))


def _help_options(parse: Any) -> set[str]:
    """The `--options` a parser function's `--help` lists (it exits after printing)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse(["--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.getvalue()))


@pytest.fixture(scope="module")
def commands() -> dict[str, dict[tuple[str, ...], set[str]]]:
    from kvtopo.cli import build_parser
    from kvtopo_operator.main import parse_args as operator_args
    from kvtopo_worker.emulated import _parse_args as worker_args

    return {
        "kvtopo": dict(_tree(build_parser())),
        "kvtopo-operator": {(): _help_options(operator_args)},
        "kvtopo-worker": {(): _help_options(worker_args)},
    }


def command_lines(text: str) -> Iterator[tuple[str, list[str]]]:
    """(command, its words) for each kvtopo command line in the document's code."""
    for span in code_spans(text):
        # The command comes first on its line or after a shell separator (not as an argument,
        # as `helm install kvtopo ...` names the release).
        for m in re.finditer(
            r"(?:^\s*(?:\$\s*)?|[;|&(]\s*|/bin/)(kvtopo(?:-operator|-worker)?)(\s[^|;&#`]*)?", span
        ):
            words = (m.group(2) or "").split()
            yield m.group(1), words


def check_command(tree: dict[tuple[str, ...], set[str]], words: list[str]) -> list[str]:
    """What of `words` (a command's arguments) the command does not take."""
    path: tuple[str, ...] = ()
    for w in words:
        if w.startswith("-") or (*path, w) not in tree:
            break
        path = (*path, w)
    known = set().union(*(tree[path[:i]] for i in range(len(path) + 1)))
    bad = []
    for w in words:
        if w.startswith("--"):
            flag = w.split("=", 1)[0].rstrip(".,:)")
            if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in known:
                bad.append(f"{' '.join(path) or '(top)'} {flag}")
    return bad


def test_every_command_flag_the_docs_name_exists(
    commands: dict[str, dict[tuple[str, ...], set[str]]],
) -> None:
    problems = []
    for doc in DOCS:
        for command, words in command_lines(doc.read_text()):
            for bad in check_command(commands[command], words):
                problems.append(f"{doc.relative_to(ROOT)}: {command} {bad}")
    assert not problems, "\n".join(sorted(set(problems)))


# --- make targets, Helm values, routes -------------------------------------------------------


def test_every_make_target_the_docs_name_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    problems = []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            for target in re.findall(r"(?:^|[\s;&(])make ([a-z][a-z0-9-]*)", span):
                if target not in targets:
                    problems.append(f"{doc.relative_to(ROOT)}: make {target}")
    assert not problems, "\n".join(sorted(set(problems)))


VALUE_NAME = re.compile(r"(?:^|[\s=,])([a-z][A-Za-z0-9]*(?:\.[A-Za-z][A-Za-z0-9]*)+)")
FILE_SUFFIXES = {"key", "pem", "py", "Dockerfile", "yaml", "json", "md", "sh", "txt", "toml"}


def _leaves(tree: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict):
            out |= _leaves(value, path + ".")
    return out


def test_every_helm_value_the_docs_name_exists() -> None:
    values = yaml.safe_load((ROOT / "helm" / "kvtopo" / "values.yaml").read_text())
    keys = _leaves(values)
    problems = []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            for m in re.finditer(
                r"(?:^|[\s=,])([a-z][A-Za-z0-9]*(?:\.[A-Za-z][A-Za-z0-9]*)+)", span
            ):
                name = m.group(1)
                if name.rsplit(".", 1)[1] in FILE_SUFFIXES:
                    continue  # a file name (operator.pem), not a value
                if name.split(".")[0] in values and name not in keys:
                    problems.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not problems, "\n".join(sorted(set(problems)))


def _routes() -> set[tuple[str, str]]:
    out = set()
    for source in ("agent.py", "traffic.py"):
        text = (ROOT / "worker" / "kvtopo_worker" / source).read_text()
        for method, path in re.findall(r"add_(get|put|post|patch|delete)\(\"(/[^\"]*)\"", text):
            out.add((method.upper(), re.sub(r"\{[^}]*\}", "{}", path)))
    return out


def test_every_worker_route_the_docs_name_is_served() -> None:
    routes = _routes()
    paths = {p for _, p in routes}
    roots = {p.split("/")[2] for p in paths if p.startswith("/v1/")}  # metadata, peers, ...
    problems = []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            for m in re.finditer(
                r"(?:(GET|PUT|POST|PATCH|DELETE)\s+)?(?<![\w.:/])(/v1/([A-Za-z0-9_]+)[A-Za-z0-9_/{}-]*)",
                span,
            ):
                if m.group(3) not in roots:
                    continue  # another server's path (vLLM's, a router's)
                method, path = m.group(1), re.sub(r"\{[^}]*\}", "{}", m.group(2).rstrip("/"))
                if path not in paths or (method and (method, path) not in routes):
                    problems.append(f"{doc.relative_to(ROOT)}: {method or ''} {m.group(2)}")
    assert not problems, "\n".join(sorted(set(problems)))


# --- figures ------------------------------------------------------------------------------


def _at(data: Any, where: str) -> Any:
    for part in where.split("."):
        m = re.fullmatch(r"(\w+)\[([\w.-]+)\]", part)
        if m:
            items = data[m.group(1)]
            data = next(
                i for i in items if m.group(2) in (i.get("variant"), i.get("size"), i.get("name"))
            )
        else:
            data = data[part]
    return data


@pytest.mark.parametrize(("doc", "source", "where", "form"), FIGURES)
def test_every_figure_quoted_from_a_result_file_is_that_file_s(
    doc: str, source: str, where: str, form: str
) -> None:
    value = _at(json.loads((ROOT / source).read_text()), where)
    text = form.format(value)
    assert text in (ROOT / doc).read_text(), f"{doc} should quote {source} {where} as {text!r}"


def test_the_vllm_settings_table_says_each_default_as_the_connector_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/vllm.md's table of `kv_connector_extra_config` settings against what
    `KVTopoConnector` takes when a setting is left out (7314fe4's table said
    `lazy_handshake` defaults to true: it is off unless a peer token is given)."""
    from types import SimpleNamespace

    from kvtopo_worker.vllm.connector import _settings

    for name in ("KVTOPO_PEER_TOKEN_FILE", "KVTOPO_OPERATOR_KEY_FILE", "KVTOPO_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={}, kv_role="kv_consumer", engine_id="e"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(served_model_name="m", model="m"),
    )
    s = _settings(config)  # type: ignore[arg-type]
    rows = dict(
        re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", (ROOT / "docs" / "vllm.md").read_text(), re.M)
    )
    said = {
        "registration_timeout_s": s.push.registration_timeout_s,
        "kv_lease_s": s.push.kv_lease_s,
        "transfer_timeout_s": s.push.transfer_timeout_s,
        "handshake_timeout_s": s.handshake_timeout_s,
        "idle_ttl_s": s.idle_ttl_s,
        "control_port": s.control_port,
    }
    for name, value in said.items():
        assert float(rows[name].strip()) == float(value), (name, rows[name], value)
    assert s.lazy_handshake is False
    assert "off" in rows["lazy_handshake"] and "peer token" in rows["lazy_handshake"], rows[
        "lazy_handshake"
    ]


def test_every_event_reason_the_operator_records_is_in_the_install_guide() -> None:
    """docs/install.md lists every Event reason the operator records (7314fe4's README list
    lacked PeerUnhealthy and StatusWriteRefused)."""
    reasons = {
        # recorded under a reason chosen at run time (`logic`): an unusable engine's reason,
        # the Conflict condition, the handshakes failing past the deadline, a bad spec
        "EndpointRefused",
        "IdentityMismatch",
        "DuplicateEngineId",
        "WorkerAnswerRefused",
        "WorkerUnreachable",
        "Conflict",
        "HandshakeFailed",
        "InvalidSpec",
        "PeerUnhealthy",
    }
    for source in (ROOT / "operator" / "kvtopo_operator").glob("*.py"):
        reasons |= set(
            re.findall(r'Event\(\s*"(?:Warning|Normal)",\s*"([A-Za-z]+)"', source.read_text(), re.S)
        )
    doc = (ROOT / "docs" / "install.md").read_text()
    missing = sorted(r for r in reasons if f"`{r}`" not in doc)
    assert not missing, f"docs/install.md does not name the Events {missing}"
