"""The KV dashboard's page in headless Chromium: live on a real server while requests share a prefix,
fork and copy on write; a model with KV cache groups (each block's group, a table per group); behind
an API key; and the walk-through's replay page stepped through.

The tests read the page only through the names of the dashboard's contract (ids, classes,
data-attributes). One `page.evaluate` runs between two renders, so the figures one call reads all come
from the same frame."""

from __future__ import annotations

import re
import threading
import time

import pytest
from playwright.sync_api import expect

from pagedserve.config import EngineConfig
from pagedserve.dashboard.walkthrough import walkthrough_frames
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints import cli
from tests.entrypoints.openai.server_harness import MODEL, read_metrics, serve_engine, serve_small_pool

pytestmark = pytest.mark.slow

WAIT_MS = 60_000  # for anything the page should show: generous, the machine may be busy
STATES = ("free", "used", "shared", "cached")
# Six sentences and a question: 76 tokens, four full blocks of 16 and a partial one. The partial block
# is what the samples copy on write; the full ones are what the prefix cache keeps.
SHARED_PREFIX = "You are a careful assistant who answers in one short sentence. " * 6

# What the page shows at one moment: cells per state, the counts and the engine's figures as text.
FIGURES_JS = """() => {
  const text = (id) => document.getElementById(id).textContent;
  const cells = {};
  for (const cell of document.querySelectorAll('#pool .cell'))
    cells[cell.dataset.state] = (cells[cell.dataset.state] || 0) + 1;
  return {
    frames: document.body.dataset.frames, mode: document.body.dataset.mode,
    cells, num_cells: document.querySelectorAll('#pool .cell').length,
    counts: {free: text('counts-free'), used: text('counts-used'), shared: text('counts-shared'),
             cached: text('counts-cached')},
    engine: {free: text('engine-free'), used: text('engine-used'), cached: text('engine-cached'),
             total: text('engine-total')},
  };
}"""


def _integer(text: str) -> int:
    assert re.fullmatch(r"\d+", text), f"not a plain integer: {text!r}"
    return int(text)


def figures(page) -> dict:
    """The page's figures at one moment, checked against each other: one cell per block here, so the
    cells per state are the counts, and the counts add up to the engine's own counters."""
    raw = page.evaluate(FIGURES_JS)
    assert set(raw["cells"]) <= set(STATES), raw["cells"]
    counts = {s: _integer(raw["counts"][s]) for s in STATES}
    engine = {k: _integer(v) for k, v in raw["engine"].items()}
    assert {s: raw["cells"].get(s, 0) for s in STATES} == counts, raw
    assert counts["free"] + counts["cached"] == engine["free"], raw
    assert counts["used"] + counts["shared"] == engine["used"], raw
    assert counts["cached"] == engine["cached"], raw
    assert raw["num_cells"] == engine["total"] == sum(counts.values()), raw
    return {"frames": _integer(raw["frames"]), "mode": raw["mode"], "counts": counts, "engine": engine}


def wait_for_frames(page, more_than: int) -> None:
    page.wait_for_function("n => Number(document.body.dataset.frames) > n", arg=more_than, timeout=WAIT_MS)


def open_live(page, url: str) -> dict:
    refused = []  # what the server turned down, to say why a page never went live
    page.on("response", lambda response: response.status >= 400 and refused.append(f"{response.status} {response.url}"))
    page.goto(url)
    try:
        expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
    except AssertionError as e:
        raise AssertionError(f"the page did not go live; responses refused: {refused}") from e
    wait_for_frames(page, 0)
    shown = figures(page)
    assert shown["mode"] == "live"
    return shown


@pytest.fixture(scope="module")
def small_server(embedded_model, embedded_tokenizer):
    with serve_small_pool(embedded_model, embedded_tokenizer, num_kv_blocks=64) as server:
        yield server


