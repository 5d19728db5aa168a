"""The metric keys that dashboards depend on (a contract: see docs/wandb.md). Units are in the names."""

from __future__ import annotations

EFFECTIVE_BATCH_SIZE = "accum/effective_batch_size"
MICRO_BATCH_SIZE = "accum/micro_batch_size"
ACCUMULATION_STEPS = "accum/accumulation_steps"
ITEMS_PER_STEP = "accum/items_per_step"
OOM_RETRIES = "accum/oom_retries"
WINDOW_LOSS = "accum/window_loss"

PEAK_GIB = "memory/peak_gib"
CAPACITY_GIB = "memory/capacity_gib"
PEAK_FRACTION = "memory/peak_fraction"
PEAK_RESERVED_GIB = "memory/peak_reserved_gib"  # CUDA only
BUDGET_FRACTION = "memory/budget_fraction"  # the memory budget as a fraction of capacity: the line on the dashboard

# With AccumulationMonitor(gradient_noise_scale=True): McCandlish et al. (2018), in items.
GRADIENT_NOISE_SCALE = "accum/gradient_noise_scale"  # B_simple = tr(Σ) / |G|²
GRAD_SQ_NORM = "accum/grad_sq_norm"  # |G|²
GRAD_TRACE_COV = "accum/grad_trace_cov"  # tr(Σ)
NOISE_SCALE_SKIPPED = "accum/noise_scale_skipped"  # windows whose estimate was NaN or inf, left out; cumulative

# Split mode by tokens only (`AutoMicroBatching(sequences=...)`): a run by samples never logs them.
MICRO_BATCH_TOKENS = "accum/micro_batch_tokens"  # the token budget: padded tokens per micro-batch, max over ranks
PADDING_FRACTION = "accum/padding_fraction"  # padded positions computed that held no real token, this step, all ranks

# Split mode on more than one rank (`AutoMicroBatching`, `FabricMicroBatching`): how unequal the ranks' steps were, with
# any sampler (`BalancedBatchSampler` deals the ranks equal work; with `DistributedSampler` it tells whether it would).
RANK_IMBALANCE = "accum/rank_imbalance"  # the slowest rank's step cost over the mean rank's: 1.0 when equal
SYNC_WAIT_SECONDS = "perf/sync_wait_seconds"  # the longest any rank waited for the others at the step's sync

# Split mode on more than one rank dealt by a `BalancedBatchSampler`: whether the price it deals by fits the compute.
PRICE_ERROR = "accum/price_error"  # the slowest rank's measured compute over the mean's, over accum/rank_imbalance
PRICE_KEYS = (PRICE_ERROR,)

# What the schedule aims at and how far training has come (every accumulation owner and Fabric front end), and with
# `AdaptiveBatchSize(objective="goodput")` what it weighs. A window of `accum/accumulation_steps` micro-batches may be
# an epoch's short tail, so `accum/target_accumulation_steps` is the schedule's own k (a fixed schedule's, or the
# adaptive schedule's unclamped target) and never dips with it.
TARGET_ACCUMULATION_STEPS = "accum/target_accumulation_steps"  # micro-batches per step the schedule aims at
SAMPLES_SEEN = "accum/samples_seen"  # samples consumed since the start of training, all ranks (carried by a checkpoint)
ITEMS_SEEN = "accum/items_seen"  # items (samples or tokens) consumed since the start of training, all ranks
STATISTICAL_EFFICIENCY = "accum/statistical_efficiency"  # progress per item at this batch: 1 / (1 + B / B_noise)
STEP_OVERHEAD_SECONDS = "perf/step_overhead_seconds"  # the step's fixed part: sync, optimizer step, zero_grad
SCHEDULE_KEYS = (TARGET_ACCUMULATION_STEPS, SAMPLES_SEEN, ITEMS_SEEN)
GOODPUT_KEYS = (STATISTICAL_EFFICIENCY, STEP_OVERHEAD_SECONDS)

ALLOC_RETRIES = (
    "memory/alloc_retries"  # CUDA/XPU only: the caching allocator's retries after a failed malloc, cumulative
)
TRAIN_SECONDS = "perf/train_seconds"  # wall-clock training time of the run (carried by a checkpoint), no validation

SAMPLES_PER_SEC = "perf/samples_per_sec"
ITEMS_PER_SEC = "perf/items_per_sec"

# Events: logged as metrics at the step they happen (the value is the size after the change: samples, or split by
# tokens the token budget); in callback_metrics at that step only, and after fit the fit's count of them.
EVENT_SCHEDULE_CHANGE = "events/accumulation_steps_changed"
EVENT_OOM_RECOVERED = "events/oom_recovered"
EVENT_SHRINK = "events/micro_batch_shrunk"
EVENT_GROW = "events/micro_batch_grown"

BATCH_KEYS = (EFFECTIVE_BATCH_SIZE, MICRO_BATCH_SIZE, ACCUMULATION_STEPS, ITEMS_PER_STEP)
MEMORY_KEYS = (PEAK_GIB, CAPACITY_GIB, PEAK_FRACTION, PEAK_RESERVED_GIB, BUDGET_FRACTION, ALLOC_RETRIES)
PERF_KEYS = (SAMPLES_PER_SEC, ITEMS_PER_SEC, TRAIN_SECONDS)
EVENT_KEYS = (EVENT_SCHEDULE_CHANGE, EVENT_OOM_RECOVERED, EVENT_SHRINK, EVENT_GROW)
NOISE_SCALE_KEYS = (GRADIENT_NOISE_SCALE, GRAD_SQ_NORM, GRAD_TRACE_COV, NOISE_SCALE_SKIPPED)
TOKEN_KEYS = (MICRO_BATCH_TOKENS, PADDING_FRACTION)
RANK_KEYS = (RANK_IMBALANCE, SYNC_WAIT_SECONDS)
ALL_KEYS = (*BATCH_KEYS, OOM_RETRIES, WINDOW_LOSS, *MEMORY_KEYS, *PERF_KEYS)
