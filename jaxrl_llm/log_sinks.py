"""Where metrics go besides the JSONL files: TensorBoard (tensorboardX, no TensorFlow) and Weights & Biases.

`[run] log = ["jsonl", "tensorboard", "wandb"]` chooses them ("jsonl" is always written: resume reads it).
Every row a `metrics.MetricsWriter` writes to metrics.jsonl, sft_metrics.jsonl or eval_metrics.jsonl goes
to each sink as scalars tagged `<group>/<key>` (group: grpo, sft, eval) at that row's step; sample games go
as text (`samples`). Non-numeric and non-finite values are left out of the scalars.

    sinks = open_sinks(config.run, out_dir, log)   # [] with the default ["jsonl"]
    writer = MetricsWriter(out_dir / "metrics.jsonl", resume_step=s, sinks=sinks, group="grpo")
    ...; close_sinks(sinks)

TensorBoard events go to `<output_dir>/tensorboard/` (a resumed run adds a new event file; TensorBoard
shows the latest value of a step). W&B runs offline unless WANDB_MODE says otherwise, in
`<output_dir>/wandb/`; without the `wandb` package a line says so and the run goes on without it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from jaxrl_llm import distributed

LOG_SINKS = ("jsonl", "tensorboard", "wandb")


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric values of a metrics row (bools and the bookkeeping keys step / time left out)."""
    out = {}
    for key, value in row.items():
        if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


class TensorBoardSink:
    """Scalars and text into a TensorBoard event file under `folder` (tensorboardX)."""

    def __init__(self, folder: str | os.PathLike):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError("run.log names 'tensorboard' but tensorboardX is not installed: "
                              "pip install 'jaxrl_llm[tb]' (or tensorboardX), or remove it from run.log") from None
        self.folder = Path(folder)
        self._writer = SummaryWriter(logdir=str(self.folder), flush_secs=10)

    def scalars(self, group: str, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(f"{group}/{key}", value, global_step=step)

    def text(self, tag: str, step: int, text: str) -> None:
        self._writer.add_text(tag, text, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """The same into a W&B run (offline by default: no network needed; `wandb sync` uploads it later)."""

    def __init__(self, wandb_module, folder: str | os.PathLike, name: str):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._wandb = wandb_module
        self._run = wandb_module.init(project="jaxrl_llm", name=name, dir=str(folder),
                                      mode=os.environ.get("WANDB_MODE", "offline"))

    def scalars(self, group: str, step: int, values: Mapping[str, float]) -> None:
        self._run.log({f"{group}/{k}": v for k, v in values.items()} | {f"{group}/step": step})

    def text(self, tag: str, step: int, text: str) -> None:
        self._run.log({tag: self._wandb.Html(f"<pre>{text}</pre>"), "samples/step": step})

    def close(self) -> None:
        self._run.finish()


def open_sinks(names: Sequence[str], output_dir: str | os.PathLike, log: Callable[[str], None] = print) -> list:
    """The sinks `names` (`RunSection.log`) asks for besides jsonl, writing under `output_dir` (none but process
    0's in a multi-host run)."""
    out, sinks = Path(output_dir), []
    if not distributed.is_writer():
        return sinks
    if "tensorboard" in names:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    if "wandb" in names:
        try:
            import wandb
        except ImportError:
            log("wandb is not installed (pip install wandb): logging to "
                f"{', '.join(n for n in names if n != 'wandb')} only")
        else:
            sinks.append(WandbSink(wandb, out / "wandb", out.name))
    return sinks


def close_sinks(sinks: Sequence) -> None:
    for sink in sinks:
        sink.close()