def test_the_live_page_shows_sharing_forks_copies_and_the_pool_coming_back(small_server, page, screenshot_dir):
    idle = open_live(page, f"{small_server.url}/dashboard")
    assert idle["engine"]["total"] == 64 and idle["engine"]["used"] == 0
    block_size = small_server.engine.config.block_size
    fruit = SHARED_PREFIX + "Name a fruit."
    assert len(small_server.engine.tokenizer.encode(fruit)) % block_size != 0  # a partial block to copy

    client = small_server.client()
    client.completions.create(model=MODEL, prompt=SHARED_PREFIX + "Name a colour.", max_tokens=4)
    # Its full blocks stay in the prefix cache once it is done.
    expect(page.locator("#pool .cell[data-state=cached]").first).to_be_attached(timeout=WAIT_MS)

    done, failures = threading.Event(), []

    def samples():
        try:
            client.completions.create(model=MODEL, prompt=fruit, max_tokens=160, n=3, temperature=1.0, seed=1,
                                      extra_body={"ignore_eos": True})
        except Exception as e:  # reported by the test's thread below
            failures.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=samples, daemon=True)
    thread.start()
    try:
        # The prefix's blocks are held by the three samples: a shared cell shows its ref count.
        page.wait_for_function("""() => [...document.querySelectorAll('#pool .cell[data-state=shared]')]
                                  .some(c => Number(c.textContent) >= 3)""", timeout=WAIT_MS)
        shared = page.evaluate("""() => [...document.querySelectorAll('#pool .cell[data-state=shared]')]
                                  .map(c => ({text: c.textContent, ref: c.dataset.ref}))""")
        assert shared and all(c["text"] == c["ref"] and int(c["ref"]) >= 2 for c in shared), shared
        busy = figures(page)
        assert busy["counts"]["shared"] >= 1 and busy["engine"]["used"] > 0

        # n=3: the first sample is forked twice, and the samples' first tokens copy the shared partial block.
        expect(page.locator("#events .event[data-kind=fork]")).to_have_count(2, timeout=WAIT_MS)
        expect(page.locator("#events .event[data-kind=cow]").first).to_be_attached(timeout=WAIT_MS)

        # Hovering a running request highlights exactly the pool cells of its block table.
        running = page.locator("#requests .request[data-status=running]")
        expect(running).to_have_count(3, timeout=WAIT_MS)
        running.first.hover()
        hovered = page.evaluate("""() => {
          const row = document.querySelector('#requests .request:hover');
          return row && {status: row.dataset.status,
                         blocks: [...row.querySelectorAll('.req-block')].map(b => b.dataset.block),
                         highlighted: [...document.querySelectorAll('#pool .cell.highlight')]
                                        .map(c => c.dataset.block)};
        }""")
        assert hovered is not None and hovered["status"] == "running", hovered
        assert hovered["blocks"] and sorted(hovered["highlighted"], key=int) == sorted(set(hovered["blocks"]), key=int)
        page.mouse.move(2, 2)  # off the requests: the highlight goes
        expect(page.locator("#pool .cell.highlight")).to_have_count(0, timeout=WAIT_MS)

        # Hovering a shared cell: the tooltip lists its owners, each with the logical block and its tokens.
        page.locator("#pool .cell[data-state=shared]").first.hover()
        expect(page.locator("#tooltip")).to_be_visible(timeout=WAIT_MS)
        tip = page.evaluate("""() => {
          const cell = document.querySelector('#pool .cell:hover');
          const tables = {};
          for (const row of document.querySelectorAll('#requests .request'))
            tables[row.dataset.request] = [...row.querySelectorAll('.req-block')].map(b => b.dataset.block);
          return {text: document.getElementById('tooltip').innerText, state: cell && cell.dataset.state,
                  block: cell && cell.dataset.block, tables};
        }""")
        # "<request id> block <logical index> tokens <first>-<last>", one line per owner.
        owner_line = re.compile(r"(.+) block (\d+) tokens (\d+)-(\d+)")
        owners = [m.groups() for m in (owner_line.fullmatch(line.strip()) for line in tip["text"].splitlines()) if m]
        assert tip["state"] == "shared" and len({o[0] for o in owners}) >= 2, tip
        for request, index, first, last in owners:
            assert tip["tables"][request][int(index)] == tip["block"], (request, index, tip)
            assert int(first) == int(index) * block_size and int(first) <= int(last) < int(first) + block_size
        page.screenshot(path=screenshot_dir / "live_sharing.png", full_page=True)
    finally:
        assert done.wait(300), "the samples did not finish"
    assert not failures, failures

    # Everything done: the pool is free again, its prefix blocks cached, and the page agrees with /metrics.
    page.mouse.move(2, 2)
    page.wait_for_function("""() => document.getElementById('engine-used').textContent === '0'
        && [...document.querySelectorAll('#pool .cell')].every(c => ['free', 'cached'].includes(c.dataset.state))""",
                           timeout=WAIT_MS)
    end = figures(page)
    assert end["engine"]["free"] == end["engine"]["total"] == 64 and end["counts"]["cached"] > 0
    expect(page.locator("#requests .request")).to_have_count(0, timeout=WAIT_MS)
    metrics = read_metrics(small_server.url)
    assert metrics["pagedserve:kv_cache_free_blocks"] == metrics["pagedserve:kv_cache_total_blocks"] == 64
    page.screenshot(path=screenshot_dir / "live_idle.png", full_page=True)


