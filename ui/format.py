"""Pure formatting helpers shared by the screens (no Textual imports, easy to test)."""

from __future__ import annotations

import datetime as _dt
import logging

from rich.text import Text

from meshnode.state import DraftVerified, StageState, printable

_UNITS = ("B", "KB", "MB", "GB", "TB")


def peer_text(text: object, limit: int = 64) -> Text:
    """Text that came from another machine (peer and model names, details), ready for a
    cell or a label: control characters replaced (:func:`meshnode.state.printable`,
    shared with `meshnode status`) and never read as Rich markup."""
    return Text(printable(text, limit))

LEVEL_NAMES = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARN",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRIT",
}

LEVEL_STYLES = {
    logging.DEBUG: "dim",
    logging.INFO: "",
    logging.WARNING: "yellow",
    logging.ERROR: "bold red",
    logging.CRITICAL: "bold reverse red",
}

# A glyph per stage state, so the stage map reads without colour too.
STAGE_GLYPHS: dict[StageState, str] = {
    StageState.READY: "█",
    StageState.LOADING: "▓",
    StageState.PREPARING: "▒",
    StageState.ASSIGNED: "░",
    StageState.FAILED: "╳",
    StageState.STOPPED: "·",
}

STAGE_STYLES: dict[StageState, str] = {
    StageState.READY: "green",
    StageState.LOADING: "yellow",
    StageState.PREPARING: "yellow",
    StageState.ASSIGNED: "blue",
    StageState.FAILED: "red",
    StageState.STOPPED: "dim",
}


def fmt_bytes(n: float | int | None) -> str:
    """1536 -> '1.5 KB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_size(n: float | int | None) -> str:
    """Compact size for narrow columns: 7.5G, 512M, 24G."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            return f"{value:.0f}{unit}" if value >= 100 or unit == "B" else f"{value:.1f}{unit}".replace(".0", "")
        value /= 1024
    raise AssertionError("unreachable")


def fmt_rate(n: float | None) -> str:
    return "-" if n is None else f"{fmt_bytes(n)}/s"


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def fmt_ahead(used: int, sent: int) -> str:
    """Lookahead windows as 'used/sent' ('-' when none was sent)."""
    return f"{used}/{sent}" if sent else "-"


def short_id(request_id: str, keep: int = 8) -> str:
    """Long generated ids ('chatcmpl-<32 hex>') as '…' + their last ``keep`` characters."""
    return request_id if len(request_id) <= keep + 4 else "…" + request_id[-keep:]


def fmt_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def fmt_clock(t: float, tz: _dt.tzinfo | None) -> str:
    """Unix time as HH:MM:SS in ``tz`` (None: the local zone)."""
    return _dt.datetime.fromtimestamp(t, tz=tz).strftime("%H:%M:%S")


def level_name(level: int) -> str:
    return LEVEL_NAMES.get(level, logging.getLevelName(level))


def level_style(level: int) -> str:
    for threshold in sorted(LEVEL_STYLES, reverse=True):
        if level >= threshold:
            return LEVEL_STYLES[threshold]
    return "dim"


def show_token(token: str) -> str:
    """Make whitespace inside a token visible: newline and tab get symbols."""
    return token.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "")


def render_draft(ev: DraftVerified) -> Text:
    """One speculative window as a line.

    Accepted tokens follow a ``✓`` and are green; rejected ones follow a ``✗`` and are
    red and struck through; the target's bonus token follows ``→``. Each token sits in
    brackets so its spaces show. Markers make the line readable without colour.
    """
    n = len(ev.proposed)
    accepted = ev.proposed[: ev.n_accepted]
    rejected = ev.proposed[ev.n_accepted :]
    line = Text(no_wrap=False)
    line.append(f"{ev.request_id[-8:]:>8} ", style="dim")
    line.append(f"{ev.strategy:<6} ", style="bold")
    line.append(f"{ev.n_accepted}/{n} ", style="bold")
    if accepted:
        line.append("✓", style="bold green")
        for tok in accepted:
            line.append(f"[{show_token(tok)}]", style="green")
        line.append(" ")
    if rejected:
        line.append("✗", style="bold red")
        for tok in rejected:
            line.append(f"[{show_token(tok)}]", style="red strike")
        line.append(" ")
    line.append("→", style="bold cyan")
    line.append(f"[{show_token(ev.bonus)}]", style="cyan")
    return line
