"""The soak's judge (tools/soak/): what counts as a CANCEL answered in time. The soak itself runs
for a minute against a `salience serve` process in test_drain.py, on the server whose drain is
tested after it.
"""

from __future__ import annotations

from tools.soak.connection import Received
from tools.soak.streams import CANCEL_SECONDS, check_cancelled


def ended(finish: str, tokens: int, at: float) -> Received:
    """A stream that got `tokens` tokens, one every 10 ms from t=0, and its end at `at`."""
    arrivals = [i / 100 for i in range(tokens)]
    return Received(tokens=[{"token": 1}] * tokens, arrivals=arrivals, finish=finish, finished_at=at)


def test_the_cancel_judge_goes_by_the_servers_answer_and_time_not_token_arrivals() -> None:
    # Forty tokens read after the CANCEL went out at t=0.1: a slow reader, not a fault.
    assert check_cancelled(ended("cancelled", 50, 0.5), 64, sent_at=0.1) is None
    assert check_cancelled(ended("length", 64, 0.7), 64, sent_at=0.1) is None  # then "not running"
    late = check_cancelled(ended("cancelled", 50, 0.2 + CANCEL_SECONDS), 64, sent_at=0.1)
    assert late is not None and "s after the CANCEL went out" in late
    assert check_cancelled(ended("length", 20, 0.3), 64, sent_at=0.1) is not None
    assert check_cancelled(ended("stop", 64, 0.3), 64, sent_at=0.1) is not None
    assert check_cancelled(ended("cancelled", 5, 0.3), 64, sent_at=None) is not None
