"""Counting XLA compilations in a block, for tests that prove a shape does not compile again."""

from __future__ import annotations

import contextlib

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations():
    """Names of the functions XLA compiles inside the block (any function, any shape; loads from
    the persistent compilation cache count too)."""
    names: list[str] = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            names.append(kwargs.get("fun_name", "?"))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
