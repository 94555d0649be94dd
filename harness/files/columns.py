"""The names and columns of a run folder's files, shared by the code that writes them
(harness.measure, harness.drift) and the report that reads them.

Units are in the column names; a column that does not apply to a row is empty.
"""

RESULTS = "results.csv"        # one row per measured case (`run`)
ROUNDS = "rounds.jsonl"        # a run with rounds: each finished round of a case not yet a row
META = "meta.json"             # the matrix as run, versions, devices, times
MODEL_CSV = "model.csv"        # one row per (model, variant, params, seq_len) (`model`)
MODEL_META = "model_meta.json"
MAPS = "maps.npz"              # attention maps of one head (`run`, `maps`): harness.measure.maps
TRAIN_CSV = "train.csv"        # one row per trained configuration (`train`)
TRAIN_META = "train_meta.json"

# The exact variants every other one is set against (the report's "x sdpa" ratios, the
# drift baseline), fastest first.
EXACT_PATHS = ("sdpa", "standard")
# Reference ceilings (variants' `reference_ceiling`): the top-k oracle bounds what a k-sparse
# method can reach at its budget, at O(N^2) selection cost; the report's answers never offer
# it (tests/test_routed.py holds this list to the registry).
REFERENCE_CEILINGS = ("topk",)

# `exact`: the setting computes exact softmax attention at this row's length and causal
# flag (variants' `exact_at`: an exact path, or a window or layout that covers every pair).
# `state_mib`: memory the variant keeps between calls (a mask, a layout, features), built
# in its preparation or first call; `peak_mem_mib` is one call's peak above it.
# `state_size`: elements a causal decoder keeps at this length, B H state_size(N, D)
# (a KV cache 2 N D per head, a window 2 (w + 1) D, a recurrence D^2). Pass `decode` rows:
# time_ms is per generated token at context seq_len, decode_tokens the tokens generated,
# prefill_ms the context's prefill, decode_state_mib the decoding state's bytes at N
# (state_nbytes), decode_read_mib what one step moves of it: what it reads (all of it, or a
# sparse decoder's chosen blocks) and writes (a cache's new token, or the whole state
# again where the step rewrites it), in the state's own element size; flops and
# gflops_per_s are empty there.
# `err_ref`: what rel_err, max_abs_err and row_cos were measured against: `softmax` (float64
# exact attention) or `recurrence` (the variant's own float64 sequential recurrence, on
# decode rows its float64 causal forward over the same context and tokens: gated
# recurrences approximate no softmax); a run folder written before the column reads as
# softmax.
RESULT_COLUMNS = [
    "case_id", "variant", "family", "params", "exact", "device", "dtype", "batch", "heads",
    "head_dim", "seq_len", "causal", "pass", "input", "status", "reason", "time_ms",
    "time_ms_iqr", "repeats", "rounds", "time_ms_spread", "peak_mem_mib", "state_mib", "rel_err",
    "max_abs_err", "err_rows",
    "row_cos", "err_ref", "layer_rel_err", "compile_ms", "flops", "gflops_per_s", "threads", "seed",
    "state_size", "decode_tokens", "prefill_ms", "decode_state_mib", "keys_per_query",
    "decode_read_mib", "kv_heads", "value_heads", "value_dim", "decode_flops", "mass",
    "select_ms", "select_flops", "select_bytes"]
# Heads and widths of their own (variants.core.contract): kv_heads (grouped keys, Hk = Hv
# dividing heads), value_heads (grouped values, Hv a multiple of heads = Hk), value_dim
# (values' width Dv); empty where the default (heads, head_dim). Added last: a results.csv
# written before them resumes in its own columns (csvlog.CsvLog.later).
# decode_flops: pass `decode` rows only, the FLOPs of one generated token at context
# seq_len, batch included, summed over a stack's layers (variants' `decode_flops_at`: a
# softmax decoder 2 (Dk + Dv) per key read and query head, a recurrence its state's update
# and read per value head); empty where the variant does not say. The report's roofline
# bound is the larger of decode_read_mib at the run's read rate and this at its matmul
# rate (harness.report.generation); a folder written before it keeps its read bound.
# mass, select_ms: a run with `selection = true` (the Sparse Frontier), forward rows of a
# variant that selects keys: the mean over the error's rows of exact attention's float64
# mass on the keys the row attends to (1: nothing with weight left out), and the median
# time of the selection alone (`Variant.selection`: the gate, the indexer, the top-k),
# which time_ms includes; empty elsewhere. select_flops, select_bytes: the selection's
# scores a query, all heads, and the bytes they read (`Variant.selection_cost`: block
# statistics, compressed keys, indexer keys, keys), empty for a fixed pattern.
LATER_RESULT_COLUMNS = ("kv_heads", "value_heads", "value_dim", "decode_flops", "mass",
                        "select_ms", "select_flops", "select_bytes")
