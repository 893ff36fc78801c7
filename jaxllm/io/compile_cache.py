"""The persistent XLA compilation cache: on by default, under `paths.cache_dir()/xla`.

A compiled program is stored on disk keyed by its HLO, compile options, backend and jaxlib
version, so a second process (the next `jaxllm generate`, the next test run) loads it instead
of compiling again: seconds saved for every prompt bucket of a large model.

`jaxllm/__init__` calls `enable()` on import, before anything compiles: JAX builds its cache
object once per process at the first compilation, and every path that compiles (forward, prefill,
decode_step, generate, stream, the CLI, user code) then shares it without hooks of its own.
It never raises for the cache itself: an unwritable directory (read-only HOME in CI) means no
cache, not an error. Off with `JAXLLM_NO_COMPILE_CACHE=1` (an on/off switch: 1/0, true/false,
yes/no, on/off; any other value is a ValueError naming it) or `enable(False)`. A cache directory
the user already gave JAX (`JAX_COMPILATION_CACHE_DIR`, `jax.config`) is kept, and so is a
cache the user turned off (`JAX_ENABLE_COMPILATION_CACHE=0`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import jax

from jaxllm.env import env_flag
from jaxllm.io import paths

ENV_OFF = "JAXLLM_NO_COMPILE_CACHE"
log = logging.getLogger("jaxllm")

_ours: Path | None = None  # the directory this module configured, if any


def default_dir() -> Path:
    return paths.cache_dir() / "xla"


def _env_off() -> bool:
    return env_flag(ENV_OFF, False)


def _reset_jax_cache():
    # JAX decides once per process whether and where to cache; reset so a change applies.
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
        return True
    except OSError as e:
        log.info("jaxllm: compilation cache off: %s is not writable (%s)", path, e)
        return False


def enable(dir: str | os.PathLike | bool | None = None) -> Path | None:
    """Cache compiled programs in `dir` (default `cache_dir()/xla`); `enable(False)` turns it off.

    Returns the directory in use, or None when the cache is off. Programs of any size and compile
    time are cached: the small per-token ones are the ones compiled most often.
    """
    global _ours
    off = dir is False or (dir is None and _env_off())  # a bad value raises, outside the try below
    try:
        if off:
            if jax.config.jax_enable_compilation_cache:
                jax.config.update("jax_enable_compilation_cache", False)
                _reset_jax_cache()
            _ours = None
            return None
        current = jax.config.jax_compilation_cache_dir
        if dir is None or dir is True:
            if not jax.config.jax_enable_compilation_cache and _ours is None:
                return None  # the user turned JAX's cache off: respect it
            if current and (_ours is None or Path(current) != _ours):
                return Path(current)  # the user's own cache directory wins over ours
            dir = default_dir()
        path = Path(dir).expanduser()
        if not _writable(path):
            if _ours is not None:
                jax.config.update("jax_compilation_cache_dir", None)
                _reset_jax_cache()
                _ours = None
            return None
        changed = current != str(path) or not jax.config.jax_enable_compilation_cache
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        if changed:
            _reset_jax_cache()
        _ours = path
        return path
    except Exception as e:  # a cache is an optimisation: never let it stop a run
        log.warning("jaxllm: compilation cache off: %s: %s", type(e).__name__, e)
        return None


def directory() -> Path | None:
    """The directory compiled programs are cached in now, or None when caching is off."""
    d = jax.config.jax_compilation_cache_dir
    return Path(d) if d and jax.config.jax_enable_compilation_cache else None