def test_the_page_streams_with_the_api_key_in_its_address(embedded_model, embedded_tokenizer, page):
    with serve_small_pool(embedded_model, embedded_tokenizer, num_kv_blocks=32, api_key="k") as server:
        first = open_live(page, f"{server.url}/dashboard?api_key=k")
        assert first["engine"]["total"] == 32
        server.client(api_key="k").completions.create(model=MODEL, prompt="Hello", max_tokens=8)
        wait_for_frames(page, first["frames"])
        expect(page.locator("#status")).to_have_text("live")
        figures(page)


def test_the_walkthrough_replays_step_by_step(page, screenshot_dir, tmp_path):
    path = tmp_path / "walkthrough.html"
    cli.main(["demo", "--html", str(path)])
    frames = walkthrough_frames()
    n = len(frames)
    kinds = [[e["kind"] for e in frame["events"]] for frame in frames]
    fork_step = next(i for i, k in enumerate(kinds) if "fork" in k)
    cow_step = next(i for i, k in enumerate(kinds) if "cow" in k)
    events_so_far = [len({e["seq"] for f in frames[:i + 1] for e in f["events"]}) for i in range(n)]

    page.goto(path.as_uri())
    position, caption = page.locator("#replay-position"), page.locator("#caption")
    events = page.locator("#events .event")
    expect(position).to_have_text(f"1 / {n}", timeout=WAIT_MS)
    for i, frame in enumerate(frames):
        if i:
            page.locator("#replay-next").click()
        expect(position).to_have_text(f"{i + 1} / {n}", timeout=WAIT_MS)
        expect(caption).to_have_text(frame["caption"])
        shown = figures(page)
        assert shown["mode"] == "replay" and shown["counts"] == frame["counts"]
        expect(events).to_have_count(events_so_far[i])
        if i == fork_step:  # A, B and B's two forks hold the system prompt's blocks
            expect(page.locator('#pool .cell[data-state=shared][data-ref="4"]').first).to_have_text("4")
        if i == cow_step:
            expect(page.locator("#events .event[data-kind=cow]")).to_have_count(2)
        page.screenshot(path=screenshot_dir / f"replay_{i + 1:02}.png", full_page=True)
    assert shown["counts"]["used"] == shown["counts"]["shared"] == 0  # the last step: all free or cached
    expect(page.locator("#pool .cell[data-state=used], #pool .cell[data-state=shared]")).to_have_count(0)

    # Back to the step before the copies: their events leave the log again.
    for i in range(n - 1, cow_step - 1, -1):
        page.locator("#replay-prev").click()
        expect(position).to_have_text(f"{i} / {n}", timeout=WAIT_MS)
    expect(page.locator("#events .event[data-kind=cow]")).to_have_count(0)
    expect(events).to_have_count(events_so_far[cow_step - 1])

    # The arrow keys step too.
    page.keyboard.press("ArrowRight")
    expect(position).to_have_text(f"{cow_step + 1} / {n}")
    expect(page.locator("#events .event[data-kind=cow]")).to_have_count(2)
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    expect(position).to_have_text(f"{cow_step - 1} / {n}")
    figures(page)