# keys_per_query: the mean number of keys a query attends to at this length and causal flag
# (variants' `keys_per_query`: N for exact attention, (N + 1) / 2 causal; a window, a
# block layout, top-k blocks, pages or keys: theirs), the budget on which sparse patterns,
# fixed and routed, compare; empty where attention is not over a subset of keys.

# time_ms_spread: the largest relative difference between two rounds' medians,
# (max - min) / min; above this the report flags the case (its ratios are that uncertain).
SPREAD_FLAG = 0.10

MODEL_COLUMNS = [
    "model", "variant", "family", "params", "device", "dtype", "seq_len", "windows",
    "causal", "status", "reason", "emb_cos", "hidden_rel_err", "kl", "ppl_ratio",
    "time_ms", "time_ms_iqr", "repeats", "peak_mem_mib", "threads", "seed"]

# One trained configuration: the task setting, the model, the sweep's outcome. accuracy is
# the best held-out accuracy over the learning rates tried (0..1); steps, time_to_best_s,
# step_ms, final_loss and rising belong to the run of the winning rate (best_lr); train_s is
# the wall time of the whole sweep; lrs is the JSON list of every rate in the sweep, in the
# order tried, lr_accuracy JSON {lr: accuracy or status} of those run (a rate of lrs missing
# there was not run: an earlier one reached early_stop); rising and lr_at_edge say whether
# the winning run was still improving and whether its rate is at an end of lrs
# (harness.train.trainer.still_rising, harness.train.runner.lr_at_edge); state_size is
# layers x heads x the variant's state_size(N, D) and state_bytes the same in float32; chance
# is the accuracy of a model that reads nothing (the task's floor); reach, for a variant with
# a fixed key pattern (windows, block layouts) in one layer, the share of held-out queries
# whose answer it can see (its ceiling). seed is the row's (a cell trains over several, the
# held-out set the first's); settled says whether the winning run reached early_stop or
# settled (harness.train.trainer.settled), steps_run how many steps it ran. plateau is the
# accuracy of a model that has learned the format and guesses among the context's
# candidates (harness.train.outcome), outcome what the winning run did: learned, partial,
# at_reach, not_learned or diverged (empty where nothing trained). accuracy is the test
# set's, scored once at the winning run's kept checkpoint; val_accuracy that run's best on
# the validation set, which picked the rate and stopped the run (older folders: one
# held-out set did both, accuracy its best, val_accuracy empty).
TRAIN_COLUMNS = [
    "config_id", "task", "task_params", "variant", "family", "params", "seq_len",
    "num_kv_pairs", "vocab_size", "causal", "d_model", "layers", "attention_layers", "mixer",
    "heads", "mlp", "batch",
    "max_steps", "device", "status", "reason", "accuracy", "val_accuracy", "best_lr", "lrs",
    "lr_accuracy",
    "lr_at_edge", "rising", "steps", "time_to_best_s", "steps_to_0_9", "step_ms", "train_s",
    "final_loss", "n_params", "state_size", "state_bytes", "chance", "plateau", "reach",
    "seed", "settled", "outcome", "steps_run", "threads", "metric", "bits_per_byte",
    "val_bits_per_byte", "unigram_bpb", "bigram_bpb", "hit_bpb", "other_bpb", "hit_share",
    "bpb_2n", "bpb_4n"]
# metric: what the task is scored by (issue 50): `accuracy` (higher is better) or
# `bits_per_byte` (lower is better; the `lm` task), which picked the rate, stopped the run and
# gave the outcome. On an lm row: bits_per_byte is the test split's (summed cross-entropy over
# every predicted byte / ln 2 / bytes) at the kept checkpoint, val_bits_per_byte that run's
# best on validation, unigram_bpb and bigram_bpb the train split's add-one n-grams on the same
# test bytes, hit_bpb and other_bpb bits per byte on recall hits (a byte whose 7-gram occurred
# earlier in its window and at most 100 times in train) and on the rest, hit_share the hits'
# share, bpb_2n and bpb_4n the test split at 2N and 4N (empty where a mixer does not take that
# length); accuracy the test bytes predicted right (arg-max), lr_accuracy each rate's best
# validation bits per byte, plateau the train unigram's bits per byte on validation.
# Columns train.csv gained after its first release (issues 29, 34, 35): a report of an older
# file reads them as empty (state_bytes from state_size).
TRAIN_LATER_COLUMNS = ["lrs", "lr_at_edge", "rising", "state_bytes", "settled", "steps_run",
                       "attention_layers", "mixer", "plateau", "outcome", "val_accuracy",
                       "metric", "bits_per_byte", "val_bits_per_byte", "unigram_bpb",
                       "bigram_bpb", "hit_bpb", "other_bpb", "hit_share", "bpb_2n", "bpb_4n"]
