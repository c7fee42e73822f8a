"""Shared test set-up: JAX on the CPU, one persistent compilation cache for the session (this process, its
pytest-xdist workers and every subprocess a test starts), hypothesis profiles sized for a 2-core machine.

The cache makes a program compiled once (the same model, the same shapes) load in milliseconds in the next
test or subprocess: the SIGKILL tests restart a run five times. It lives in a fresh temporary folder, so
nothing carries over between sessions; eviction is on so that JAX guards its entries with a file lock
(concurrent workers never read a half-written entry). Set JAX_COMPILATION_CACHE_DIR to choose the folder.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxrl_llm_test_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 2**30))

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
