"""config.toml parsing: values, defaults, clear errors, warnings for unknown keys."""

from __future__ import annotations

import logging

import pytest

from meshnode.config import (
    ConfigError,
    MeshnodeConfig,
    SpeculativeSettings,
    WindowSettings,
    load_config,
    parse_config,
    parse_size,
)
from meshnode.errors import MeshnodeError
from meshnode.paths import NodePaths

FULL = """
[node]
name = "laptop"
http_port = 8642
quic_port = 0
max_memory = "6GB"
shutdown_grace = 1.5

[defaults.speculative]
strategy = "ngram"
mode = "auto"
window = { policy = "adaptive", initial = 4, min = 2, max = 16 }

[models."qwen2.5-7b".speculative]
strategy = "qwen-draft"
draft_model = "qwen2.5-0.5b"
mode = "on"

[models.smol.speculative]
window = 8
"""


def test_full_file(tmp_path):
    paths = NodePaths.resolve(tmp_path)
    paths.config.mkdir(parents=True)
    paths.config_file.write_text(FULL)
    cfg = load_config(paths.config_file)
    assert cfg.path == str(paths.config_file) and cfg.warnings == ()
    assert cfg.node.name == "laptop" and cfg.node.http_port == 8642 and cfg.node.quic_port == 0
    assert cfg.node.max_memory == 6 * 10**9 and cfg.node.shutdown_grace == 1.5
    assert parse_config("[node]\nshutdown_grace = 0\n").node.shutdown_grace == 0.0
    assert cfg.defaults_speculative == SpeculativeSettings(
        "ngram", "auto", None, WindowSettings("adaptive", 4, 2, 16)
    )
    q = cfg.model_speculative("qwen2.5-7b")
    assert (q.strategy, q.mode, q.draft_model) == ("qwen-draft", "on", "qwen2.5-0.5b")
    assert cfg.model_speculative("smol").window == WindowSettings("fixed", 8, 8, 8)
    assert cfg.model_speculative("absent").is_empty


def test_missing_file_is_empty(tmp_path):
    cfg = load_config(tmp_path / "nope.toml")
    assert cfg.node.name is None and cfg.models == {} and cfg.defaults_speculative.is_empty
    assert parse_config("") == MeshnodeConfig()


def test_unknown_keys_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="meshnode.config"):
        cfg = parse_config(
            '[node]\nname = "a"\ncolour = "red"\n[extra]\nx = 1\n'
            "[defaults.speculative]\nwindow = { max = 8, maximum = 9 }\n",
            "c.toml",
        )
    assert cfg.node.name == "a" and cfg.defaults_speculative.window.max == 8
    assert any("node.colour" in w for w in cfg.warnings)
    assert any("extra" in w for w in cfg.warnings)
    assert any("defaults.speculative.window.maximum" in w for w in cfg.warnings)
    assert "c.toml" in caplog.text


@pytest.mark.parametrize(
    ("text", "key", "expect"),
    [
        ("[node]\nhttp_port = '8642'\n", "node.http_port", "integer"),
        ("[node]\nhttp_port = 70000\n", "node.http_port", "[0, 65535]"),
        ("[node]\nquic_port = true\n", "node.quic_port", "integer"),
        ("[node]\nname = 3\n", "node.name", "string"),
        ("[node]\nmax_memory = 'lots'\n", "node.max_memory", "size"),
        ("[node]\nshutdown_grace = -1\n", "node.shutdown_grace", "[0, 3600]"),
        ("[node]\nshutdown_grace = nan\n", "node.shutdown_grace", "number"),
        ("[node]\nshutdown_grace = '3s'\n", "node.shutdown_grace", "number"),
        ("node = 3\n", "node", "table"),
        ("[defaults.speculative]\nmode = 'maybe'\n", "defaults.speculative.mode", "auto, on, off"),
        ("[defaults.speculative]\nwindow = 64\n", "defaults.speculative.window", "[1, 32]"),
        ("[defaults.speculative]\nwindow = 'big'\n", "defaults.speculative.window", "table"),
        ("[defaults.speculative.window]\npolicy = 'greedy'\n", "defaults.speculative.window.policy", "adaptive"),
        ("[defaults.speculative.window]\nmin = 8\nmax = 4\n", "defaults.speculative.window", "larger"),
        ("[models.m.speculative]\nwindow = { initial = 0 }\n", "models.m.speculative.window.initial", "[1, 32]"),
        ("[models.m]\nspeculative = 1\n", "models.m.speculative", "table"),
    ],
)
def test_errors_name_file_key_and_type(text, key, expect):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "/etc/m/config.toml")
    e = ei.value
    assert isinstance(e, MeshnodeError)
    assert e.path == "/etc/m/config.toml" and e.key == key
    msg = str(e)
    assert msg.startswith(f"/etc/m/config.toml: {key}: ") and expect in msg


def test_invalid_toml_and_unreadable(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("[node\n", "x.toml")
    with pytest.raises(ConfigError, match="nested too deeply"):   # tomllib recurses per level
        parse_config("a = " + "[" * 100_000 + "]" * 100_000, "x.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[node]")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("6GB", 6 * 10**9), ("6gb", 6 * 10**9), ("6 G", 6 * 10**9), ("1.5GiB", 3 * 2**29),
        ("512MiB", 512 * 2**20), ("512MB", 512 * 10**6), ("100", 100), ("100B", 100),
        ("2TB", 2 * 10**12), ("4KiB", 4096), (1234, 1234),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "GB", "6XB", "-1GB", "1e9", True, -5, 3.5, "6 G B"])
def test_parse_size_errors(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)
