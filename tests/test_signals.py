"""Clean stops: the first SIGTERM/SIGINT asks for a stop after the step, a second one interrupts."""

import os
import signal

import pytest

from lmfunc.train.signals import StopRequests


def test_first_signal_requests_a_stop_second_interrupts_and_close_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequests()
    try:
        assert stop.should_stop() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop() == "signal"
        with pytest.raises(KeyboardInterrupt, match="second SIGINT: stopped at once, without saving a checkpoint"):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_time_limit_and_no_handlers():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequests(install=False, time_limit_s=0.0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert stop.should_stop() == "exit_duration_in_mins"
    assert StopRequests(install=False, time_limit_s=3600).should_stop() is None
