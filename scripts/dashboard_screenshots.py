"""The KV dashboard's pictures in docs/, taken in headless Chromium through Playwright.

    python scripts/dashboard_screenshots.py [--out docs]

- dashboard_live.png: the live page of a server on the embedded model (run in this process, on a free
  loopback port) while a workload shares blocks: every request has the same system prompt, one asks
  for n=3 samples, the others run beside it; taken once shared blocks are on screen.
- dashboard_walkthrough.png: `pagedserve demo --html`'s replay page at its copy-on-write step.

Needs Debian's Chromium at /usr/bin/chromium (`make test` installs it) and the test extras (playwright,
httpx). The pictures are the 1400x900 viewport, in 256 colours.
"""

from __future__ import annotations

import argparse
import io
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's pagedserve (its page) even where another is installed

import httpx  # noqa: E402
from PIL import Image  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.dashboard.walkthrough import walkthrough_frames  # noqa: E402
from pagedserve.engine.async_llm import AsyncLLM  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.entrypoints import cli  # noqa: E402
from pagedserve.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedserve.entrypoints.openai.http_server import make_server  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 900}
WAIT_MS = 120_000
MODEL = "smollm2"
SYSTEM = ("You are a helpful assistant for a small bookshop. Answer briefly and politely, recommend at most "
          "two books, and never invent prices or opening hours.")
QUESTIONS = ["Which novel should I read on a long train ride?", "Do you have anything about the history of maps?",
             "My niece is ten and loves dragons. Any ideas?", "What is a good first book about astronomy?"]


def save_png(page, path: Path) -> None:
    """The viewport as a PNG of at most 256 colours (a third of the size; the page has few colours)."""
    image = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


class Server:
    """The embedded model behind the OpenAI app and its dashboard, on uvicorn in a thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncLLM.from_llm_engine(LLMEngine(config))
        self.engine.start()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(build_app(self.engine, MODEL), log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        self.engine.shutdown()


def chat(url: str, question: str, **params) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "ignore_eos": True, **params}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()


def live_picture(browser, path: Path) -> None:
    server = Server(EngineConfig(num_kv_blocks=96, max_model_len=1024))
    try:
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(f"{server.url}/dashboard")
        page.wait_for_function("Number(document.body.dataset.frames) > 0", timeout=WAIT_MS)
        chat(server.url, "Hello!", max_tokens=8)  # its system prompt's full blocks go to the prefix cache
        with ThreadPoolExecutor(len(QUESTIONS) + 1) as pool:
            jobs = [pool.submit(chat, server.url, QUESTIONS[0], max_tokens=200, n=3, temperature=1.0, seed=1)]
            for k, question in enumerate(QUESTIONS[1:]):
                time.sleep(0.5)  # staggered arrivals: tables of different lengths
                jobs.append(pool.submit(chat, server.url, question, max_tokens=120 + 40 * k, temperature=0.7))
            # A few seconds of history in the charts, while the samples still share their prompt.
            page.wait_for_function("""() => Number(document.body.dataset.frames) >= 20
                && document.querySelectorAll('#requests .request[data-status=running]').length >= 4
                && [...document.querySelectorAll('#pool .cell[data-state=shared]')]
                     .some(c => Number(c.dataset.ref) >= 3)""",
                                   timeout=WAIT_MS)
            save_png(page, path)
            for job in jobs:
                job.result()
        page.close()
    finally:
        server.close()


def walkthrough_picture(browser, path: Path) -> None:
    kinds = [{e["kind"] for e in frame["events"]} for frame in walkthrough_frames()]
    cow_step = next(i for i, step in enumerate(kinds) if "cow" in step)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "walkthrough.html"
        cli.main(["demo", "--html", str(report)])
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(report.as_uri())
        for _ in range(cow_step):
            page.locator("#replay-next").click()
        page.wait_for_function("n => document.getElementById('replay-position').textContent.startsWith(n + ' / ')",
                               arg=cow_step + 1, timeout=WAIT_MS)
        page.mouse.move(0, 0)
        save_png(page, path)
        page.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="the folder for the two pictures")
    args = parser.parse_args()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            walkthrough_picture(browser, args.out / "dashboard_walkthrough.png")
            live_picture(browser, args.out / "dashboard_live.png")
        finally:
            browser.close()
    for name in ("dashboard_live.png", "dashboard_walkthrough.png"):
        print(f"wrote {args.out / name} ({(args.out / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
