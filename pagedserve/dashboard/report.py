"""The dashboard page as one document with its CSS and JS inline: live (`render_page()`, which the
server sends at /dashboard: one response, so an API key in the address covers everything), or as a
self-contained report with a list of frames embedded, which it steps through (`render_report`)."""

from __future__ import annotations

import html
import json
from importlib import resources

# The files the server may serve, with their media types; nothing else under static/ is served.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}

# The tags of index.html that the report replaces with inline content.
_CSS_LINK = '<link rel="stylesheet" href="static/dashboard.css">'
_JS_SCRIPT = '<script src="static/dashboard.js"></script>'
_DEFAULT_TITLE = "pagedserve KV cache"


def static_file(name: str) -> tuple[bytes, str]:
    """One of the page's files as (content, media type). Any other name, a path included, raises
    KeyError: the name is looked up, never joined to a directory."""
    media_type = STATIC_FILES[name]
    return (resources.files(__package__) / "static" / name).read_bytes(), media_type


def _text(name: str) -> str:
    return static_file(name)[0].decode("utf-8")


def frames_json(frames: list[dict]) -> str:
    """The frames as JSON safe inside a <script> element: every "<" is written "\\u003c" (which
    JSON.parse reads back as "<"), so no "</script>" or "<!--" in a caption can end or bend it.
    NaN and infinities are refused: the browser's JSON.parse would reject the whole list."""
    return json.dumps(frames, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")


def render_report(frames: list[dict], title: str) -> str:
    """One HTML document that needs nothing else: the dashboard page with its CSS and JS inline and
    `frames` (each with its "caption") embedded as <script id="frames" type="application/json">."""
    return render_page(title, frames)


def render_page(title: str = _DEFAULT_TITLE, frames: list[dict] | None = None) -> str:
    """The page with its CSS and JS inline; with `frames`, they are embedded (replay), else the page
    reads the live event stream."""
    page = _text("index.html")
    css = _text("dashboard.css")
    js = _text("dashboard.js")
    for tag in (_CSS_LINK, _JS_SCRIPT, f"<title>{_DEFAULT_TITLE}</title>", f'<h1 id="title">{_DEFAULT_TITLE}</h1>'):
        if page.count(tag) != 1:
            raise RuntimeError(f"index.html no longer holds {tag!r} once; the report writer must follow it")
    # Inline code must not hold its own element's end tag.
    if "</style" in css.lower() or "</script" in js.lower():
        raise RuntimeError("the dashboard's CSS or JS holds a closing tag that would end its inline element")

    escaped_title = html.escape(title)
    page = page.replace(f"<title>{_DEFAULT_TITLE}</title>", f"<title>{escaped_title}</title>")
    page = page.replace(f'<h1 id="title">{_DEFAULT_TITLE}</h1>', f'<h1 id="title">{escaped_title}</h1>')
    page = page.replace(_CSS_LINK, "<style>\n" + css + "</style>")
    # The frames go before the code, which reads them as it starts.
    embedded = "" if frames is None else f'<script id="frames" type="application/json">{frames_json(frames)}</script>\n'
    page = page.replace(_JS_SCRIPT, embedded + "<script>\n" + js + "</script>")
    return page
