"""The web console in a real headless Chromium, on a live training run of the tiny model.

Playwright drives Debian's ``chromium`` (no browser download): ``make test`` installs it where
``/usr/bin/chromium`` is missing. The test opens a model's page, trains a step, and sees the reward
curve gain the point through Server-Sent Events (no reload); then it filters the trajectory
browser, opens a trajectory (token shading, tool calls), and writes the screenshots the README
shows (``docs/console.png``, ``docs/console-trajectory.png``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

import artery as art
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout
from tests.helpers import wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
DOCS = Path(__file__).resolve().parent.parent / "docs"
GROUP_SIZE = 4


def chromium() -> str:
    path = os.environ.get("ARTERY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("no chromium: `apt-get install -y chromium` (make test does), or set ARTERY_CHROMIUM")
    return path


def tool_group() -> art.TrajectoryGroup:
    """A tool-using conversation, as an agent would log it for validation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "abc"}'}}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a word up"}}]
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "find abc"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "abc: the first letters"},
                {"role": "assistant", "content": "abc are the first letters"},
            ],
            tools=tools,
            reward=reward,
        )
        for reward in (0.25, 0.75)
    )


async def gather(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(half_alphabet_rollout(model) for _ in range(GROUP_SIZE)) for _ in range(2)]
    )


async def stored_val(http: httpx.AsyncClient, table: str) -> bool:
    return (await http.get(table)).text.count(">val<") == 2


async def test_console_follows_a_training_run_live(tmp_path):
    from playwright.async_api import async_playwright, expect

    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="alpha", project="console", base_model=TINY)
    config = art.TrainConfig(learning_rate=1e-2)
    try:
        await model.register(backend)
        url = backend.stack.console_url
        assert url and url.startswith("http://127.0.0.1:"), url
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/readyz")).json()["ready"] is True
        await model.train(await gather(model), config=config)

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            page = await browser.new_page(viewport={"width": 1280, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            await page.goto(url)
            await page.get_by_role("link", name="alpha").click()
            chart = page.locator("#reward-chart")
            await expect(chart).to_have_attribute("data-points", "1", timeout=10_000)
            await expect(page.locator("#live")).to_have_text("● live", timeout=10_000)
            await expect(page.locator("#replicas td.serving")).to_have_count(1)

            # A step trained while the page is open: the curve gains its point with no reload.
            await model.train(await gather(model), config=config)
            await expect(chart).to_have_attribute("data-points", "2", timeout=15_000)
            await expect(page.locator("#step-count")).to_have_text("(2 steps)")
            assert await chart.locator("canvas").count() == 1

            # Groups stored meanwhile reach the browser too (group.ready over SSE → htmx reload).
            await backend.publish(model, [tool_group()], split="val")
            # First stored (the collector's time, which a loaded machine stretches), as the
            # console's own table says; then on the page, which nobody reloaded.
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                table = "/models/console/alpha/trajectories"
                await wait_for(lambda: stored_val(http, table), timeout=60, interval=0.2)
            rows = page.locator("#trajectories tbody tr")
            await expect(rows.filter(has_text="val")).to_have_count(2, timeout=15_000)

            # Filters: by reward range, then by step.
            await page.fill("input[name=min_reward]", "0.7")
            await page.fill("input[name=max_reward]", "0.8")
            await page.click("#trajectory-filter button")
            val = rows.filter(has_text="val")
            await expect(val).to_have_count(1)  # 0.25 is filtered out, 0.75 stays
            await expect(val.first).to_contain_text("0.750")
            shown = [float(r.split()[-1]) for r in await rows.locator("td:nth-child(5)").all_inner_texts()]
            assert all(0.7 <= r <= 0.8 for r in shown), shown
            await page.fill("input[name=min_reward]", "")
            await page.fill("input[name=max_reward]", "")
            await page.fill("input[name=step]", "0")
            await page.click("#trajectory-filter button")
            await expect(rows.filter(has_text="train")).to_have_count(2 * GROUP_SIZE)
            await page.fill("input[name=step]", "")
            await page.click("#trajectory-filter button")
            DOCS.mkdir(exist_ok=True)
            await page.screenshot(path=str(DOCS / "console.png"), full_page=True)

            # A sampled trajectory: its tokens, shaded by logprob.
            await rows.filter(has_text="train").first.locator("a.trajectory-link").click()
            await expect(page.locator(".message.role-assistant .tok").first).to_be_visible()
            title = await page.locator(".tok").first.get_attribute("title")
            assert title.startswith("logprob -") or title.startswith("logprob 0"), title
            await page.screenshot(path=str(DOCS / "console-trajectory.png"), full_page=True)

            # The tool-using one: the call and the tool's answer.
            await page.go_back()
            await rows.filter(has_text="val").first.locator("a.trajectory-link").click()
            await expect(page.locator(".tool-call .fn")).to_have_text("lookup")
            await expect(page.locator(".message.role-tool")).to_contain_text("the first letters")

            await page.goto(url + "/dead-letters")
            await expect(page.locator("h1")).to_have_text("Dead letters")
            await page.goto(url + "/replicas")
            await expect(page.locator("td.serving")).to_have_count(1)
            assert errors == [], errors
            await browser.close()
    finally:
        await backend.close()
