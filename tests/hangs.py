"""For tests of input that once hung: run the call on a thread, so that a regression fails the
test instead of stopping the suite."""

from __future__ import annotations

import threading
from typing import Callable


def error_within(seconds: float, call: Callable[[], object], kind: type[BaseException] = ValueError):
    """The `kind` error `call()` raises; an AssertionError if it is still running after `seconds`
    (left behind on a daemon thread) or returned without one."""
    errors = []

    def run():
        try:
            call()
        except kind as e:
            errors.append(e)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    assert errors, f"returned without a {kind.__name__}"
    return errors[0]
