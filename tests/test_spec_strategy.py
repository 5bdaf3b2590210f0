"""resolve_strategy precedence, model-package parsing and --no-draft."""

from __future__ import annotations

import pytest

from meshnode.config import parse_config
from meshnode.spec.ngram import NGramDrafter
from meshnode.spec.strategy import (
    CliSpecOptions,
    PackageSpeculative,
    Proposer,
    SpecConfig,
    SpecConfigError,
    WindowPolicy,
    resolve_strategy,
)

PACKAGE = {
    "name": "qwen2.5-7b",
    "generation": {
        "speculative_decoding": {
            "default": "qwen-draft",
            "strategies": {
                "qwen-draft": {
                    "type": "draft-model",
                    "draft_model": "qwen2.5-0.5b.gguf",
                    "window_policy": {
                        "default": "adaptive", "initial_window": 6, "min_window": 2, "max_window": 12,
                    },
                },
                "lookup": {"type": "ngram", "window_policy": {"default": "fixed", "initial_window": 5}},
            },
        }
    },
}


def cfg(text: str):
    return parse_config(text, "/home/u/config.toml")


def test_builtin_default():
    c = resolve_strategy("m")
    assert c == SpecConfig("ngram", "ngram", "auto", None, WindowPolicy("adaptive", 4, 1, 16),
                           "strategy 'ngram' from built-in")
    assert c.enabled


def test_package_default():
    c = resolve_strategy("qwen2.5-7b", package=PACKAGE)
    assert (c.strategy_name, c.type, c.mode, c.draft_model) == (
        "qwen-draft", "draft-model", "auto", "qwen2.5-0.5b.gguf")
    assert c.window == WindowPolicy("adaptive", 6, 2, 12)
    assert "model package" in c.source


def test_config_defaults_beat_package():
    c = resolve_strategy(
        "qwen2.5-7b",
        config=cfg('[defaults.speculative]\nstrategy = "lookup"\n'),
        package=PACKAGE,
    )
    assert (c.strategy_name, c.type, c.draft_model) == ("lookup", "ngram", None)
    assert c.window == WindowPolicy("fixed", 5, 5, 5)
    assert "[defaults.speculative] (/home/u/config.toml)" in c.source


def test_model_section_beats_defaults_and_cli_beats_all():
    conf = cfg(
        '[defaults.speculative]\nstrategy = "none"\nwindow = { max = 8 }\n'
        '[models."qwen2.5-7b".speculative]\nstrategy = "qwen-draft"\nwindow = { max = 10 }\n'
    )
    c = resolve_strategy("qwen2.5-7b", config=conf, package=PACKAGE)
    assert c.strategy_name == "qwen-draft" and c.window.max == 10 and c.window.min == 2
    assert "window.max from [models.qwen2.5-7b.speculative]" in c.source
    # another model only sees the defaults
    assert resolve_strategy("other", config=conf).type == "none"
    cli = CliSpecOptions(strategy="ngram", mode="on", window_max=3)
    c = resolve_strategy("qwen2.5-7b", cli=cli, config=conf, package=PACKAGE)
    assert (c.strategy_name, c.type, c.mode) == ("ngram", "ngram", "on")
    assert c.window == WindowPolicy("adaptive", 3, 1, 3)  # initial clamped into [min, max]
    assert "strategy 'ngram' from CLI" in c.source


def test_cli_draft_model_overrides_package_path():
    c = resolve_strategy("q", cli=CliSpecOptions(draft_model="/m/tiny.gguf"), package=PACKAGE)
    assert c.draft_model == "/m/tiny.gguf"


def test_no_draft_turns_package_draft_off():
    c = resolve_strategy("q", cli=CliSpecOptions(no_draft=True), package=PACKAGE)
    assert (c.strategy_name, c.type, c.mode, c.draft_model) == ("ngram", "ngram", "auto", None)
    assert c.window == WindowPolicy("adaptive", 4, 1, 16)
    assert "--no-draft" in c.source
    # no-op for n-gram strategies
    assert resolve_strategy("q", cli=CliSpecOptions(no_draft=True)).type == "ngram"
    with pytest.raises(SpecConfigError, match="--no-draft"):
        resolve_strategy("q", cli=CliSpecOptions(no_draft=True, strategy="qwen-draft"), package=PACKAGE)


def test_mode_off_and_none():
    c = resolve_strategy("q", cli=CliSpecOptions(mode="off"), package=PACKAGE)
    assert (c.type, c.mode, c.enabled) == ("none", "off", False)
    c = resolve_strategy("q", config=cfg('[defaults.speculative]\nstrategy = "none"\n'))
    assert (c.strategy_name, c.type, c.mode) == ("none", "none", "off")


def test_errors():
    with pytest.raises(SpecConfigError, match="unknown speculative strategy 'medusa'.*known: draft-model"):
        resolve_strategy("q", cli=CliSpecOptions(strategy="medusa"), package=PACKAGE)
    with pytest.raises(SpecConfigError, match="no draft_model"):
        resolve_strategy("q", cli=CliSpecOptions(strategy="draft-model"))
    with pytest.raises(SpecConfigError, match="mode"):
        resolve_strategy("q", cli=CliSpecOptions(mode="sometimes"))
    with pytest.raises(SpecConfigError, match="larger than"):
        resolve_strategy("q", cli=CliSpecOptions(window_min=8), config=cfg('[defaults.speculative]\nwindow = { max = 4 }\n'))
    with pytest.raises(SpecConfigError, match=r"\[1, 32\]"):
        resolve_strategy("q", cli=CliSpecOptions(window_max=64))
    with pytest.raises(SpecConfigError, match="policy"):
        resolve_strategy("q", cli=CliSpecOptions(window_policy="greedy"))


def test_builtin_draft_model_strategy_with_config_draft():
    c = resolve_strategy("q", config=cfg('[models.q.speculative]\nstrategy = "draft-model"\ndraft_model = "d.gguf"\n'))
    assert (c.type, c.draft_model, c.mode) == ("draft-model", "d.gguf", "auto")


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"generation": []}, "generation: expected an object"),
        ({"generation": {"speculative_decoding": {"default": "x", "strategies": {}}}}, "names no strategy"),
        ({"generation": {"speculative_decoding": {"strategies": {"a": {"type": "medusa"}}}}}, "strategies.a.type"),
        ({"generation": {"speculative_decoding": {"strategies": {"a": {"type": "draft-model"}}}}}, "needs a draft_model"),
        ({"generation": {"speculative_decoding": {"strategies": {"a": {"type": "ngram", "window_policy": {"max_window": 99}}}}}},
         "window_policy.max_window"),
        ({"generation": {"speculative_decoding": {"strategies": {"a": {"type": "ngram", "window_policy": {"default": "x"}}}}}},
         "window_policy.default"),
    ],
)
def test_package_errors(doc, match):
    with pytest.raises(SpecConfigError, match=match):
        PackageSpeculative.from_dict(doc, "/m/model-package.json")


def test_package_without_speculative_section():
    p = PackageSpeculative.from_dict({"name": "x"})
    assert p.default is None and p.strategies == {}
    assert resolve_strategy("x", package=p).strategy_name == "ngram"


def test_ngram_drafter_is_a_proposer():
    d: Proposer = NGramDrafter()
    d.reset([1, 2, 1])
    assert d.propose([1], 1) == [2]
