"""Issue 53: dsa's forward peak memory against N at fixed top_k (both indexers), each N in
its own process (harness.measure.memory.peak_cpu_mib: VmHWM over VmRSS before the call),
B 1, H 4, D 64, causal, top_k 256; prints each peak and the slope of log peak against log N
from 4K to 16K (issue 53 asks for at most 1.2). Memory, not time: it need not run quiet.

    python tools/dsa_memory_slope.py
"""
import json
import math
import subprocess
import sys

if len(sys.argv) == 3:
    import torch
    import variants
    from harness.measure.memory import peak_cpu_mib
    torch.set_num_threads(1)
    N, indexer = int(sys.argv[1]), sys.argv[2]
    m = variants.build("dsa", top_k=256, indexer=indexer)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, N, 64, generator=g) for _ in range(3))
    ins = m.draw_inputs(1, 4, N, 64, seed=0)
    m(q[:, :, :300], k[:, :, :300], v[:, :, :300], causal=True,
      **{n: (x[:, :, :300] if x.dim() > 2 else x) for n, x in ins.items()})  # one-time costs
    with torch.no_grad():
        print(json.dumps({"N": N, "indexer": indexer,
                          "peak_mib": peak_cpu_mib(lambda: m(q, k, v, causal=True, **ins))}))
else:
    out = {}
    for indexer in ("heads", "lightning"):
        for N in (4096, 8192, 16384):
            r = json.loads(subprocess.run([sys.executable, __file__, str(N), indexer],
                                          capture_output=True, text=True, check=True).stdout)
            out[(indexer, N)] = r["peak_mib"]
            print(indexer, N, f"{r['peak_mib']:.1f} MiB", flush=True)
        a, b = out[(indexer, 4096)], out[(indexer, 16384)]
        print(indexer, "slope 4K-16K", f"{math.log(b / a) / math.log(4):.2f}")
