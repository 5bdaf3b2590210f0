"""docs/config.md, generated from the code so that it cannot drift.

The keys are the fields of :mod:`meshnode.config`'s dataclasses; each one's default is
what the node really uses when neither the file nor a flag sets it (computed by the same
code ``meshnode serve`` runs: :func:`meshnode.cli.run._node_kwargs` for the node and HTTP
settings, :func:`meshnode.spec.strategy.resolve_strategy` for speculation); the option
that overrides it is looked up in ``meshnode serve``'s parser, so a renamed flag fails
here. Only the one-line meanings are written by hand, in :data:`KEYS`.

Regenerate: ``python -m meshnode.cli.config_doc > docs/config.md``
(``--check``: exit 1 when docs/config.md differs; tests/test_config_doc.py does the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from meshnode import config as cfg

# dotted key (as in the file) -> (type, option(s) that override it, meaning).
# Keys under [defaults.speculative] are written once, for both speculative tables.
KEYS: dict[str, tuple[str, str, str]] = {
    "node.name": ("string", "--name",
                  "name shown to peers and in the TUI; the only name mDNS announces (without it "
                  "the record carries none, and peers see the host name only after authenticating)"),
    "node.http_port": ("int 0-65535", "--port", "local OpenAI-compatible HTTP port (0: any free port)"),
    "node.quic_port": ("int 0-65535", "--quic-port", "UDP port of the mesh's QUIC links (0: any free port)"),
    "node.max_memory": ("size", "--max-memory",
                        "memory this node may use for model layers; a peer's Load that would need "
                        "more is refused"),
    "node.shutdown_grace": ("seconds 0-3600", "--shutdown-grace",
                            "at SIGINT/SIGTERM, how long requests in flight may still finish before "
                            "they are ended in-band (a second signal exits at once)"),
    "node.prefix_cache": ("int 0-4096", "--prefix-cache",
                          "finished requests whose KV is kept on every stage, so a prompt that "
                          "begins with one's tokens prefills only the rest (docs/api.md, \"Prefix "
                          "reuse\"); at most `--parallel` - 1 (1 with `--parallel 1`); 0: off"),
    "node.busy_poll": ("bool", "--busy-poll, --no-busy-poll",
                       "while tokens flow, the event loop waits for the network on a spinning CPU "
                       "core instead of sleeping: shorter hops on a split's token path, for a core "
                       "kept busy (docs/mesh.md, \"Busy polling\")"),
    "http.api_key": ("string", "--api-key, $MESHNODE_API_KEY",
                     "clients must send `Authorization: Bearer <key>`; a node bound off loopback "
                     "(`--host`) refuses to start without one. Keep the file private (mode 0600)"),
    "http.allowed_hosts": ("list of strings", "--allow-host",
                           "more `Host` names the endpoint answers to (loopback names and IP "
                           "addresses always work; `\"*\"` turns the check off)"),
    "http.cors_origins": ("list of strings", "--cors-origin",
                          "web-page origins allowed to call the API (none: no CORS headers, "
                          "foreign `Origin` refused)"),
    "http.max_body": ("size (>= 1KiB)", "--max-body", "largest request body"),
    "http.max_queue": ("int >= 0", "--max-queue",
                       "requests waiting beyond `--parallel`; later ones get 429"),
    "http.keep_responses": ('`"disk"` or `"memory"`', "--keep-responses",
                            "where the Responses API's kept answers live (docs/api.md, \"Kept "
                            "responses\"): on disk a restarted node still continues them"),
    "models.share": ("bool", "--no-share",
                     "members may list this node's models and pull them or any layer package of "
                     "them (docs/models.md, \"Sharing\"); false: nothing is listed or served"),
    "speculative.strategy": ("string", "--spec",
                             "`ngram`, `draft-model`, `none`, or a strategy defined by the model package"),
    "speculative.mode": ('`"auto"` \\| `"on"` \\| `"off"`', "--spec-mode",
                         "`auto`: the auto policy decides when to draft; `on`: always; `off`: never"),
    "speculative.draft_model": ("string", "--draft-model",
                                "draft model path or name (for draft-model strategies)"),
    "speculative.window.policy": ('`"adaptive"` \\| `"fixed"`', "--draft-policy",
                                  "adaptive grows/shrinks within [min, max] and is capped by the "
                                  "route's cost curve; fixed always uses `initial`"),
    "speculative.window.initial": ("int 1-32", "--draft-initial", "first window (the size of a fixed window)"),
    "speculative.window.min": ("int 1-32", "--draft-min", "smallest adaptive window"),
    "speculative.window.max": ("int 1-32", "--draft-max",
                               "largest adaptive window; 32 is a hard limit (batch invariance)"),
}

# Defaults that are not a value but a behaviour.
_UNSET = {
    "node.name": "none (the host name, shown after authenticating)",
    "node.max_memory": "free RAM",
    "node.prefix_cache": "`--parallel` - 1 (1 with `--parallel 1`)",
    "http.api_key": "none",
    "speculative.draft_model": "none (the strategy's)",
}


def config_keys() -> list[str]:
    """Every key the config dataclasses hold, dotted (``speculative.*``: both tables)."""
    keys = [f"node.{f.name}" for f in dataclasses.fields(cfg.NodeSettings)]
    keys += [f"http.{f.name}" for f in dataclasses.fields(cfg.HttpSettings)]
    keys.append("models.share")
    for f in dataclasses.fields(cfg.SpeculativeSettings):
        if f.name == "window":
            keys += [f"speculative.window.{w.name}" for w in dataclasses.fields(cfg.WindowSettings)]
        else:
            keys.append(f"speculative.{f.name}")
    return keys


def serve_parser() -> argparse.ArgumentParser:
    from meshnode.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def defaults() -> dict[str, object]:
    """What the node uses for each key when neither config.toml nor a flag sets it."""
    from meshnode.cli.run import _node_kwargs
    from meshnode.paths import NodePaths
    from meshnode.spec.strategy import resolve_strategy

    args = serve_parser().parse_args(["--headless", "--no-model"])
    with tempfile.TemporaryDirectory() as home:      # no config.toml: only the code's defaults
        kw = _node_kwargs(args, NodePaths.resolve(home))
    sec = kw["http_security"]
    spec = resolve_strategy("any-model")
    return {
        "node.name": kw["name"], "node.http_port": kw["http_port"], "node.quic_port": kw["port"],
        "node.max_memory": kw["max_memory"], "node.shutdown_grace": kw["shutdown_grace"],
        "node.prefix_cache": kw["service"].prefix_cache if kw["service"] else None,
        "node.busy_poll": False if args.busy_poll is None else args.busy_poll,   # cli/run.py: loop_factory
        "http.api_key": sec.api_key, "http.allowed_hosts": list(sec.allowed_hosts),
        "http.cors_origins": list(sec.cors_origins), "http.max_body": sec.max_body,
        "http.max_queue": kw["service"].max_queue if kw["service"] else _max_queue(args),
        "http.keep_responses": kw["keep_responses"],
        "models.share": kw["share"],
        "speculative.strategy": spec.strategy_name, "speculative.mode": spec.mode,
        "speculative.draft_model": spec.draft_model,
        "speculative.window.policy": spec.window.kind, "speculative.window.initial": spec.window.initial,
        "speculative.window.min": spec.window.min, "speculative.window.max": spec.window.max,
    }


def _max_queue(args: argparse.Namespace) -> int:
    from meshnode.cli.run import _http_security

    return _http_security(args, cfg.HttpSettings())[1]


def _show(key: str, value: object) -> str:
    if value is None:
        return _UNSET.get(key, "none")
    if isinstance(value, list):
        return "none" if not value else ", ".join(f"`{v}`" for v in value)
    if key.endswith(("max_body", "max_memory")) and isinstance(value, int) and value % 2**20 == 0:
        return f"`{value // 2**20}MiB`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _table(keys: list[str], prefix: str, values: dict[str, object]) -> str:
    rows = ["| key | type | default | option | meaning |", "|-----|------|---------|--------|---------|"]
    for key in keys:
        typ, option, meaning = KEYS[key]
        opts = ", ".join(f"`{o.strip()}`" for o in option.split(","))
        rows.append(f"| `{key[len(prefix):]}` | {typ} | {_show(key, values[key])} | {opts} | {meaning} |")
    return "\n".join(rows)


def render() -> str:
    from meshnode.assets import EXAMPLE_CONFIG, asset

    keys = config_keys()
    missing = [k for k in keys if k not in KEYS]
    if missing:
        raise SystemExit(f"config_doc: no meaning written for {', '.join(missing)} (add them to KEYS)")
    known = {s for a in serve_parser()._actions for s in a.option_strings}
    stale = [o for _, opts, _ in KEYS.values() for o in (x.strip() for x in opts.split(","))
             if o.startswith("--") and o not in known]
    if stale:
        raise SystemExit(f"config_doc: meshnode serve has no option {', '.join(stale)} (fix KEYS)")
    values = defaults()
    example = asset(EXAMPLE_CONFIG).read_text(encoding="utf-8").rstrip("\n")
    node = [k for k in keys if k.startswith("node.")]
    http = [k for k in keys if k.startswith("http.")]
    spec = [k for k in keys if k.startswith("speculative.") and ".window." not in k]
    window = [k for k in keys if k.startswith("speculative.window.")]
    return f"""\
