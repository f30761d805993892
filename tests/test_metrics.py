"""``/metrics`` on every service of a running stack, scraped after a training step and a dead letter."""

from __future__ import annotations

import re

import httpx
import pytest

import artery as art
from artery.shared import subjects
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition ``text`` (the sum over other labels)."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"no {name}{labels} in:\n{text[:3000]}"
    return total


async def test_every_service_serves_its_metrics(tmp_path):
    backend = art.LocalBackend(path=tmp_path / "artery")
    model = art.TrainableModel(name="alpha", project="metrics", base_model=TINY)
    try:
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(half_alphabet_rollout(model) for _ in range(4)) for _ in range(2)]
        )
        await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        js = await backend._js()
        await js.publish(subjects.trajectories("metrics", "alpha"), b"not json")  # a dead letter

        urls = {name: p.ready_info.get("metrics_url") for name, p in backend.stack.processes.items()}
        assert set(urls) == {
            "collector",
            "reward",
            "publisher",
            "trainer",
            "console",
            "inference-metrics-alpha",
        }
        assert all(url and url.startswith("http://127.0.0.1:") for url in urls.values()), urls
        async with httpx.AsyncClient(timeout=10) as http:

            async def scrape(name: str) -> str:
                response = await http.get(urls[name])
                assert response.status_code == 200
                return response.text

            collector = await scrape("collector")
            assert sample(collector, "artery_collector_trajectories_total", project="metrics") >= 8
            assert sample(collector, "artery_messages_total", service="collector", outcome="acked") >= 2
            assert sample(collector, "artery_consumer_lag_messages", service="collector") >= 0
            for _ in range(100):  # the dead letter: settled as the collector fetches it
                if "artery_dead_letters_total{" in collector:
                    break
                collector = await scrape("collector")
            assert sample(collector, "artery_dead_letters_total", service="collector", kind="decode") == 1
            assert sample(collector, "artery_messages_total", outcome="dead_lettered") == 1

            trainer = await scrape("trainer")
            assert sample(trainer, "artery_trainer_step_seconds_count") == 1
            assert sample(trainer, "artery_trainer_tokens_per_second") > 0
            assert sample(trainer, "artery_pause_seconds_count", role="trainer") == 1

            reward = await scrape("reward")
            assert sample(reward, "artery_messages_total", service="reward", outcome="acked") >= 2
            assert "artery_reward_judge_calls_total" in reward  # declared; no group asked for a judge
            publisher = await scrape("publisher")
            assert sample(publisher, "artery_messages_total", service="publisher", outcome="acked") >= 1
            for name in ("console", "inference-metrics-alpha"):
                assert "process_cpu_seconds_total" in await scrape(name)
    finally:
        await backend.close()
