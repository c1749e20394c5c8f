"""The dashboard's report writer and static files: one self-contained document with the frames
embedded and readable back, and only the page's three files served."""

import json
import re
from html.parser import HTMLParser

import pytest

from pagedserve.dashboard.report import render_report, static_file


def frame(step: int, caption: str) -> dict:
    """A small consistent frame: 8 blocks of 4 tokens, two requests sharing block 0."""
    cells = [2, 1, 1, 3, 0, 0, 0, 0] if step else [0] * 8
    refs = [2, 1, 1, 0, 0, 0, 0, 0] if step else [0] * 8
    events = [
        {"seq": 0, "t": 0.1, "kind": "admit", "request": "cmpl-a-0", "blocks": [0, 1], "text": "admitted: 2 blocks"},
        {"seq": 1, "t": 0.2, "kind": "prefix_hit", "request": "cmpl-b-0", "blocks": [0], "text": "prefix hit: 4 tokens"},
    ][:step]
    return {
        "t": 0.25 * step,
        "block_size": 4,
        "num_blocks": 8,
        "cell_blocks": 1,
        "cells": cells,
        "cell_refs": refs,
        "counts": {s: cells.count(i) for i, s in enumerate(("free", "used", "shared", "cached"))},
        "engine": {
            "total_blocks": 8, "free_blocks": 5 if step else 8, "used_blocks": 3 if step else 0,
            "cached_free_blocks": 1 if step else 0, "usage": 0.375 if step else 0.0, "waste": 0.1,
            "prefix_hit_rate": 0.5, "cow_copies": 0, "num_running": 2 if step else 0, "num_waiting": 0,
            "num_preemptions": 0, "offloaded_blocks": 0,
        },
        "requests": [
            {"id": "cmpl-a-0", "status": "running", "num_tokens": 7, "blocks": [0, 1]},
            {"id": "cmpl-b-0", "status": "running", "num_tokens": 5, "blocks": [0, 2]},
        ] if step else [],
        "num_requests": 2 if step else 0,
        "events": events,
        "series": {"t": [0.25 * i for i in range(step + 1)], "usage": [0.0, 0.375, 0.375][: step + 1],
                   "waste": [0.1] * (step + 1), "prefix_hit_rate": [0.5] * (step + 1),
                   "running": [0, 2, 2][: step + 1], "waiting": [0] * (step + 1),
                   "tokens_per_s": [0.0, 80.5, 120.0][: step + 1]},
        "caption": caption,
    }


FRAMES = [
    frame(0, "An empty pool of 8 blocks."),
    frame(1, "A is admitted; B shares its first block (ref 2)."),
    frame(2, 'A caption with markup: </script><script>alert("x")</script> <!-- and & "quotes"'),
]


