"""Events off the reconcile path, without repeats, at a bounded rate per object
(`kvtopo_operator.events`): a recorder built through its constructor with an injected post
and clock."""

from __future__ import annotations

import asyncio
from typing import Any

from kvtopo_operator.events import EventRecorder
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import Event


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def topology(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"}}


def dropped(metrics: OperatorMetrics, why: str) -> float:
    value: float = metrics.events_dropped.labels(why)._value.get()
    return value


def test_repeats_floods_and_a_slow_api_server_cost_nothing_but_counted_drops() -> None:
    async def body() -> None:
        posted: list[tuple[str, str, str]] = []
        gate = asyncio.Event()

        async def post(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
            await gate.wait()  # a slow API server: the reconcile path must not wait on it
            posted.append((obj["metadata"]["name"], reason, message))

        clock, metrics = Clock(), OperatorMetrics()
        rec = EventRecorder(post, metrics, repeat_window_s=60, burst=3, refill_s=10, clock=clock)
        a, b = topology("a"), topology("b")
        failed = Event("Warning", "HandshakeFailed", "d0: adding P0: HTTP 401")
        # The same Event every round of a persistent fault: said once.
        assert rec.record(a, failed) is True
        for _ in range(50):
            assert rec.record(a, failed) is False
        assert dropped(metrics, "repeat") == 50
        # Many different Events on one object: the burst, then one per refill period.
        many = [Event("Warning", "HandshakeFailed", f"d{i}: HTTP 401") for i in range(1, 10)]
        assert [rec.record(a, e) for e in many] == [True, True] + [False] * 7
        assert dropped(metrics, "rate") == 7
        assert rec.record(b, failed) is True  # another object has its own budget
        clock.now += 10
        assert rec.record(a, many[5]) is True and rec.record(a, many[6]) is False
        clock.now += 61  # past the repeat window: a fault still there is said again
        assert rec.record(a, failed) is True
        assert posted == [], "nothing waited on the API server"
        gate.set()
        await rec.flush()
        assert posted == [
            ("a", "HandshakeFailed", failed.message),
            ("a", "HandshakeFailed", many[0].message),
            ("a", "HandshakeFailed", many[1].message),
            ("b", "HandshakeFailed", failed.message),
            ("a", "HandshakeFailed", many[5].message),
            ("a", "HandshakeFailed", failed.message),
        ]
        await rec.close()

    asyncio.run(body())


def test_a_failed_post_is_counted_and_the_next_one_still_goes() -> None:
    async def body() -> None:
        calls: list[str] = []

        async def post(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
            calls.append(message)
            if message == "first":
                raise RuntimeError("(500) Internal Server Error")

        metrics = OperatorMetrics()
        rec = EventRecorder(post, metrics)
        rec.record(topology("a"), Event("Normal", "X", "first"))
        rec.record(topology("a"), Event("Normal", "X", "second"))
        await rec.flush()
        assert calls == ["first", "second"]
        assert dropped(metrics, "post_failed") == 1
        await rec.close()

    asyncio.run(body())


def test_a_full_queue_drops_rather_than_blocks() -> None:
    async def body() -> None:
        gate = asyncio.Event()

        async def post(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
            await gate.wait()

        metrics = OperatorMetrics()
        rec = EventRecorder(post, metrics, queue_limit=2, burst=100)
        results = [rec.record(topology("a"), Event("Normal", "X", str(i))) for i in range(5)]
        await asyncio.sleep(0)  # the poster takes the first one off the queue
        assert results[:2] == [True, True] and results.count(False) >= 2
        assert dropped(metrics, "queue_full") == results.count(False)
        gate.set()
        await rec.flush()
        await rec.close()

    asyncio.run(body())
