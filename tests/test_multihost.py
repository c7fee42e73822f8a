"""One run across two processes (issue 44): two local processes x 4 CPU devices (gloo collectives), started by hand
(`--coordinator localhost:PORT --num-processes 2 --process-id I`), against one process with 8 devices.

One module fixture makes every run once (the compilation cache that conftest.py sets is shared by all of them):
1. the reference: `jaxrl-llm train` in one process with 8 devices, 3 GRPO steps;
2. the same command in two processes, both SIGKILLed at step 2 (before its row and checkpoint), then started
   again: it resumes from step 1 on both and finishes. Process 1 records every file it writes (`multihost_run.py`);
3. `jaxrl-llm eval` of that run's checkpoint in two processes, and in one.
The tests then compare: the two-process metrics equal the reference's step for step (the same rewards and rates,
the loss and the other float figures within tolerance), so the step spans both processes' devices and the resume
continued as the uninterrupted reference; the evaluations agree; process 1 wrote no file in the output folder.
The checkpoints live in a folder of their own (checkpoint.dir): Orbax writes them jointly (each process its part).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_llm.metrics import read_metrics

pytestmark = pytest.mark.slow  # scheduled first (conftest.py), so that the two workers end together

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "presets" / "tiny_test.toml"
RUNNER = ROOT / "tests" / "multihost_run.py"
# A small one-stage run: 3 steps of 8 games (4 prompts x 2) on a 2-layer model, replies constrained to the grammar
# (so the rewards vary from the first step), a checkpoint after every step, no evaluation during training.
SMALL = ['model.num_hidden_layers=2', 'model.layer_types=["conv", "full_attention"]', "grpo.0.steps=3",
         "grpo.1.steps=0", "grpo.0.num_prompts=4", "grpo.0.rollout.max_turns=2", "grpo.0.sampling.max_new_tokens=12",
         "grpo.0.sampling.constrained=true", "checkpoint.every_steps=1", "eval.every_steps=0", "eval.num_games=8",
         "eval.rollout.max_turns=2"]
VOLATILE = {"time", "step_time", "games_per_s", "tokens_per_s", "sampled_tokens_per_s"}
EXACT = ("_rate", "_reward", "reward_mean", "reward_std", "turns", "tokens", "reply_length", "stage", "step")
TIMEOUT = 1200


def _free_port() -> int:
    """A port the OS has just handed out (bound, then released): free for the coordinator a moment later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _command(command: str, out: Path, ckpt: Path) -> list[str]:
    cmd = [command, str(PRESET), "--set", f'run.output_dir="{out}"', "--set", f'checkpoint.dir="{ckpt}"']
    for item in SMALL:
        cmd += ["--set", item]
    return cmd


def _one(args: list[str]) -> subprocess.CompletedProcess:
    """`jaxrl-llm ARGS` in one process with 8 CPU devices."""
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.cli", *args], env=_env(8), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT)


