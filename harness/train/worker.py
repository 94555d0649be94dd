"""The training worker: `python -m harness.train.worker` reads requests (JSON lines
{"config": ..., "lr": ...}) on stdin and writes one result line per request on stdout.

One request is one training run (harness.train.trainer.train). The worker caps its address
space during the run (harness.measure.memory), so a runaway allocation is an `oom` result,
not a swapped machine; anything else a run raises is an `error` result with its message.
The runner (harness.train.runner) kills the worker after the run's time limit and records a
worker that died (a crash, the kernel's OOM killer) as a row too.
"""

from __future__ import annotations


import torch

from harness.measure import memory
from harness.measure.worker import describe, serve
from harness.train.matrix import TrainConfig
from harness.train.trainer import train


def run_request(config: TrainConfig, lr: float) -> dict:
    """One training run as a result dict (status, reason, the trainer's fields)."""
    common = {"threads": config.threads}
    try:
        if config.device == "cpu":
            memory.cap_address_space(config.mem_limit_mib)
        try:
            return {**common, **train(config, lr)}
        finally:
            if config.device == "cpu":
                memory.lift_address_space_cap()
    except (MemoryError, torch.OutOfMemoryError) as e:
        return {**common, "status": "oom", "reason": describe(e)}
    except RuntimeError as e:
        status = "oom" if memory.is_oom_message(str(e)) else "error"
        return {**common, "status": status, "reason": describe(e)}
    except Exception as e:  # a variant's own failure is a row, with its message
        return {**common, "status": "error", "reason": describe(e)}


def main() -> None:
    serve(lambda request: run_request(TrainConfig.from_json(request["config"]),
                                      float(request["lr"])))


if __name__ == "__main__":
    main()