# Configuration file

<!-- Generated by `python -m meshnode.cli.config_doc > docs/config.md` from meshnode/config.py,
     the serve options and the node's defaults; tests/test_config_doc.py fails when it differs. -->

`config.toml` in the node's config directory (`NodePaths.config_file`: the platform
config dir, e.g. `~/.config/meshnode/config.toml` on Linux and
`~/Library/Application Support/meshnode/config.toml` on macOS, or
`<home>/config/config.toml` with `--home DIR` / `MESHNODE_HOME`). The file and every key
in it are optional; command-line options override it. Read with
`meshnode.config.load_config(path)` (a missing file is an empty config).

- A wrong type or value is a `ConfigError` (a `MeshnodeError`, printed as one line) naming
  the file, the dotted key and what was expected, e.g.
  `/home/u/.config/meshnode/config.toml: node.http_port: expected an integer in [0, 65535], got '8642'`.
- An unknown key is a warning (logged by `meshnode.config` and listed in
  `MeshnodeConfig.warnings`), not an error, so older nodes read newer files.
- "default" is what the node uses when neither the file nor the option sets the key.

## Example

The wheel installs this file as `meshnode_assets/examples/config.toml` (`assets/examples/` in a checkout).

```toml
{example}
```

## `[node]`

{_table(node, "node.", values)}

