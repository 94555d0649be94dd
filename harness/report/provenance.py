"""Where a sharded run's cases ran, read from meta.json's `shards` records: the report's
warnings about mixed hardware and crowded nodes, and its table of shards."""

from __future__ import annotations

from collections import defaultdict


def hardware(record: dict) -> str:
    """What a shard's times depend on: CPU model, core count, CUDA devices it saw."""
    cuda = ", ".join(record.get("cuda_devices") or []) or "no CUDA"
    return f"{record.get('cpu_model')} x{record.get('cpu_count')}, {cuda}"


def environment_notes(meta: dict, devices: set[str]) -> list[str]:
    """The report's lines about where a sharded run's cases ran, warnings first."""
    recs = meta.get("shards") or []
    if not recs:
        return []
    notes = []
    kinds = sorted({hardware(r) for r in recs})
    if len(kinds) > 1:
        notes.append("Warning: this run's cases ran on different hardware (" + "; ".join(kinds)
                     + "): time and memory ratios across those machines are not comparable.")
    crowded = sorted({r["host"] for r in recs if r.get("shards_on_node", 1) > 1})
    if crowded and "cpu" in devices:
        most = max(r.get("shards_on_node", 1) for r in recs)
        notes.append(f"Warning: CPU timings were taken with up to {most} shards at once on one "
                     f"node ({', '.join(crowded)}): they shared its cores.")
    hosts = defaultdict(int)
    for r in recs:
        hosts[r["host"]] += 1
    notes.append(f"{len(recs)} shard(s) on host(s): "
                 + ", ".join(f"{h} ({n})" for h, n in sorted(hosts.items())) + ".")
    return notes


def shard_rows(recs: list[dict]) -> list[dict]:
    """One line per shard for the report: where it ran and how loaded the node was."""
    return [{"shard": r["shard"], "host": r["host"], "job": r.get("job_id"),
             "devices": ", ".join(r.get("cuda_devices") or []) or "cpu",
             "shards on node": r.get("shards_on_node"), "cases": r.get("cases"),
             "load (1 min) start/end": f"{(r.get('load_average_start') or ['?'])[0]} / "
                                       f"{(r.get('load_average_end') or ['?'])[0]}",
             "fp32 GFLOP/s": f"{r['matmul_fp32_gflops']:.0f}" if r.get("matmul_fp32_gflops")
             else "–"} for r in recs]
