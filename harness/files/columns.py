"""The names and columns of a run folder's files, shared by the code that writes them
(harness.measure, harness.drift) and the report that reads them.

Units are in the column names; a column that does not apply to a row is empty.
"""

RESULTS = "results.csv"        # one row per measured case (`run`)
META = "meta.json"             # the matrix as run, versions, devices, times
MODEL_CSV = "model.csv"        # one row per (model, variant, params, seq_len) (`model`)
MODEL_META = "model_meta.json"
MAPS = "maps.npz"              # attention maps of one head (`run`, `maps`): harness.measure.maps

# The exact variants every other one is set against (the report's "x sdpa" ratios, the
# drift baseline), fastest first.
EXACT_PATHS = ("sdpa", "standard")

RESULT_COLUMNS = [
    "case_id", "variant", "family", "params", "device", "dtype", "batch", "heads",
    "head_dim", "seq_len", "causal", "pass", "input", "status", "reason", "time_ms",
    "time_ms_iqr", "repeats", "peak_mem_mib", "rel_err", "max_abs_err", "err_rows",
    "row_cos", "layer_rel_err", "compile_ms", "flops", "gflops_per_s", "threads", "seed"]

MODEL_COLUMNS = [
    "model", "variant", "family", "params", "device", "dtype", "seq_len", "windows",
    "causal", "status", "reason", "emb_cos", "hidden_rel_err", "kl", "ppl_ratio",
    "time_ms", "time_ms_iqr", "repeats", "peak_mem_mib", "threads", "seed"]