Sizes (`parse_size`): a number with an optional unit, case-insensitive, spaces allowed.
`B`; SI `K`/`KB`, `M`/`MB`, `G`/`GB`, `T`/`TB` are powers of 1000; IEC `KiB`, `MiB`,
`GiB`, `TiB` are powers of 1024. `"6GB"` = 6 000 000 000, `"1.5GiB"` = 1 610 612 736.

## `[http]`

The OpenAI endpoint's protections (docs/api.md, "Security"). `MESHNODE_API_KEY` sits
between the option and the file.

{_table(http, "http.", values)}

## `[models]`

{_table(["models.share"], "models.", values)}

## `[defaults.speculative]` and `[models.<name>.speculative]`

The same keys in both; a model's section wins over the defaults, options win over both,
and both win over the model package (see docs/speculative.md, "precedence"). Quote model
names that contain dots: `[models."qwen2.5-7b".speculative]`.

{_table(spec, "speculative.", values)}
| `window` | table or int | | | verify window policy (below); an int `n` means a fixed window of `n` |

`window` table (also writable as `[defaults.speculative.window]`):

{_table(window, "speculative.window.", values)}

`min` larger than `max` in the same table is an error.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshnode.cli.config_doc",
                                description="print docs/config.md, generated from the code")
    p.add_argument("--check", metavar="FILE", nargs="?", const="docs/config.md", default=None,
                   help="exit 1 when FILE (default docs/config.md) differs from the generated text")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if Path(args.check).read_text(encoding="utf-8") != text:
            print(f"{args.check} is out of date: python -m meshnode.cli.config_doc > {args.check}",
                  file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
