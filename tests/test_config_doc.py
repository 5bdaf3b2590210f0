"""docs/config.md is generated from the code (meshnode/cli/config_doc.py), and every command
and option of the CLI says what it does in --help."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import meshnode.serve.service  # noqa: F401  (imported at collection: ifaddr's import runs ldconfig)
from meshnode.assets import EXAMPLE_CONFIG, EXAMPLE_MODEL_PACKAGE, asset
from meshnode.cli import build_parser
from meshnode.cli import config_doc
from meshnode.config import parse_config
from meshnode.spec.strategy import PackageSpeculative

ROOT = Path(__file__).resolve().parent.parent


def test_docs_config_md_is_the_generated_text():
    generated = config_doc.render()
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == generated, (
        "docs/config.md is out of date: python -m meshnode.cli.config_doc > docs/config.md")


def test_every_config_key_is_documented_with_a_real_option():
    keys = config_doc.config_keys()
    assert set(keys) == set(config_doc.KEYS)
    known = {s for a in config_doc.serve_parser()._actions for s in a.option_strings}
    for _, options, _ in config_doc.KEYS.values():
        for o in (x.strip() for x in options.split(",")):
            assert o.startswith("$") or o in known, o


def test_every_documented_key_is_read_by_the_parser():
    # a file setting every documented key parses with no "unknown key" warning
    lines = ["[node]", 'name = "n"', "http_port = 1", "quic_port = 2", 'max_memory = "1GB"',
             "shutdown_grace = 5", "prefix_cache = 2", "busy_poll = true", "[http]", 'api_key = "k"', 'allowed_hosts = ["a"]', 'cors_origins = ["http://x"]',
             'max_body = "1MiB"', "max_queue = 3", 'keep_responses = "memory"', "[defaults.speculative]",
             'strategy = "ngram"',
             'mode = "on"', 'draft_model = "d.gguf"', "[defaults.speculative.window]",
             'policy = "fixed"', "initial = 2", "min = 1", "max = 3"]
    conf = parse_config("\n".join(lines))
    assert conf.warnings == ()
    documented = {k.split(".", 1)[1] for k in config_doc.KEYS if k.startswith(("node.", "http."))}
    assert documented == {ln.split(" =")[0] for ln in lines[1:15] if "=" in ln}
    assert conf.http.keep_responses == "memory"


def test_the_defaults_are_the_nodes_own():
    d = config_doc.defaults()
    assert d["node.http_port"] == 8642 and d["http.max_queue"] == 16
    assert d["speculative.strategy"] == "ngram" and d["speculative.window.max"] == 16


def test_example_config_parses_and_uses_real_keys():
    text = asset(EXAMPLE_CONFIG).read_text(encoding="utf-8")
    conf = parse_config(text, "config.toml")
    assert conf.warnings == ()
    assert conf.node.http_port == 8642 and conf.http.max_body == 4 * 2**20
    assert conf.model_speculative("qwen2.5-7b").window.initial == 6


def test_example_model_package_validates():
    doc = json.loads(asset(EXAMPLE_MODEL_PACKAGE).read_text(encoding="utf-8"))
    pkg = PackageSpeculative.from_dict(doc, origin="model-package.json")
    assert pkg.default == "qwen-draft" and pkg.strategies["qwen-draft"].type == "draft-model"


def _walk(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", helps.get(name)
                yield from _walk(sub, f"{path} {name}")
        else:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help


def test_every_command_and_option_has_help():
    entries = list(_walk(build_parser(), "meshnode"))
    assert any(p.startswith("meshnode service install --dry-run") for p, _ in entries)
    missing = [p for p, h in entries if h is None or (h != argparse.SUPPRESS and not str(h).strip())]
    assert missing == [], f"no --help text: {missing}"
