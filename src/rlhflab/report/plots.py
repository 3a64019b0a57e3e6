"""Small PNG line plots embedded as data URIs, so a report is one file that opens offline.

Figures are built with matplotlib's object API (`Figure` + the Agg canvas) rather than
pyplot: the Agg canvas is used explicitly, so it works headless without
`matplotlib.use("Agg")` — which would also switch the backend of a notebook that
imports rlhflab — and no global figure registry fills up across many plots.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlhflab.report.html import Markup, esc, tag
from rlhflab.report.series import Series

FIGSIZE = (4.6, 2.9)  # inches; at DPI this is ~410x260 px, sharp in a 3-4 column grid
DPI = 90
MARKER_BELOW = 30  # sparse series (evaluations every N updates) get point markers


@dataclass(frozen=True)
class Line:
    label: str
    series: Series


def png_data_uri(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def line_plot(title: str, lines: list[Line], marks: list[float] | None = None, xlabel: str = "step") -> str | None:
    """PNG data URI of the lines with vertical alarm marks; None when no line has a finite point."""
    drawn = [line for line in lines if line.series.values]
    if not drawn:
        return None
    fig = Figure(figsize=FIGSIZE, layout="tight")
    ax = fig.add_subplot()
    for line in drawn:
        marker = "o" if len(line.series.values) < MARKER_BELOW else None
        ax.plot(line.series.steps, line.series.values, label=line.label, marker=marker, markersize=3, linewidth=1.3)
    for i, step in enumerate(marks or []):
        ax.axvline(step, color="#d62728", linestyle="--", linewidth=1, alpha=0.7, label="alarm" if i == 0 else None)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if len(drawn) > 1 or marks:
        ax.legend(fontsize=7)
    return png_data_uri(fig)


def panel(title: str, lines: list[Line], marks: list[float] | None = None, xlabel: str = "step") -> Markup:
    """One grid cell: the plot, or 'no finite values' when every point was NaN / inf / missing."""
    uri = line_plot(title, lines, marks, xlabel)
    dropped = sum(line.series.dropped for line in lines)
    caption = title + (f" ({dropped} non-finite point(s) dropped)" if dropped else "")
    if uri is None:
        body = tag("div", f"{title}: no finite values", class_="empty")
    else:
        body = Markup(f'<img src="{esc(uri)}" alt="{esc(title)}">')
    return tag("figure", body + tag("figcaption", caption))


def grid(panels: list[Markup]) -> Markup:
    return tag("div", Markup("".join(panels)), class_="grid")
