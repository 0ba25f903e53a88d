"""The metrics-auth review cache: one API call per question however many requests ask it at
once, answers kept for their time, failures not kept; and the bearer header's parsing."""

from __future__ import annotations

import asyncio

import pytest

from picker.telemetry.access_review import ReviewCache, bearer_token


def test_concurrent_questions_share_one_review_and_the_answer_is_cached() -> None:
    calls = 0

    async def review() -> bool:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return True

    async def scenario() -> list[bool]:
        cache: ReviewCache[str, bool] = ReviewCache(lambda _: 60.0)
        answers = await asyncio.gather(*(cache.get("token", review) for _ in range(10)))
        answers.append(await cache.get("token", review))
        return answers

    assert asyncio.run(scenario()) == [True] * 11
    assert calls == 1


def test_the_time_an_answer_is_kept_depends_on_the_answer() -> None:
    calls: list[bool] = []

    async def scenario() -> None:
        cache: ReviewCache[bool, bool] = ReviewCache(lambda allowed: 60.0 if allowed else 0.0)
        for key in (True, True, False, False):

            async def review(key: bool = key) -> bool:
                calls.append(key)
                return key

            await cache.get(key, review)

    asyncio.run(scenario())
    assert calls == [True, False, False]  # the allowed answer kept, the one kept for 0 s asked again


def test_a_failed_review_reaches_every_waiter_and_is_not_cached() -> None:
    attempts = 0

    async def review() -> bool:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.01)
        if attempts == 1:
            raise OSError("API server unreachable")
        return True

    async def scenario() -> None:
        cache: ReviewCache[str, bool] = ReviewCache(lambda _: 60.0)
        results = await asyncio.gather(*(cache.get("k", review) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, OSError) for r in results)
        assert await cache.get("k", review) is True

    asyncio.run(scenario())
    assert attempts == 2


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Basic dXNlcjpwYXNz", None),
        ("Bearer", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token