def test_the_live_page_shows_each_blocks_kv_cache_group(windowed_checkpoint, embedded_tokenizer, page,
                                                        screenshot_dir, monkeypatch):
    """A model of two sliding layers (window 8) and a full one: the legend lists its three groups, each
    cell carries its block's group, a request's row shows a table per group (the sliding ones holding
    only their window, the blocks behind it counted as slid), and blocks leaving the window are events."""
    engine = LLMEngine(EngineConfig(model=str(windowed_checkpoint[0]), block_size=4, num_kv_blocks=96,
                                    max_model_len=128, max_num_batched_tokens=16), tokenizer=embedded_tokenizer)
    step = engine.core.step

    def paced_step():  # a warm tiny model decodes 80 tokens in well under the page's 4 frames a second
        time.sleep(0.03)
        return step()

    monkeypatch.setattr(engine.core, "step", paced_step)
    with serve_engine(engine) as server:
        open_live(page, f"{server.url}/dashboard")
        legend = page.locator("#groups-legend .group-item")
        expect(legend).to_have_count(3, timeout=WAIT_MS)
        names = page.evaluate("() => [...document.querySelectorAll('#groups-legend .group-name')]"
                              ".map(n => n.textContent)")
        assert names == ["group 0: sliding 8", "group 1: sliding 8", "group 2: full"]

        done, failures = threading.Event(), []

        def run():
            try:
                server.client().completions.create(model=MODEL, prompt=list(range(3, 43)), max_tokens=80,
                                                   temperature=0, extra_body={"ignore_eos": True})
            except Exception as e:  # reported by the test's thread below
                failures.append(e)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        try:
            # Decoding past the 40-token prompt (computed 16 tokens a step): the full group holds more than its
            # 10 blocks, each sliding group's table counts the blocks that slid out of its window.
            page.wait_for_function("""() => {
              const row = document.querySelector('#requests .request[data-status=running]');
              return row && row.querySelectorAll('.req-group').length === 3
                && row.querySelectorAll('.req-group[data-group="2"] .req-block').length > 10
                && row.querySelector('.req-group[data-group="0"] .req-slid') !== null;
            }""", timeout=WAIT_MS, polling=50)  # polled: this lasts about two seconds
            shown = page.evaluate("""() => {
              const row = document.querySelector('#requests .request[data-status=running]');
              const groups = [...row.querySelectorAll('.req-group')].map(part => ({
                group: part.dataset.group,
                label: part.querySelector('.req-group-label').textContent,
                blocks: [...part.querySelectorAll('.req-block')].map(b => ({
                  block: b.dataset.block, index: Number(b.dataset.index), group: b.dataset.group,
                  cell: document.querySelector(`#pool .cell[data-block="${b.dataset.block}"]`).dataset.group})),
                slid: Number((part.querySelector('.req-slid') || {dataset: {count: 0}}).dataset.count),
              }));
              return {groups, used: [...document.querySelectorAll('#groups-legend .group-used')]
                                    .map(b => Number(b.textContent))};
            }""")
            groups = shown["groups"]
            assert [g["label"] for g in groups] == ["g0 sliding 8", "g1 sliding 8", "g2 full"]
            for g in groups:
                # each block's cell is of the group whose table holds it
                assert all(b["group"] == b["cell"] == g["group"] for b in g["blocks"]), g
                indices = [b["index"] for b in g["blocks"]]
                assert indices == list(range(g["slid"], g["slid"] + len(indices))), g  # the tail of the table
            for g in groups[:2]:  # the window's 7 earlier positions and the block being written: 3 blocks
                assert g["slid"] > 0 and len(g["blocks"]) <= 3, g
            assert groups[2]["slid"] == 0 and len(groups[2]["blocks"]) >= 10
            assert groups[2]["slid"] + len(groups[2]["blocks"]) == groups[0]["slid"] + len(groups[0]["blocks"])
            assert shown["used"][2] >= len(groups[2]["blocks"])
            expect(page.locator("#events .event[data-kind=slide]").first).to_be_attached(timeout=WAIT_MS)
            figures(page)

            # A full group's cell: the tooltip names its group and the request's block in it.
            page.locator('#pool .cell[data-group="2"]').first.hover()
            expect(page.locator("#tooltip")).to_contain_text("group 2: full", timeout=WAIT_MS)
            page.screenshot(path=screenshot_dir / "live_groups.png", full_page=True)
        finally:
            assert done.wait(300), "the request did not finish"
        assert not failures, failures
        page.mouse.move(2, 2)
        page.wait_for_function("""() => [...document.querySelectorAll('#groups-legend .group-used')]
                                  .every(b => b.textContent === '0')""", timeout=WAIT_MS)
        expect(page.locator("#requests .request")).to_have_count(0, timeout=WAIT_MS)


def test_a_model_of_one_kind_shows_no_group_legend(small_server, page):
    open_live(page, f"{small_server.url}/dashboard")
    expect(page.locator("#groups-legend")).to_be_hidden()
    assert page.locator("#pool .cell[data-group]").count() == 0
