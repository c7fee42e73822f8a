"""The `jaxrl-llm` command line: experiment, sft, train, eval, play, export, plot, envs, check-env (and demo).

Each training command takes a TOML preset from `experiments/presets/` and `--set key=value` overrides,
validated before anything compiles; the env is the preset's `[env] name`. `jaxrl-llm envs` lists the
registered environments (built-ins and installed packages' entry points, group `jaxrl_llm.envs`); an env of
your own is `[env] name = "package.module:ClassName"`; `jaxrl-llm check-env NAME` runs `envs.check_env` on
it. `jaxrl-llm demo ENV` plays a batch of an env's games on the accelerator with the
pure environment (its random player against each evaluation opponent) and prints the metrics and games/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from jaxrl_llm.checks import ConfigError
from jaxrl_llm.cli.errors import note_config, report
from jaxrl_llm.cli.guards import check_metrics_inputs, load_preset, refuse_overwrite
from jaxrl_llm.cli.launch import add_launch_flags, run_command
from jaxrl_llm.log_sinks import close_sinks, open_sinks
from jaxrl_llm.metrics import MetricsWriter, format_metric, format_results_table, metric_kind, plot_metrics
from jaxrl_llm.schema import parse_override

# The modules above import no jax. jax, and every module that imports it (envs, config, train, checkpoint,
# models), is imported inside the command that needs it, so that `jaxrl-llm --help` answers at once.


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    """A random player against each of the env's evaluation opponents (`envs.random_play`): its metrics
    and games/s, with no model."""
    import jax  # lazy: jax (fast --help)

    from envs.random_play import play_random, random_games  # lazy: jax (fast --help)

    env = _env_from_args(args)
    if env is None:
        return 2
    print(f"JAX {jax.__version__} on {jax.devices()[0].platform}: env {env.name}, {args.games} games of a random "
          f"player per evaluation setting")
    rows = []
    for setting in env.eval_settings():
        key = jax.random.PRNGKey(args.seed)
        jax.block_until_ready(random_games(env, key, args.games, setting.stage, args.max_turns))  # compile
        start = time.perf_counter()
        jax.block_until_ready(random_games(env, key, args.games, setting.stage, args.max_turns))
        elapsed = time.perf_counter() - start
        rates = play_random(env, key, args.games, setting.stage, args.max_turns)
        rows.append({"setting": setting.name, **rates, "games_per_s": args.games / elapsed})
        shown = "  ".join(f"{k} {format_metric(v, 'mean' if k == 'turns' else metric_kind(env.metric_kinds, k))}"
                          for k, v in rates.items())
        print(f"{setting.name:>10} | {shown} | {args.games / elapsed:,.0f} games/s")
    print(json.dumps({"demo": rows}))
    return 0


def _load(args: argparse.Namespace):
    """The preset with its --set overrides, checked (`cli.guards.load_preset`) and noted for the Ctrl-C line."""
    overrides = list(args.set or ())
    if getattr(args, "accept_config_change", False):
        overrides.append("checkpoint.accept_config_change=true")
    config = load_preset(args.config, overrides)
    note_config(config)
    return config


def cmd_sft(args) -> int:
    from jaxrl_llm.train import run_sft  # lazy: jax (fast --help)

    run_sft(_load(args))
    return 0


def cmd_train(args) -> int:
    from jaxrl_llm.config import load_config  # lazy: jax (fast --help)
    from jaxrl_llm.train import fresh_start_warning, train_grpo  # lazy: jax (fast --help)

    if args.plan:  # planning needs no checkpoint on disk: init_from may be a folder not downloaded yet
        return print_plan(load_config(args.config, args.set or (), check_paths=False), args.hosts,
                          args.devices_per_host)
    config = _load(args)
    warning = fresh_start_warning(config)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    result = train_grpo(config, stop_after=args.stop_after)
    print(f"GRPO done at step {result['step']}; metrics in {result['metrics_path']}")
    return 0


def print_plan(config, hosts: int = 1, devices_per_host: int | None = None) -> int:
    """`train --plan`: `memory_plan.plan` as a table; over several hosts (or devices) how it divides
    (`host_plan`); then the compiled peak of a scaled-down update."""
    import jax  # lazy: jax (fast --help)

    from jaxrl_llm.host_plan import format_host_plan, host_plan  # lazy: jax (fast --help)
    from jaxrl_llm.memory_plan import GIB, compiled_peak, format_plan, plan  # lazy: jax (fast --help)

    result = plan(config)
    print(format_plan(result))
    if hosts > 1 or devices_per_host:
        print(format_host_plan(host_plan(config, result, hosts, devices_per_host or jax.local_device_count())))
    peak = compiled_peak(config)
    print(f"compiled GRPO update on {jax.default_backend()} ({peak['shape']}): peak "
          f"{peak['peak_bytes'] / GIB:.3f} GiB (arguments {peak['argument_bytes'] / GIB:.3f}, temporaries "
          f"{peak['temp_bytes'] / GIB:.3f})")
    return 0


def cmd_eval(args) -> int:
    from jaxrl_llm.train import build, evaluate, exactness_check, policy_source  # lazy: jax (fast --help)

    config = _load(args)
    if args.games:  # a file the user names is never replaced without --force (the run's own default is)
        refuse_overwrite(args.games, "--games", args.force)
    if args.checkpoint:  # a folder that does not fit is named before anything is built
        from jaxrl_llm.compat import check_checkpoint  # lazy: jax (fast --help)

        check_checkpoint(config, args.checkpoint)
    comp = build(config)
    params, step, source = policy_source(config, comp, args.checkpoint)
    out = Path(args.games or Path(config.run.output_dir) / "eval_games.jsonl")
    results = evaluate(comp, params, games_path=out)
    rows = [{"model": f"vs {name}", **r} for name, r in results.items()]
    print(format_results_table(rows, comp.env.results_columns, kinds=comp.env.metric_kinds))
    print(f"games written to {out}")
    logged = log_eval(config, results, step, source)
    print(f"metrics appended to {logged}" + (f" and to run.log's {', '.join(n for n in config.run.log if n != 'jsonl')}"
                                              if set(config.run.log) - {"jsonl"} else ""))
    summary = {"eval": results}
    check = exactness_check(comp, params)
    if check is not None:
        print(f"teacher-forced check on the teacher's {len(check['exact_rows'])} check conversations: "
              f"{100 * check['exact']:.2f} % exact (100 %: greedy play is the teacher's in every one of them)")
        summary["check_exact"] = check["exact"]
    print(json.dumps(summary))
    return 0


def log_eval(config, results: dict, step: int | None, source: str | None) -> Path:
    """Appends one row of `jaxrl-llm eval`'s results to <run.output_dir>/eval_metrics.jsonl (keys as the
    training's evaluations write them, `<setting>_<metric>`, with "command": "eval" and the checkpoint) and to
    the run.log sinks (TensorBoard, W&B; group "eval") at the checkpoint's step (0 when it has none)."""
    out = Path(config.run.output_dir)
    sinks = open_sinks(config.run.log, out)
    try:  # resume_step "infinity": every line already there is kept, the new one appended
        with MetricsWriter(out / "eval_metrics.jsonl", resume_step=sys.maxsize, sinks=sinks, group="eval") as w:
            w.write(step or 0, {f"{name}_{k}": v for name, r in results.items() for k, v in r.items()},
                    command="eval", checkpoint=source)
    finally:
        close_sinks(sinks)
    return out / "eval_metrics.jsonl"


