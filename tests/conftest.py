"""Shared test set-up: JAX on the CPU, one persistent compilation cache (this process, its pytest-xdist workers
and every subprocess a test starts), hypothesis profiles sized for a 2-core machine.

The cache makes a program compiled once (the same model, the same shapes) load in milliseconds in the next
test or subprocess: the SIGKILL tests restart a run five times. It is kept between runs, in
`~/.cache/jaxrl_llm/jax-<jax version>-tests` (XDG_CACHE_HOME respected), so a second run of the suite skips
most compiles; JAX keys each entry by the program, the compile options, the backend and the jax version, so a
stale hit cannot happen. XLA:CPU reads and writes it (checked by tests/test_compile_cache.py). Eviction is on,
so JAX guards its entries with a file lock and concurrent workers never read a half-written entry.
Set JAX_COMPILATION_CACHE_DIR to choose the folder, or JAXRL_LLM_FRESH_TEST_CACHE=1 for a temporary one
removed at exit (to time cold compiles).
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if os.environ.get("JAXRL_LLM_FRESH_TEST_CACHE"):
        _cache = tempfile.mkdtemp(prefix="jaxrl_llm_test_jax_cache_")
        atexit.register(shutil.rmtree, _cache, True)
    else:
        from importlib.metadata import version

        _root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        _cache = str(_root / "jaxrl_llm" / f"jax-{version('jax')}-jaxlib-{version('jaxlib')}-tests")
        Path(_cache).mkdir(parents=True, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))  # least recently used entries go first

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_runtest_logreport(report):
    """With JAXRL_LLM_TEST_TIMES=<file>, each test phase's duration is appended as it ends (one JSON line), so a
    run that is stopped early still tells where its time went (pytest's --durations prints only at the end)."""
    path = os.environ.get("JAXRL_LLM_TEST_TIMES")
    if path and getattr(report, "node", None) is None:  # under xdist the controller sees each worker's reports again
        import json

        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": report.nodeid, "when": report.when, "s": round(report.duration, 2),
                                "outcome": report.outcome}) + "\n")


def pytest_collection_modifyitems(config, items):
    """The files marked `slow` run first (in their collection order), then the rest: with `--dist loadfile
    --no-loadscope-reorder` (xdist's own order puts the files with the most tests first, and the longest
    files have few) the two workers take a long file each at the start and the short ones fill in at the
    end, so neither is left alone with a long file in the suite's last minutes."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
