"""HTML building blocks: every piece of text passes through `esc` unless it is `Markup`.

Model answers, prompts, config values and file contents are untrusted text: an answer
such as `<script>` must show as text, never run. So the helpers here escape by default
and only `Markup` (HTML we built ourselves from escaped parts) goes through unchanged.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any, Iterable

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: .6em 0; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: .8em; }
figure { margin: 0; border: 1px solid #eee; padding: .3em; }
figure img { width: 100%; height: auto; }
figcaption { font-size: .8em; color: #555; }
.empty { padding: 3em 1em; text-align: center; color: #888; background: #fafafa; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; font-size: .85em; white-space: pre-wrap; }
pre.answer { margin: 0; padding: .2em .4em; }
.good { color: #146c2e; } .bad { color: #b00020; } .neutral { color: #555; }
.verdict { font-size: 1.15em; } .banner { background: #fff3cd; border: 1px solid #e0c060; padding: .6em; }
.note { color: #666; font-size: .9em; }
"""


class Markup(str):
    """HTML we assembled from escaped parts; `esc` and `table` pass it through unchanged.

    `Markup + text` escapes the text, so concatenation never smuggles raw text in.
    """

    def __add__(self, other: object) -> "Markup":
        return Markup(str.__add__(self, esc(other)))

    def __radd__(self, other: object) -> "Markup":
        return Markup(str.__add__(esc(other), self))


def esc(value: Any) -> Markup:
    """Escape any value for HTML text or attribute context (quotes included)."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape("" if value is None else str(value), quote=True))


def join(parts: Iterable[Any], sep: str = "") -> Markup:
    return Markup(sep.join(esc(p) for p in parts))


def tag(name: str, content: Any = "", **attrs: Any) -> Markup:
    """`<name attr="...">content</name>`; `class_` sets the class attribute."""
    text = "".join(f' {k.rstrip("_").replace("_", "-")}="{esc(v)}"' for k, v in attrs.items() if v is not None)
    return Markup(f"<{name}{text}>{esc(content)}</{name}>")


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def number(value: Any) -> str:
    """Short, readable numbers: 4 significant digits for floats, as-is for the rest."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, float):
        return str(value) if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


NUMERIC_TEXT = re.compile(r"^[+-]?\d[\d.,]*(%| pts)?$")  # '49.0%', '+18.0 pts': right-aligned like numbers


def cell(value: Any) -> Markup:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return tag("td", number(value), class_="num")
    if isinstance(value, str) and NUMERIC_TEXT.match(value):
        return tag("td", value, class_="num")
    return tag("td", value)


def table(headers: list[Any], rows: Iterable[list[Any]], row_headers: bool = False, **attrs: Any) -> Markup:
    """A table; with `row_headers` the first cell of each row is a `<th scope="row">`."""
    head = tag("tr", join(tag("th", h) for h in headers))
    body = []
    for row in rows:
        first, rest = (row[0], row[1:]) if row_headers else (None, row)
        lead = tag("th", first, scope="row") if row_headers else Markup("")
        body.append(tag("tr", lead + join(cell(v) for v in rest)))
    return tag("table", head + join(body), **attrs)


def key_value_table(mapping: dict[str, Any]) -> Markup:
    """Two columns; nested values are shown compactly rather than dropped."""
    return table(["", "value"], ([k, flat_value(v)] for k, v in mapping.items()), row_headers=True)


def flat_value(value: Any) -> Any:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {number(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(number(v) for v in value)
    return value


def pre(text: str, class_: str | None = None) -> Markup:
    return tag("pre", text, class_=class_)


def section(title: str, body: Any, level: int = 2, id_: str | None = None) -> Markup:
    return tag("section", tag(f"h{level}", title) + esc(body), id=id_)


def details(summary: str, body: Any, open_: bool = False) -> Markup:
    attrs = Markup(" open") if open_ else Markup("")
    return Markup(f"<details{attrs}>{tag('summary', summary)}{esc(body)}</details>")


def note(text: str) -> Markup:
    return tag("p", text, class_="note")


def page(title: str, body: Any) -> str:
    """A complete, self-contained document: inline CSS, no scripts, no external files."""
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head>\n<body>{tag('h1', title)}\n{esc(body)}\n</body></html>\n"
    )