def cmd_experiment(args) -> int:
    """SFT -> GRPO stages -> evaluation of the base, SFT and RL models; results table, curves, samples
    (`train.experiment.run_experiment`, one lock on the output folder for the whole arc)."""
    from jaxrl_llm.train.experiment import run_experiment  # lazy: jax (fast --help)

    run_experiment(_load(args))
    return 0


def cmd_play(args) -> int:
    from jaxrl_llm.cli.play import play_terminal  # lazy: jax (fast --help)

    config = _load(args)
    return play_terminal(config, checkpoint=args.checkpoint)


def check_export_folder(config, out: str, checkpoint: str | None, force: bool) -> Path:
    """Where `export --out` may write: never into the run's output folder or its checkpoint folders (nor the
    folder exported from), and into a non-empty folder only with --force. Returns the absolute folder."""
    from jaxrl_llm.train import sft_dir  # lazy: jax (fast --help)

    folder = Path(out).expanduser().absolute()
    real = folder.resolve()
    run = Path(config.run.output_dir).expanduser().resolve()
    guarded = [("the run's output folder (run.output_dir)", run, False),
               ("the run's checkpoint folder", Path(config.checkpoint_dir()).expanduser().resolve(), True),
               ("the run's SFT checkpoint folder", sft_dir(config).expanduser().resolve(), True)]
    if checkpoint:
        guarded.append(("the --checkpoint folder it exports from", Path(checkpoint).expanduser().resolve(), True))
    for what, path, inside in guarded:
        if real == path or (inside and path in real.parents):
            raise FileExistsError(f"--out {out} is {what} ({path}): an export never writes there (it would mix "
                                  "with checkpoints and metrics); choose another folder, e.g. --out "
                                  f"{run.name}_hf")
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if present and not force:
        shown = ", ".join(present[:5]) + (" ..." if len(present) > 5 else "")
        raise FileExistsError(f"--out {out} is not empty (it holds {shown}): choose a new or empty folder, or pass "
                              "--force to replace only the files an export writes (config.json, model.safetensors, "
                              "the tokenizer's files, jaxrl_llm_env.json, reply_grammar.json) and keep everything else")
    if "model.safetensors.index.json" in present:
        raise FileExistsError(f"--out {out} holds model.safetensors.index.json (a sharded checkpoint), which loaders "
                              "read before the exported model.safetensors; choose another folder or remove the "
                              "index and its shards yourself")
    return folder


