"""How a preset's device memory divides over a multi-host run (`jaxrl-llm train PRESET --plan --hosts N`).

`memory_plan.plan` counts one device holding everything. In a run over `hosts` x `devices_per_host` devices the
mesh (`[mesh] data` x `fsdp`, -1 resolved over all the devices) splits it two ways, as `train.make_grpo_step`
places it:
- the weights and what follows them (params, gradients, optimizer moments, the KL reference) are sharded over
  `fsdp` (their embed axis) and replicated over `data`: each device holds 1 / fsdp of them;
- the games (the rollout's KV cache and the update's activations) are split over every device, data x fsdp:
  each device holds its rows of the batch (the batch must divide evenly).
A host holds its devices' share; the run's total counts each replica of the weights.
"""

from __future__ import annotations

import math
from typing import Any

from jaxrl_base.errors import ConfigError

GIB = 2**30
WEIGHTS = ("params", "grads", "optimizer", "reference")  # sharded over fsdp
BATCH = ("kv_cache", "activations")  # split over every device


def host_plan(config, result: dict[str, Any], hosts: int, devices_per_host: int) -> dict[str, Any]:
    """Per stage of `result` (`memory_plan.plan(config)`): bytes per device, per host and in all over `hosts` x
    `devices_per_host` devices, with the mesh axes. ConfigError when the mesh does not fit that many devices."""
    if hosts < 1 or devices_per_host < 1:
        raise ConfigError(f"--hosts ({hosts}) and --devices-per-host ({devices_per_host}) must be >= 1")
    devices = hosts * devices_per_host
    data, fsdp = config.mesh.axis_sizes(devices)
    stages = []
    for s in result["stages"]:
        games, rows = s["games"], s["micro_rows"]
        weights = sum(s[k] for k in WEIGHTS) / fsdp
        batch = s["kv_cache"] * math.ceil(games / devices) / games + \
            s["activations"] * math.ceil(rows / devices) / rows
        per_device = weights + batch
        stages.append({"stage": s["stage"], "games": games, "splits": games % devices == 0,
                       "weights": weights, "batch": batch, "device": per_device,
                       "host": per_device * devices_per_host, "run": per_device * devices})
    return {"hosts": hosts, "devices_per_host": devices_per_host, "data": data, "fsdp": fsdp, "stages": stages,
            "device": max((s["device"] for s in stages), default=0.0)}


def format_host_plan(plan: dict[str, Any]) -> str:
    """`host_plan` as a table (GiB), with a warning for a stage whose batch does not split over the devices."""
    devices = plan["hosts"] * plan["devices_per_host"]
    lines = [f"over {plan['hosts']} host(s) x {plan['devices_per_host']} device(s) = {devices} devices, mesh data "
             f"{plan['data']} x fsdp {plan['fsdp']}: the weights (params, grads, optimizer, reference) are sharded "
             f"{plan['fsdp']} ways, the games split {devices} ways",
             "| stage | games | weights / device | games / device | per device | per host | whole run (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for s in plan["stages"]:
        lines.append(f"| {s['stage']} | {s['games']} | {s['weights'] / GIB:.2f} | {s['batch'] / GIB:.2f} | "
                     f"{s['device'] / GIB:.2f} | {s['host'] / GIB:.2f} | {s['run'] / GIB:.2f} |")
    for s in plan["stages"]:
        if not s["splits"]:
            lines.append(f"warning: stage {s['stage']}'s {s['games']} games do not split evenly over {devices} "
                         f"devices: make num_prompts x group_size a multiple of {devices}")
    return "\n".join(lines)