class Elements(HTMLParser):
    """The document's elements as (tag, attrs, text) for the ones that hold raw text (script, style)."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.texts: list[tuple[str, dict, str]] = []
        self._open = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style"):
            self._open = (tag, dict(attrs), [])

    def handle_data(self, data):
        if self._open:
            self._open[2].append(data)

    def handle_endtag(self, tag):
        if self._open and tag == self._open[0]:
            self.texts.append((tag, self._open[1], "".join(self._open[2])))
            self._open = None


def parse(document: str) -> Elements:
    p = Elements()
    p.feed(document)
    p.close()
    return p


def embedded_frames(document: str):
    els = parse(document)
    found = [text for tag, attrs, text in els.texts if tag == "script" and attrs.get("id") == "frames"]
    assert len(found) == 1
    return json.loads(found[0])


def test_report_is_one_self_contained_document():
    doc = render_report(FRAMES, "KV walk-through")
    assert doc.lstrip().lower().startswith("<!doctype html>")
    assert doc.lower().count("<html") == 1 and doc.lower().count("</html>") == 1
    for external in ("http://", "https://", 'src="http', "src='http", "@import", "url("):
        assert external not in doc
    els = parse(doc)
    # Nothing is fetched: no script with a src, no stylesheet link.
    assert not [a for t, a in els.tags if t == "script" and "src" in a]
    assert not [a for t, a in els.tags if t == "link" and a.get("rel") == "stylesheet"]
    assert "<title>KV walk-through</title>" in doc


def test_report_inlines_the_css_and_js():
    doc = render_report(FRAMES, "t")
    css = static_file("dashboard.css")[0].decode()
    js = static_file("dashboard.js")[0].decode()
    els = parse(doc)
    styles = [text for tag, _, text in els.texts if tag == "style"]
    scripts = [text for tag, attrs, text in els.texts if tag == "script" and attrs.get("type") != "application/json"]
    assert any(css.strip() in s for s in styles)
    assert any(js.strip() in s for s in scripts)
    # The frames come before the code that reads them as it starts.
    assert doc.index('id="frames"') < doc.index(js.strip()[:200])


def test_report_frames_parse_back_equal():
    doc = render_report(FRAMES, "t")
    assert embedded_frames(doc) == FRAMES
    assert render_report([], "empty") and embedded_frames(render_report([], "empty")) == []


def test_a_caption_cannot_end_the_frames_element():
    doc = render_report(FRAMES, "t")
    start = doc.index('<script id="frames" type="application/json">')
    end = doc.index("</script>", start)
    body = doc[start:end]
    assert "<" not in body[len('<script id="frames" type="application/json">'):]
    assert "\\u003c/script>" in body
    # The raw text between the tags is the whole JSON: the caption's end tag did not cut it.
    assert json.loads(body.split(">", 1)[1])[2]["caption"] == FRAMES[2]["caption"]
    # The only elements are the page's own: the caption added no script.
    assert sum(1 for t, _ in parse(doc).tags if t == "script") == sum(
        1 for t, _ in parse(render_report(FRAMES[:2], "t")).tags if t == "script"
    )


def test_title_is_escaped():
    doc = render_report(FRAMES, 'KV <b>"run"</b> & co')
    assert "<title>KV &lt;b&gt;&quot;run&quot;&lt;/b&gt; &amp; co</title>" in doc
    assert "<b>" not in doc


def test_report_refuses_nan():
    bad = [dict(FRAMES[1], engine=dict(FRAMES[1]["engine"], usage=float("nan")))]
    with pytest.raises(ValueError):
        render_report(bad, "t")


def test_the_page_keeps_the_contract_names():
    page = static_file("index.html")[0].decode()
    js = static_file("dashboard.js")[0].decode()
    ids = set(re.findall(r'id="([^"]+)"', page))
    for name in ("pool", "tooltip", "requests", "events", "status", "caption", "replay-prev", "replay-next",
                 "replay-slider", "replay-position", "chart-usage", "chart-waste", "chart-hit-rate",
                 "chart-requests", "chart-tokens", "counts-free", "counts-used", "counts-shared", "counts-cached",
                 "engine-free", "engine-used", "engine-cached", "engine-total"):
        assert name in ids, name
    assert 'type="range"' in page and 'href="static/dashboard.css"' in page and 'src="static/dashboard.js"' in page
    for fragment in ('"highlight"', "dataset.frames", "dataset.mode", "EventSource", '"/events"', "api_key"):
        assert fragment in js, fragment
    # Inline, the code must not hold its own end tag.
    assert "</script" not in js.lower() and "</style" not in static_file("dashboard.css")[0].decode().lower()


@pytest.mark.parametrize(
    "name, media_type",
    [("index.html", "text/html"), ("dashboard.css", "text/css"), ("dashboard.js", "text/javascript")],
)
def test_static_file_serves_the_three_files(name, media_type):
    body, media = static_file(name)
    assert isinstance(body, bytes) and body
    assert media.split(";")[0] == media_type


@pytest.mark.parametrize(
    "name", ["../pyproject.toml", "../report.py", "static/index.html", "/etc/passwd", "", "nope.js", "INDEX.HTML"]
)
def test_static_file_refuses_other_names(name):
    with pytest.raises((KeyError, ValueError)):
        static_file(name)