def export_policy(comp, params, config, folder: Path) -> list[str]:
    """Writes the HF checkpoint, the tokenizer, the env record and the reply grammar (`export_grammar`: the
    regex beside the weights; a grammar with none is refused first) into a staging folder beside `folder`, then
    moves each file into `folder` (created if needed): files of other names there are left as they are.
    Returns the names written."""
    from jaxrl_llm.export_grammar import grammar_record, write_reply_grammar  # lazy: jax (fast --help)
    from jaxrl_llm.train import ENV_FILE, env_record  # lazy: jax (fast --help)
    from jaxrl_llm.train.components import merged_params  # lazy: jax (fast --help)
    from models.hf import save_hf  # lazy: jax (fast --help)

    grammar = comp.env.reply_grammar(comp.env.params)
    grammar_record(grammar, config.env.name)  # a grammar with no regex is refused before anything is written
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.export-", dir=folder.parent))
    try:
        staged = Path(save_hf(comp.model_config, merged_params(comp, params), stage / "export"))  # LoRA: merged
        comp.tokenizer.save_pretrained(staged)
        (staged / ENV_FILE).write_text(json.dumps(env_record(config), indent=1) + "\n")
        write_reply_grammar(staged, grammar, config.env.name)  # the reply regex for structured generation
        folder.mkdir(exist_ok=True)
        names = sorted(p.name for p in staged.iterdir())
        for name in names:
            os.replace(staged / name, folder / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return names


def cmd_export(args) -> int:
    from jaxrl_llm.train import build, policy_params  # lazy: jax (fast --help)

    config = _load(args)
    folder = check_export_folder(config, args.out, args.checkpoint, args.force)  # before any work
    comp = build(config)
    params = policy_params(config, comp, args.checkpoint)
    names = export_policy(comp, params, config, folder)
    print(f"exported a transformers {comp.model_config.architecture} checkpoint with its tokenizer and reply grammar to {folder} "
          f"({', '.join(names)})")
    return 0


def cmd_envs(args) -> int:
    """The registered environments (built-ins and installed packages' entry points) with their evaluation
    settings and results columns; an entry point that fails to import is listed with its error."""
    import envs  # lazy: jax (fast --help)

    installed = envs.entry_point_envs()
    for name in envs.registered():
        origin = f" (installed: {installed[name]})" if name in installed else ""
        try:
            cls = envs.env_class(name)
            env = cls()
            settings = ", ".join(s.name for s in env.eval_settings())
        except Exception as e:  # noqa: BLE001 - one broken package must not hide the others
            print(f"{name:14s} cannot load{origin}: {e}")
            continue
        columns = ", ".join(key for _, key in cls.results_columns)
        print(f"{name:14s} {cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ''}{origin}")
        print(f"{'':14s} eval settings: {settings}; metrics: {columns}")
    print("an env of your own: [env] name = \"package.module:ClassName\", or an installed package's entry point "
          f"(group {envs.ENTRY_POINT_GROUP!r}); `jaxrl-llm check-env NAME` checks it")
    return 0


def _env_from_args(args):
    """The env named by `args.env` with the `--set key=value` params of `args.set`, or None after printing the
    error (an unknown name, a bad param) to stderr."""
    import envs  # lazy: jax (fast --help)

    try:
        params = {".".join(key): value for key, value in map(parse_override, args.set or ())}
        return envs.make(args.env, **params)
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        print(f"jaxrl-llm {args.command}: {e}", file=sys.stderr)
        return None


def cmd_check_env(args) -> int:
    """`envs.check_env` on an env (a registered name, an entry point or a class path): each check passed (then
    any warning), or every failure on one line (exit 2, as every user error)."""
    import envs  # lazy: jax (fast --help)

    env = _env_from_args(args)
    if env is None:
        return 2
    try:
        passed = envs.check_env(env, max_turns=args.max_turns)
    except envs.EnvCheckError as e:
        print(f"jaxrl-llm check-env: env {args.env!r} fails {len(e.failures)} check(s): {'; '.join(e.failures)}",
              file=sys.stderr)
        return 2
    for line in passed:
        if not line.startswith("warning:"):
            print(f"ok: {line}")
    print(f"env {args.env!r} ({type(env).__module__}:{type(env).__qualname__}) passes every check")
    for line in passed:  # what passes but deserves a look comes last, where it is read
        if line.startswith("warning:"):
            print(line)
    return 0


def cmd_plot(args) -> int:
    check_metrics_inputs(args.metrics)
    refuse_overwrite(args.out, "--out", args.force)
    path = plot_metrics(args.metrics, args.out)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-llm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="an env's random player against its evaluation opponents, on device")
    demo.add_argument("env", help="a registered env (`jaxrl-llm envs` lists them)")
    demo.add_argument("--games", type=_positive_int, default=16384, help="games per evaluation setting")
    demo.add_argument("--max-turns", type=_positive_int, default=64, help="replies per game at most")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help="an env param, e.g. prompt=tiny")
    demo.set_defaults(func=cmd_demo)

    def with_config(name: str, help: str, func):
        p = sub.add_parser(name, help=help)
        p.add_argument("config", help="an experiment preset (TOML), e.g. experiments/presets/cpu.toml")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config value, e.g. --set grpo.0.learning_rate=3e-5 (repeatable)")
        p.set_defaults(func=func)
        if name in ("experiment", "sft", "train", "eval"):
            add_launch_flags(p)
        if name in ("experiment", "sft", "train"):
            p.add_argument("--accept-config-change", action="store_true",
                           help="resume a run whose training config differs from its checkpoint's, with the new "
                                "values (metrics.jsonl records the change; jaxrl_llm.run_config)")
        return p

    with_config("experiment", "the whole arc: SFT, GRPO stages, evaluation of base / SFT / RL models", cmd_experiment)
    with_config("sft", "SFT warm-up on expert games; saves <output_dir>/sft", cmd_sft)
    train = with_config("train", "GRPO stages (resumes from the last checkpoint)", cmd_train)
    train.add_argument("--stop-after", type=_positive_int, default=None, help="stop after this many global steps")
    train.add_argument("--plan", action="store_true",
                       help="print the device-memory plan of the preset's GRPO stages and XLA's peak for a "
                            "scaled-down update compiled here, then exit without training")
    train.add_argument("--hosts", type=_positive_int, default=1,
                       help="with --plan: how the memory divides over this many hosts (the preset's [mesh])")
    train.add_argument("--devices-per-host", type=_positive_int, default=None,
                       help="with --plan --hosts: accelerators per host (default: this machine's)")
    ev = with_config("eval", "the env's metrics in each of its evaluation settings", cmd_eval)
    ev.add_argument("--checkpoint", default=None, help="an Orbax checkpoint folder or a Hugging Face folder (default: the run's latest)")
    ev.add_argument("--games", default=None, help="JSONL file for the games (default <output_dir>/eval_games.jsonl); "
                    "an existing file is replaced only with --force")
    ev.add_argument("--force", action="store_true", help="replace the --games file if it exists")
    play = with_config("play", "play the model in the terminal", cmd_play)
    play.add_argument("--checkpoint", default=None, help="an Orbax checkpoint folder or a Hugging Face folder")
    export = with_config("export", "write the policy as a transformers checkpoint (its family's class)", cmd_export)
    export.add_argument("--checkpoint", default=None)
    export.add_argument("--out", required=True, help="output folder (new or empty; see --force)")
    export.add_argument("--force", action="store_true",
                        help="write into a non-empty folder, replacing only the files an export writes")
    envs_cmd = sub.add_parser("envs", help="list the registered environments")
    envs_cmd.set_defaults(func=cmd_envs)
    check = sub.add_parser("check-env", help="check an env against the protocol (envs.check_env), for env authors")
    check.add_argument("env", help="a registered name, an installed entry point or a class path package.module:Class")
    check.add_argument("--max-turns", type=_positive_int, default=16, help="replies per checked game at most")
    check.add_argument("--set", action="append", metavar="KEY=VALUE", help="an env param, e.g. prompt=tiny")
    check.set_defaults(func=cmd_check_env)
    plot = sub.add_parser("plot", help="draw training curves from metrics JSONL files to a PNG")
    plot.add_argument("metrics", nargs="+", help="metrics.jsonl files or run folders")
    plot.add_argument("--out", default="curves.png", help="the PNG to write (an existing file only with --force)")
    plot.add_argument("--force", action="store_true", help="replace the --out file if it exists")
    plot.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxrl-llm` script; the errors a user can fix (config, missing or damaged files,
    checkpoints that do not fit, a locked or existing run, a full disk) print one clear line and exit 2."""
    args = build_parser().parse_args(argv)
    return run_command(args, _dispatch)  # as it is, or as one process of a multi-host run (`cli.launch`)


def _dispatch(args: argparse.Namespace) -> int:
    """Runs the parsed command through the one user-facing error path (`cli.errors.report`): a user's error is
    one line and exit code 2, Ctrl-C one line and 130, a bug a traceback."""
    return report(args.command, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
