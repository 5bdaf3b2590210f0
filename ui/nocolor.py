"""NO_COLOR that stays readable.

With ``NO_COLOR`` set, Textual maps every colour to the grey of the same luminance. Red
and blue text (rejected drafts, failures, assigned stages) then come out dark grey on a
near-black background: there, but unreadable. :class:`ReadableMonochrome` does the same
mapping and then lifts any foreground too close to its background to light (or dark)
grey. Meaning never rests on colour alone in this UI (every state has a glyph or a
word), so greys lose nothing; backgrounds (table cursor, status bar) stay as Textual
draws them.
"""

from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.filter import LineFilter, monochrome_style

MIN_CONTRAST = 0.3  # brightness difference (0..1) below which a foreground is lifted
_LIGHT = Color(230, 230, 230).rich_color
_DARK = Color(25, 25, 25).rich_color


@lru_cache(1024)
def readable_monochrome_style(style: Style) -> Style:
    mono = monochrome_style(style)
    if mono.color is None or mono.bgcolor is None or mono.color.is_default or mono.bgcolor.is_default:
        return mono
    fg = Color.from_rich_color(mono.color).brightness
    bg = Color.from_rich_color(mono.bgcolor).brightness
    if abs(fg - bg) >= MIN_CONTRAST:
        return mono
    return mono + Style.from_color(_LIGHT if bg < 0.5 else _DARK, None)


class ReadableMonochrome(LineFilter):
    def apply(self, segments: list[Segment], background: Color) -> list[Segment]:
        style_of = readable_monochrome_style
        return [Segment(text, style_of(style) if style else style, None) for text, style, _ in segments]
