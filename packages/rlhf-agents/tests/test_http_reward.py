"""The HTTP reward client against real local servers (aiohttp, bound to 127.0.0.1)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from rlhf_agents import HttpRewardSource, build_reward_source
from rlhf_core.types import RewardRequest


class ScriptedServer:
    """A reward server on 127.0.0.1 that answers with ``statuses`` in turn (then 200), recording requests."""

    def __init__(self, statuses=(), delay: float = 0.0, load: dict | None = None):
        self.statuses = list(statuses)
        self.delay = delay
        self.bodies: list[dict] = []
        self.load = load if load is not None else {"in_flight": 0, "peak": 0}  # may be shared by servers

    async def handle(self, request):
        self.load["in_flight"] += 1
        self.load["peak"] = max(self.load["peak"], self.load["in_flight"])
        try:
            body = await request.json()
            self.bodies.append(body)
            await asyncio.sleep(self.delay)
            status = self.statuses.pop(0) if self.statuses else 200
            if status != 200:
                return web.json_response({"detail": f"scripted {status}"}, status=status)
            rewards = [float(len(q)) for q in body["query"]]
            return web.json_response(
                {"rewards": rewards, "scores": rewards, "extra_logs": {"seen": [1.0] * len(rewards)}}
            )
        finally:
            self.load["in_flight"] -= 1

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/get_reward", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/get_reward"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def request(n: int) -> RewardRequest:
    queries = ["x" * (i + 1) for i in range(n)]
    return RewardRequest(queries=queries, prompts=["p"] * n, labels=[str(i) for i in range(n)])


def fast(urls, **kw) -> HttpRewardSource:
    kw.setdefault("backoff_base", 0.01)
    return HttpRewardSource(urls, **kw)


def test_503_503_200_succeeds_on_the_third_attempt():
    async def run():
        async with ScriptedServer([503, 503]) as server:
            source = fast([server.url], max_attempts=5)
            result = await source.score(request(3))
            await source.aclose()
            return server, result

    server, result = asyncio.run(run())
    assert len(server.bodies) == 3
    assert server.bodies[0] == {"query": ["x", "xx", "xxx"], "prompts": ["p"] * 3, "labels": ["0", "1", "2"]}
    assert result.rewards == [1.0, 2.0, 3.0] and result.errors == [None] * 3
    assert result.extra_logs["seen"] == [1.0, 1.0, 1.0]


def test_400_is_not_retried():
    async def run():
        async with ScriptedServer([400]) as server:
            source = fast([server.url], max_attempts=5)
            result = await source.score(request(2))
            await source.aclose()
            return server, result

    server, result = asyncio.run(run())
    assert len(server.bodies) == 1
    assert result.rewards == [None, None]
    assert (
        server.url in result.errors[0]
        and "status 400" in result.errors[0]
        and "not retried" in result.errors[0]
    )


def test_a_failing_server_gets_exactly_the_configured_attempts():
    async def run():
        async with ScriptedServer([503] * 10) as server:
            source = fast([server.url], max_attempts=4)
            result = await source.score(request(2))
            await source.aclose()
            return server, result

    server, result = asyncio.run(run())
    assert len(server.bodies) == 4
    message = result.errors[0]
    assert "failed after 4 attempts" in message and server.url in message and "status 503" in message


def test_a_server_that_is_down_fails_after_the_attempts_naming_the_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/get_reward"
    sock.close()  # nothing listens there now

    async def run():
        source = fast([url], max_attempts=3)
        result = await source.score(request(1))
        await source.aclose()
        return result

    result = asyncio.run(run())
    assert result.rewards == [None]
    assert "failed after 3 attempts" in result.errors[0] and url in result.errors[0]
    assert "Connect" in result.errors[0]  # aiohttp's ClientConnectorError: the reason is named


def test_timeout_is_per_request():
    async def run():
        async with ScriptedServer(delay=1.0) as server:
            source = fast([server.url], max_attempts=2, timeout=0.2)
            result = await source.score(request(1))
            await source.aclose()
            return result

    result = asyncio.run(run())
    assert "no answer within --reward.timeout 0.2 s" in result.errors[0]


def test_batches_are_split_load_balanced_and_concurrency_capped():
    load = {"in_flight": 0, "peak": 0}

    async def run():
        async with ScriptedServer(delay=0.05, load=load) as a, ScriptedServer(delay=0.05, load=load) as b:
            source = fast([a.url, b.url], request_batch_size=2, max_concurrency=3)
            result = await source.score(request(16))
            await source.aclose()
            return a, b, result

    a, b, result = asyncio.run(run())
    assert result.rewards == [float(i + 1) for i in range(16)]  # answers land on their own samples
    assert len(a.bodies) + len(b.bodies) == 8 and len(a.bodies) >= 2 and len(b.bodies) >= 2
    assert all(len(body["query"]) == 2 for body in a.bodies + b.bodies)
    assert load["peak"] == 3  # 8 requests, at most 3 at a time over both servers


def test_wrong_length_answer_names_the_server():
    async def handler(request):
        return web.json_response({"rewards": [1.0]})

    async def run():
        app = web.Application()
        app.router.add_post("/r", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/r"
        source = fast([url])
        result = await source.score(request(3))
        await source.aclose()
        await runner.cleanup()
        return url, result

    url, result = asyncio.run(run())
    assert result.errors[0] == f"reward server {url} returned 1 rewards for a batch of 3 samples (expected 3)"


def test_config_builds_one_load_balanced_source(cfg_factory):
    cfg = cfg_factory(
        reward={
            "remote_url": "http://127.0.0.1:1/get_reward, http://127.0.0.1:2/get_reward",
            "max_retries": 2,
        }
    )
    source = build_reward_source(cfg)
    assert isinstance(source, HttpRewardSource)
    assert source.urls == ["http://127.0.0.1:1/get_reward", "http://127.0.0.1:2/get_reward"]
    assert source.max_attempts == 2
    with pytest.raises(ValueError, match="not an http"):
        HttpRewardSource(["ftp://x"])


def test_credentials_in_the_url_are_used_but_never_shown():
    """A URL with a password and a token parameter still reaches the server; messages mask both."""

    async def run():
        async with ScriptedServer([400]) as server:
            url = server.url.replace("http://", "http://rm:hunter2@") + "?token=tok-42"
            source = fast([url], max_attempts=2)
            result = await source.score(request(1))
            await source.aclose()
            return server, source, result

    server, source, result = asyncio.run(run())
    assert len(server.bodies) == 1  # the request went through
    shown = server.url.replace("http://", "http://rm:***@") + "?token=***"
    assert shown in result.errors[0] and shown == source.description
    assert "hunter2" not in result.errors[0] + source.description and "tok-42" not in result.errors[0]
