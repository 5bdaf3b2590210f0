"""The stage map: a bar over the model's layers showing who serves which range.

Each stage's share of the bar is filled with a glyph for its state (█ ready, ▓ loading,
▒ preparing, ░ assigned, ╳ failed, · stopped) and carries its label, so the map reads
without colour; uncovered layers show as ``-``. A ruler under the bar marks the stage
boundaries, and a legend lists each stage with its range, node, state and backend.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from meshnode.state import StageInfo, printable
from ui.format import STAGE_GLYPHS, STAGE_STYLES


class StageMap(Widget):
    DEFAULT_CSS = """
    StageMap { height: auto; width: 1fr; }
    """

    stages: reactive[tuple[StageInfo, ...]] = reactive((), layout=True)
    n_layers: reactive[int] = reactive(0, layout=True)
    labels: reactive[dict[str, str]] = reactive(dict, layout=True)

    def show(self, stages: Sequence[StageInfo], n_layers: int, labels: dict[str, str] | None = None) -> None:
        """``labels``: what to call each node, by node id (:func:`meshnode.state.node_labels`;
        a stage's own node name where missing)."""
        self.labels = dict(labels or {})
        self.stages = tuple(sorted(stages, key=lambda s: s.layer_start))
        self.n_layers = max(n_layers, max((s.layer_end for s in stages), default=0))

    def _label(self, s: StageInfo) -> str:
        return self.labels.get(s.node_id) or printable(s.node_name, 64)

    def get_content_height(self, container, viewport, width: int) -> int:
        if not self.n_layers:
            return 1
        return 2 + len(self.stages)

    def render(self) -> Text:
        width = max(self.size.width, 10)
        n = self.n_layers
        if not n:
            return Text("no model assigned", style="dim")
        # Columns per layer range.
        def col(layer: int) -> int:
            return round(layer * width / n)

        bar = Text()
        owner: list[StageInfo | None] = []
        for c in range(width):
            layer = min(n - 1, int(c * n / width))
            owner.append(next((s for s in self.stages if s.layer_start <= layer < s.layer_end), None))
        c = 0
        while c < width:
            s = owner[c]
            end = c
            while end < width and owner[end] is s:
                end += 1
            span = end - c
            if s is None:
                bar.append("-" * span, style="dim")
            else:
                glyph = STAGE_GLYPHS[s.state]
                label = f" S{s.index} {self._label(s)} "
                if len(label) > span:
                    label = f"S{s.index}" if span >= len(f"S{s.index}") else ""
                left = (span - len(label)) // 2
                style = STAGE_STYLES[s.state]
                bar.append(glyph * left, style=style)
                bar.append(label, style=f"bold reverse {style}")
                bar.append(glyph * (span - left - len(label)), style=style)
            c = end

        ruler = [" "] * (width + 4)
        marks = sorted({0, n, *(s.layer_start for s in self.stages), *(s.layer_end for s in self.stages)})
        last_end = -1
        for layer in marks:
            text = str(layer)
            pos = min(col(layer), width - len(text)) if layer == n else col(layer)
            if pos <= last_end:
                continue
            ruler[pos : pos + len(text)] = list(text)
            last_end = pos + len(text)
        lines = Text("\n").join([bar, Text("".join(ruler[:width]).rstrip(), style="dim")])
        for s in self.stages:
            legend = Text()
            style = STAGE_STYLES[s.state]
            legend.append(f"{STAGE_GLYPHS[s.state]} ", style=style)
            legend.append(f"S{s.index} ", style="bold")
            legend.append(f"[{s.layer_start},{s.layer_end})".ljust(10))
            legend.append(f"{self._label(s):<12} ")
            legend.append(s.state.value, style=style)
            if s.compute:
                legend.append(f" on {printable(s.compute, 32)}")
            if s.detail:
                legend.append(f"  {printable(s.detail)}", style="dim")
            lines.append("\n")
            lines.append_text(legend)
        lines.no_wrap = True
        lines.overflow = "ellipsis"
        return lines
