"""The training worker: `python -m harness.train.worker` reads requests (JSON lines
{"config": ..., "lr": ..., "until": step}) on stdin and writes one result line per request
on stdout.

One request advances one training run (harness.train.trainer.Run) to step `until` (its
end without it) and answers with the run's result so far. The worker holds the runs of the
configuration it was last asked about, paused, so that the race (harness.train.race)
continues a rate's run instead of starting it again; a run it does not hold (a fresh
worker after one died) is started from step 0 and trained to `until`, which gives the
same numbers (the run is deterministic on the same threads). A request {"probe": config}
times a few steps of the configuration's model instead (the plan's estimate). With
"checkpoints": a folder, a run that ends leaves there its state from before its decay
(Run.checkpoint, `checkpoint_path`); with "extend": such a file, the request continues
that run under the request's larger cap (`train --extend-to`). The worker
caps its address
space during the run (harness.measure.memory), so a runaway allocation is an `oom` result,
not a swapped machine; anything else a run raises is an `error` result with its message.
The runner (harness.train.runner) kills the worker after the run's time limit and records a
worker that died (a crash, the kernel's OOM killer) as a row too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.measure import memory
from harness.measure.worker import describe, serve
from harness.train import rows
from harness.train.matrix import TrainConfig
from harness.train.trainer import Run

_RUNS: dict[tuple[str, float], Run] = {}  # the paused runs of one configuration


def checkpoint_path(folder: str | Path, config: TrainConfig, lr: float) -> Path:
    """Where a run's checkpoint from before its decay is kept (Run.checkpoint)."""
    return Path(folder) / f"{config.config_id}-lr{lr:g}.pt"


def advance(config: TrainConfig, lr: float, until: int | None = None,
            checkpoints: str | None = None, extend: str | None = None) -> dict:
    """The run of (config, lr), held or new, trained to `until` (default: its end); with
    `extend`, a run continued from that checkpoint file under config's larger cap. A run
    that ends with a checkpoint leaves it in the folder `checkpoints` (an extended run: in
    the file it was continued from)."""
    key = (config.config_id, lr)
    if key not in _RUNS:
        if any(k[0] != config.config_id for k in _RUNS):
            _RUNS.clear()  # another configuration: its runs are over
        plateau = rows.plateau_of(config)[0]
        _RUNS[key] = Run(config, lr, plateau=plateau) if extend is None else \
            Run.extend(torch.load(extend, weights_only=False), config, lr, plateau)
    run = _RUNS[key]
    out = run.advance(config.max_steps if until is None else until)
    if run.done:
        del _RUNS[key]
        if checkpoints is not None and run.checkpoint is not None:
            Path(checkpoints).mkdir(parents=True, exist_ok=True)
            torch.save(run.checkpoint, extend or checkpoint_path(checkpoints, config, lr))
    return out


def run_request(config: TrainConfig, lr: float, until: int | None = None,
                checkpoints: str | None = None, extend: str | None = None) -> dict:
    """One request as a result dict (status, reason, the trainer's fields)."""
    common = {"threads": config.threads}
    try:
        if config.device == "cpu":
            memory.cap_address_space(config.mem_limit_mib)
        try:
            return {**common, **advance(config, lr, until, checkpoints, extend)}
        finally:
            if config.device == "cpu":
                memory.lift_address_space_cap()
    except (MemoryError, torch.OutOfMemoryError) as e:
        _RUNS.pop((config.config_id, lr), None)
        return {**common, "status": "oom", "reason": describe(e)}
    except RuntimeError as e:
        _RUNS.pop((config.config_id, lr), None)
        status = "oom" if memory.is_oom_message(str(e)) else "error"
        return {**common, "status": status, "reason": describe(e)}
    except Exception as e:  # a variant's own failure is a row, with its message
        _RUNS.pop((config.config_id, lr), None)
        return {**common, "status": "error", "reason": describe(e)}


def probe_request(config: TrainConfig) -> dict:
    """A step's cost probed (harness.train.estimate.probe): {"status", "step_s"}."""
    from harness.train import estimate

    try:
        return {"status": "ok", "reason": "", "step_s": estimate.probe(config)}
    except Exception as e:  # the plan goes on: this step falls back to the FLOP model
        return {"status": "error", "reason": describe(e)}


def _handle(request: dict) -> dict:
    if "probe" in request:
        return probe_request(TrainConfig.from_json(request["probe"]))
    return run_request(TrainConfig.from_json(request["config"]), float(request["lr"]),
                       request.get("until"), request.get("checkpoints"), request.get("extend"))


def main() -> None:
    serve(_handle)


if __name__ == "__main__":
    main()