def _two(args: list[str], writes: Path, watch: Path, kill_at: str | None = None) -> list[subprocess.CompletedProcess]:
    """`jaxrl-llm ARGS` in two processes x 4 CPU devices; process 1 records its writes under `watch` in `writes`."""
    port = _free_port()
    procs = []
    for i in range(2):
        runner = [sys.executable, str(RUNNER)] + (["--writes", str(writes), "--watch", str(watch)] if i == 1 else [])
        runner += ["--kill-at", kill_at] if kill_at else []
        launch = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)]
        procs.append(subprocess.Popen([*runner, "--", *args, *launch], env=_env(4), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def _summary(done: subprocess.CompletedProcess) -> dict:
    """The JSON summary `jaxrl-llm eval` prints last."""
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def _shown(done) -> str:
    return f"rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    reference = _one(_command("train", tmp / "reference", tmp / "reference_ckpt"))
    assert reference.returncode == 0, _shown(reference)

    out, ckpt, writes = tmp / "two", tmp / "two_ckpt", tmp / "process1_writes.txt"
    writes.touch()
    killed = _two(_command("train", out, ckpt), writes, out, kill_at="grpo_step@2")
    assert killed[0].returncode == -9, _shown(killed[0])  # process 1 is killed too, or ends when 0 is gone
    assert killed[1].returncode != 0, _shown(killed[1])
    resumed = _two(_command("train", out, ckpt), writes, out)
    for done in resumed:
        assert done.returncode == 0, _shown(done)

    games = tmp / "games"
    games.mkdir()
    eval_two = _two([*_command("eval", out, ckpt), "--checkpoint", str(ckpt), "--games", str(games / "two.jsonl")],
                    writes, out)
    for done in eval_two:
        assert done.returncode == 0, _shown(done)
    eval_one = _one([*_command("eval", tmp / "eval_one", ckpt), "--checkpoint", str(ckpt),
                     "--games", str(games / "one.jsonl")])
    assert eval_one.returncode == 0, _shown(eval_one)
    return {"reference": tmp / "reference", "out": out, "ckpt": ckpt, "writes": writes, "resumed": resumed,
            "eval_two": eval_two, "eval_one": eval_one, "games": games}


def _close(key: str, want, got) -> bool:
    if key.endswith(EXACT) or not isinstance(want, float):
        return want == got
    return math.isclose(want, got, rel_tol=1e-3, abs_tol=1e-5)


def test_two_processes_train_like_one_process_with_all_their_devices_and_resume_after_sigkill(runs):
    want = read_metrics(runs["reference"] / "metrics.jsonl")
    got = read_metrics(runs["out"] / "metrics.jsonl")
    assert [r["step"] for r in want] == [1, 2, 3]
    assert [r["step"] for r in got] == [1, 2, 3]  # step 2 again after the kill, none missing, none twice
    assert "resumed from" in runs["resumed"][0].stdout and "at step 1/3" in runs["resumed"][0].stdout
    assert len({round(r["reward_mean"], 6) for r in want} | {r["invalid_rate"] for r in want}) > 1  # not all equal
    for w, g in zip(want, got):
        assert set(w) == set(g)
        differ = {k: (w[k], g[k]) for k in w if k not in VOLATILE and not _close(k, w[k], g[k])}
        assert differ == {}, f"step {w['step']}"
    # Orbax wrote each step jointly: process 1's part sits beside process 0's.
    assert (runs["ckpt"] / "3" / "state" / "ocdbt.process_1").is_dir()


def test_eval_in_two_processes_equals_the_one_process_eval(runs):
    two, one = _summary(runs["eval_two"][0]), _summary(runs["eval_one"])
    assert set(two["eval"]) == set(one["eval"]) == {"random", "optimal"}
    for setting, figures in one["eval"].items():
        for key, value in figures.items():
            assert math.isclose(two["eval"][setting][key], value, rel_tol=1e-6, abs_tol=1e-9), (setting, key)
    assert (runs["games"] / "two.jsonl").read_text() == (runs["games"] / "one.jsonl").read_text()
    assert runs["eval_two"][1].stdout == ""  # process 1 prints nothing; process 0 prints the table


def test_only_process_0_writes_into_the_output_folder(runs):
    assert runs["writes"].read_text() == ""  # process 1 opened no file there in training, resume or eval
    names = sorted(p.name for p in runs["out"].iterdir())
    assert names == ["eval_metrics.jsonl", "metrics.jsonl"], names  # no lock left, no file twice
    rows = read_metrics(runs["out"] / "eval_metrics.jsonl")
    assert len(rows) == 1 and rows[0]["command"] == "eval"
    assert runs["resumed"][1].stdout == ""


def test_plan_divides_the_memory_over_hosts():
    from jaxrl_base.errors import ConfigError
    from jaxrl_llm.config import load_config
    from jaxrl_llm.host_plan import format_host_plan, host_plan
    from jaxrl_llm.memory_plan import plan

    config = load_config(PRESET, ["mesh.fsdp=2", "grpo.0.num_prompts=4"])
    one = plan(config)
    over = host_plan(config, one, hosts=2, devices_per_host=4)
    assert (over["data"], over["fsdp"]) == (4, 2)
    s, o = one["stages"][0], over["stages"][0]
    assert o["weights"] == pytest.approx(sum(s[k] for k in ("params", "grads", "optimizer", "reference")) / 2)
    assert o["batch"] == pytest.approx(s["kv_cache"] / 8 + s["activations"] / s["micro_rows"])  # 1 game, 1 row each
    assert (o["host"], o["run"]) == (pytest.approx(4 * o["device"]), pytest.approx(8 * o["device"]))
    text = format_host_plan(over)
    assert "2 host(s) x 4 device(s)" in text and "stage 1's 4 games do not split evenly over 8" in text
    with pytest.raises(ConfigError, match="does not fit 6 devices"):
        host_plan(load_config(PRESET, ["mesh.data=4"]), one, hosts=3, devices_per_host=2)


def test_launch_flags_that_describe_no_run_are_one_line_errors(capsys):
    from jaxrl_llm.cli.main import main

    assert main(["train", str(PRESET), "--coordinator", "localhost:12355", "--num-processes", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxrl-llm train: a run started by hand needs --coordinator HOST:PORT, --num-processes N and --process-id I "
        "(missing --process-id); or pass --distributed on a cluster JAX detects (SLURM, Open MPI, Kubernetes, "
        "Cloud TPU)")
    assert main(["eval", str(PRESET), "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().err
    assert main(["sft", str(PRESET), "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"]) == 2
    assert "--process-id 2 is not in 0 .. 1" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_process_that_dies_ends_the_run_with_one_line_naming_it(mode):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(RUNNER), "--die", mode, "--port", str(port), "--index", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(2)]
    done = [proc.communicate(timeout=180) for proc in procs]
    assert procs[1].returncode == (1 if mode == "raise" else -9)
    assert procs[0].returncode == 1
    assert done[1][0] == ""  # process 1's standard output (gloo's lines too) goes nowhere
    ours = [line for line in done[0][1].splitlines() if line.startswith("jaxrl-llm test:")]
    if mode == "raise":
        assert ours == ["jaxrl-llm test: process 1 of 2 failed: RuntimeError: boom in process 1; ending process 0 "
                        "too"], done[0][1][-2000:]
        assert "RuntimeError: boom in process 1" in done[1][1]  # its own traceback
    else:
        assert len(ours) == 1 and ours[0].startswith("jaxrl-llm test: process 1 of 2 stopped responding"), \
            done[0][1][-2000:]
