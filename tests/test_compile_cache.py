"""The suite's persistent compilation cache works on the installed JAX with XLA:CPU: a program compiled in one
process is written to the cache folder and loaded, not compiled, by the next process (conftest.py sets the
cache for the workers and every subprocess; this is what makes the SIGKILL chain's restarts cheap)."""

import os
import subprocess
import sys

PROBE = """
import io, logging
log = io.StringIO()
compiler = logging.getLogger("jax._src.compiler")
compiler.addHandler(logging.StreamHandler(log)); compiler.setLevel(logging.DEBUG)
import jax, jax.numpy as jnp
jax.jit(lambda x: jnp.tanh(x) @ x.T + 3.0)(jnp.ones((8, 8))).block_until_ready()
hits = [line for line in log.getvalue().splitlines() if "cache hit" in line.lower() and "jit__lambda" in line]
print("HIT" if hits else "MISS")
"""


def test_a_second_process_loads_the_program_from_the_persistent_cache(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    runs = [subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert [r.stdout.strip() for r in runs] == ["MISS", "HIT"]
    assert any(name.startswith("jit__lambda") for name in os.listdir(tmp_path))


def test_the_suite_runs_with_a_cache_folder_set():
    assert os.path.isdir(os.environ["JAX_COMPILATION_CACHE_DIR"])
