"""`BalancedBatchSampler`: each optimizer step's global batch, dealt to the ranks by cost instead of at random. Pure.

See `lightning_accum.sequences.balancing` for the arithmetic; this module is the ``torch.utils.data`` face of it.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from lightning_accum._util.validation import check_int
from lightning_accum.sequences import balancing

# The attributes Lightning reads to rebuild a batch sampler with its own sampler in it (`_wrap_init_method` and
# `_dataloader_init_kwargs_resolve_sampler` in lightning/fabric/utilities/data.py, 2.0 to 2.6). Lightning sets them on
# `BatchSampler` subclasses built inside a data hook; this sampler sets them itself, so that a DataLoader built
# anywhere is rebuilt with every argument it had. tests/test_balancing_sampler.py fails if Lightning changes them.
_LIGHTNING_SAVED = ("__pl_saved_args", "__pl_saved_kwargs", "__pl_saved_arg_names", "__pl_saved_default_kwargs")


class _Epoch:
    """What Lightning calls ``set_epoch`` on when it injected no sampler (it calls ``batch_sampler.sampler``'s)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this rank's share of each optimizer step's global batch, dealt so every rank's step costs the same.

    For split mode (`lightning_accum.AutoMicroBatching`, where the DataLoader yields a rank's whole step batch). Each
    epoch's samples are permuted with ``seed + epoch`` (as ``DistributedSampler(shuffle=True)``), cut into global step
    batches of ``batch_size`` samples, and each step batch is partitioned among the ranks by its samples' costs
    (`lightning_accum.sequences.balancing.partition`: the slowest rank as close to the mean as the lengths allow). Every
    rank computes the same deal from the same seed and lengths: no communication. Split mode is exact when ranks hold
    different numbers of samples, so the update is the one the same global batch dealt at random gives.

    **The global batch of a step does not depend on the number of ranks**: a run on 2 ranks and one on 4 train on the
    same global samples at every step, so a run resumed on another world size continues the same data order. Only
    their deal to the ranks differs. ``batch_size`` is therefore the *global* batch (all ranks together).

    Under Lightning's default ``use_distributed_sampler=True`` nothing needs changing: Lightning rebuilds the sampler
    with its ``DistributedSampler`` as ``sampler``, from which it takes the world size and rank (its order is not
    used). Lightning's ``set_epoch`` reaches it through ``sampler``. To resume mid-epoch on the same step batches, add
    `lightning_accum.callbacks.BalancedSamplerState` to the Trainer's callbacks.

    Ranks hold different numbers of samples, so the update is exact only where each rank's loss is weighed by its
    count: under `lightning_accum.AutoMicroBatching` (or `lightning_accum.AccumulationScheduler`, or
    `lightning_accum.FabricMicroBatching`). Plain DDP averages the ranks' mean losses: on several ranks with no such
    front end, the sampler warns once.

    Args:
        lengths: each sample's length in tokens, in dataset order (one per sample: a 1-D sequence or tensor); or a
            function of a sample that returns it, read once over ``dataset``.
        batch_size: the global step batch: samples per optimizer step over all ranks; at least the number of ranks.
        dataset: the dataset, when ``lengths`` is a function; given with lengths, it must hold one sample for each.
        num_replicas: the number of ranks (the world size); by default the injected ``sampler``'s, else
            ``torch.distributed``'s world size if it is initialized, else 1. Best left unset.
        rank: this rank; by default as ``num_replicas``. Best left unset: where every rank's settings are gathered
            (split mode), two ranks of one ``rank``, or a ``num_replicas`` other than the world size, are refused.
        seed: the permutation's seed (the epoch is added to it).
        drop_last: drop the epoch's last step batch when it holds fewer than ``batch_size`` samples. Kept, a last step
            batch with fewer samples than ranks takes samples from the epoch's first step batch, one a rank.
        method: how to deal by tokens (`lightning_accum.sequences.balancing.partition`): ``"best"`` (the default:
            Karmarkar-Karp's deal or greedy's, whichever puts less on the slowest rank), ``"karmarkar-karp"`` or
            ``"greedy"``. With ``micro_batch_tokens`` the deal is priced by the cut instead, and ``method`` is not
            used.
        quadratic: count ``length ** 2 / quadratic`` more per sample for attention (see
            `lightning_accum.sequences.balancing.sample_costs`); ``None`` counts tokens.
        micro_batch_tokens: the token budget split by tokens cuts each rank's share at (pass `AutoMicroBatching`'s
            ``micro_batch_tokens``). Given, each rank's step is priced as its cut costs (a fixed ``pass_cost_tokens``
            per micro-batch plus its padded tokens, and the ``quadratic`` term), and the deal makes the slowest rank's
            step as cheap as it finds: each rank a run of neighbouring lengths, which pads little and shares passes
            (`lightning_accum.sequences.balancing.deal`). Tokens alone balance the tokens, not the passes. ``None``:
            deal by tokens.
        pass_cost_tokens: a micro-batch pass's fixed cost in tokens
            (`lightning_accum.sequences.balancing.PASS_COST_TOKENS`, measured on a CPU, by default; measure yours with
            `lightning_accum.sequences.measure_step_cost`, on every rank).
        sampler: set by Lightning (a ``DistributedSampler``), for the world size, rank and epoch.

    Raises:
        TypeError: ``lengths`` is neither a sequence of ints nor a function, or is a function without ``dataset``.
        ValueError: ``lengths`` is not 1-D, a length is negative, ``lengths`` and ``dataset`` differ in count,
            ``batch_size < 1``, ``num_replicas < 1``, or ``rank`` is outside ``num_replicas``.

    Examples:
        >>> lengths = [30, 2, 3, 25, 4, 5, 20, 6]
        >>> [list(BalancedBatchSampler(lengths, 4, num_replicas=2, rank=r)) for r in (0, 1)]
        [[[4, 0], [6]], [[7, 3], [2, 5, 1]]]
    """

    def __init__(
        self,
        lengths: Sequence[int] | Callable[[Any], int],
        batch_size: int,
        *,
        dataset: Dataset[Any] | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        method: balancing.Method = "best",
        quadratic: float | None = None,
        micro_batch_tokens: int | None = None,
        pass_cost_tokens: float = balancing.PASS_COST_TOKENS,
        sampler: Any = None,
    ) -> None:
        self.lengths = _read_lengths(lengths, dataset)
        if dataset is not None:
            check_lengths_match(self, dataset)
        self.batch_size = check_int(batch_size, "batch_size", 1, hint="It is the global step batch, all ranks.")
        if num_replicas is not None:
            check_int(num_replicas, "num_replicas", 1, hint=_LEAVE_UNSET)
        if rank is not None:
            check_int(rank, "rank", 0, hint=_LEAVE_UNSET)
        if method not in balancing.METHODS:
            raise ValueError(f"`method` must be one of {balancing.METHODS}, got {method!r}.")
        self.num_replicas, self.rank, self.seed = num_replicas, rank, int(seed)
        self.drop_last, self.method, self.quadratic = bool(drop_last), method, quadratic
        self.sampler: Any = sampler if sampler is not None else _Epoch()
        self.costs = balancing.sample_costs(self.lengths, quadratic)
        self.step_cost = balancing.StepCost(micro_batch_tokens, float(pass_cost_tokens), quadratic)
        self._resume: tuple[int, int] | None = None  # (epoch, step batches already trained), set by `resume`
        self.weighed_by: str | None = None
        """The front end that weighs each rank's loss by its count, where one does (it says so, at the start of
        training); ``None`` on several ranks warns that the update is the ranks' mean of means."""
        self._warned = False
        world, me = self.world()  # checked now, not at the first batch
        del world, me
        kwargs = {
            "lengths": self.lengths,  # read once: a rebuilt sampler does not read the dataset again
            "batch_size": batch_size,
            "num_replicas": num_replicas,
            "rank": rank,
            "seed": seed,
            "drop_last": drop_last,
            "method": method,
            "quadratic": quadratic,
            "micro_batch_tokens": micro_batch_tokens,
            "pass_cost_tokens": pass_cost_tokens,
            "sampler": sampler,
        }
        for name, value in zip(_LIGHTNING_SAVED, ((), kwargs, (), {}), strict=True):
            object.__setattr__(self, name, value)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration draws (Lightning sets it through ``sampler.set_epoch``)."""
        return int(getattr(self.sampler, "epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s permutation next."""
        self.sampler.set_epoch(epoch)

    def world(self) -> tuple[int, int]:
        """The number of ranks and this rank: as given, else the injected sampler's, else ``torch.distributed``'s."""
        initialized = dist.is_available() and dist.is_initialized()
        world = self.num_replicas or getattr(self.sampler, "num_replicas", None)
        world = world or (dist.get_world_size() if initialized else 1)
        rank = self.rank if self.rank is not None else getattr(self.sampler, "rank", None)
        rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= rank < world:
            raise ValueError(
                f"`rank` must be in [0, num_replicas={world}), got rank={rank}. Pass the rank of this process."
            )
        return int(world), int(rank)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """The epoch's global step batches (sample indices), the same on every rank and at every world size."""
        epoch = self.epoch if epoch is None else epoch
        return balancing.global_batches(
            len(self.lengths), self.batch_size, seed=self.seed, epoch=epoch, drop_last=self.drop_last
        )

    def deal(self, batch: Sequence[int], num_replicas: int) -> list[list[int]]:
        """One global step batch dealt to ``num_replicas`` ranks: each rank's sample indices, in the batch's order."""
        if self.step_cost.knows_passes:  # by each rank's cut: its passes and padding, not its tokens alone
            parts = balancing.deal([self.lengths[i] for i in batch], num_replicas, self.method, self.step_cost)
        else:
            parts = balancing.partition([self.costs[i] for i in batch], num_replicas, self.method)
        return [[batch[p] for p in part] for part in parts]

    def deal_settings(self) -> dict[str, Any]:
        """What every rank's deal depends on (`ranks_deal_apart` compares them): the same on every rank, but ``rank``.

        The lengths as their count and a digest; ``num_replicas`` and ``rank`` as this sampler resolves them (each
        rank's own, all of them the world size). The epoch is Lightning's, the same on every rank.
        """
        digest = hashlib.sha256(array("q", self.lengths).tobytes()).hexdigest()[:16]
        world, rank = self.world()
        return {
            "num_replicas": world,
            "rank": rank,
            "lengths": f"{len(self.lengths)} lengths, sha256 {digest}",
            "batch_size": self.batch_size,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "method": self.method,
            "quadratic": self.quadratic,
            "micro_batch_tokens": self.step_cost.micro_batch_tokens,
            "pass_cost_tokens": self.step_cost.pass_cost_tokens,
        }

    def resume(self, epoch: int, consumed: int) -> None:
        """Start epoch ``epoch`` at its step batch ``consumed`` the next time it is drawn (a mid-epoch resume)."""
        self._resume = (int(epoch), int(consumed))

    def __iter__(self) -> Iterator[list[int]]:
        world, rank = self.world()
        if self.batch_size < world:
            raise ValueError(
                f"`BalancedBatchSampler(batch_size={self.batch_size})` is the global step batch, and {world} ranks"
                f" need at least one sample each. Pass `batch_size` of at least {world} (samples per rank x ranks)."
            )
        epoch, start = self.epoch, 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
        self._resume = None
        batches = self.global_batches(epoch)
        for drawn, batch in enumerate(batches[start:]):
            if drawn == 1:  # not at the first: Lightning draws it before the front ends' `on_train_start`
                self._warn_where_unweighed()
            if len(batch) < world:  # the kept last step batch: one sample a rank, as DistributedSampler pads
                batch = batch + batches[0][: world - len(batch)]
            yield self.deal(batch, world)[rank]

    def _warn_where_unweighed(self) -> None:
        """Warn once (on rank 0) where ranks run and no front end weighs each rank's loss by its count."""
        if self.weighed_by is not None or self._warned or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() < 2:
            return
        self._warned = True
        if dist.get_rank() == 0:
            warnings.warn(UNWEIGHED_SHARES, stacklevel=3)

    def __len__(self) -> int:
        steps = len(self.lengths) / self.batch_size
        return math.floor(steps) if self.drop_last else math.ceil(steps)

    def __repr__(self) -> str:
        return (
            f"BalancedBatchSampler({len(self.lengths)} samples, batch_size={self.batch_size}, seed={self.seed},"
            f" drop_last={self.drop_last}, method={self.method!r})"
        )


_LEAVE_UNSET = (
    "Leave `num_replicas` and `rank` unset: the sampler takes them from Lightning's `DistributedSampler`, else from"
    " `torch.distributed`."
)

UNWEIGHED_SHARES = (
    "`BalancedBatchSampler` deals the ranks different numbers of samples, and no lightning_accum front end weighs"
    " each rank's loss by its count: DDP averages the ranks' mean losses, so a sample counts more on a rank that holds"
    " fewer, and the update is not the mean over the global batch (`DistributedSampler`'s equal shares would be). For"
    " an exact update, train in split mode: add `lightning_accum.AutoMicroBatching` to the Trainer's callbacks (the"
    " DataLoader yields each rank's step batch, as this sampler deals it), or step through"
    " `lightning_accum.FabricMicroBatching.batches` in a Fabric loop; `AccumulationScheduler` weighs the ranks too."
)
"""The warning of a sampler on several ranks that no front end weighs (`BalancedBatchSampler.weighed_by`)."""


def check_lengths_match(sampler: BalancedBatchSampler, dataset: Any) -> None:
    """Raise where ``sampler`` holds other than one length for each of ``dataset``'s samples.

    A dataset with no length passes. Every front end that knows the sampler's dataset (its DataLoader's) calls it
    before training.

    Raises:
        ValueError: the counts differ, naming both: shorter, the last samples would never be trained; longer, the
            sampler would draw indices past the dataset's end.

    Example:
        >>> check_lengths_match(BalancedBatchSampler([3, 1, 2], 2), ["a", "b", "c"])
    """
    try:
        samples = len(dataset)
    except TypeError:  # an iterable dataset: it has no count to check
        return
    count = len(sampler.lengths)
    if count == samples:
        return
    if count < samples:
        what = f"samples {count} to {samples - 1} would never be trained"
    else:
        what = f"indices {samples} to {count - 1} are past the dataset's end (an IndexError in its `__getitem__`)"
    raise ValueError(
        f"`BalancedBatchSampler` has {count} `lengths` but its dataset has {samples} samples: {what}. Pass one length"
        " per sample, in dataset order (of a `Subset`, its own: `[lengths[i] for i in subset.indices]`), or"
        " `lengths=<function of a sample>` with `dataset=` to read them from the dataset itself."
    )


def _read_lengths(lengths: Any, dataset: Any) -> list[int]:
    if callable(lengths):
        if dataset is None:
            raise TypeError(
                "`BalancedBatchSampler(lengths=<function>)` reads each sample's length from the dataset: pass"
                " `dataset=` too, or pass the lengths themselves."
            )
        lengths = [lengths(dataset[i]) for i in range(len(dataset))]
    shape = tuple(getattr(lengths, "shape", ()))
    if len(shape) > 1 or (hasattr(lengths, "tolist") and len(shape) != 1):
        raise ValueError(
            f"`lengths` must be 1-D (one length a sample), got shape {shape}. For a (N, 1) tensor pass"
            " `lengths.squeeze(1)`; from a padding mask, `mask.sum(1)` (without `keepdim=True`)."
        )
    if hasattr(lengths, "tolist"):  # a tensor or an array
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(
            f"`lengths` must be each sample's length (a sequence of ints) or a function of a sample, got"
            f" {type(lengths).__name__}."
        )
    nested = next((n for n in lengths if isinstance(n, Sequence) and not isinstance(n, (str, bytes))), None)
    if nested is not None:
        raise ValueError(
            f"`lengths` must be 1-D (one int a sample), got a sequence holding {nested!r}. Flatten it: for [[n], ...]"
            " pass `[n for (n,) in lengths]`; from a padding mask, `mask.sum(1).tolist()`."
        )
    values = [int(n) for n in lengths]
    if any(n < 0 for n in values):
        raise ValueError(f"`lengths` must be non-negative, got {min(values)} at position {values.index(min(values))}.")
    return values


def ranks_deal_apart(every_rank: Sequence[Sequence[dict[str, Any]]]) -> str | None:
    """The error to raise where the ranks' `BalancedBatchSampler` settings differ; ``None`` if every rank deals alike.

    ``every_rank`` holds each rank's samplers' `BalancedBatchSampler.deal_settings`, by rank (as gathered: its length
    is the world size). Every setting must be the same on every rank, but ``rank``, which must differ on each, with
    ``num_replicas`` the world size: two ranks of one ``rank`` would train the same share, and another share never.

    Example:
        >>> one = {"seed": 0, "pass_cost_tokens": 112.0}
        >>> ranks_deal_apart([[one], [dict(one, pass_cost_tokens=150.5)]]).split(":")[0]
        "The ranks' `BalancedBatchSampler`s would deal apart"
    """
    first = every_rank[0]
    for rank, settings in enumerate(every_rank[1:], start=1):
        if len(settings) != len(first):
            return (
                f"Rank 0 has {len(first)} `BalancedBatchSampler` in its train DataLoader and rank {rank} has"
                f" {len(settings)}. Give every rank the same train DataLoader."
            )
    for position in range(len(first)):
        apart = _shares_apart([settings[position] for settings in every_rank])
        if apart:
            return apart
    for rank, settings in enumerate(every_rank[1:], start=1):
        for mine, theirs in zip(first, settings, strict=True):
            for name, value in mine.items():
                if name != "rank" and theirs.get(name) != value:
                    return (
                        f"The ranks' `BalancedBatchSampler`s would deal apart: `{name}` is {value!r} on rank 0 and"
                        f" {theirs.get(name)!r} on rank {rank}. Every rank computes each step's deal itself, so with"
                        f" different settings samples would be lost or trained on twice. Pass the same `{name}` on"
                        " every rank (a step cost from `measure_step_cost`, called on every rank, is the same on all)."
                    )
    return None


def _shares_apart(samplers: Sequence[dict[str, Any]]) -> str | None:
    """The error where one sampler's ranks (one a process) do not take each share of the deal once; else ``None``."""
    world = len(samplers)
    wrong = [
        (process, s["num_replicas"]) for process, s in enumerate(samplers) if s.get("num_replicas", world) != world
    ]
    if wrong:
        process, num_replicas = wrong[0]
        return (
            f"`BalancedBatchSampler(num_replicas={num_replicas})` on rank {process}, but {world} ranks train: each step"
            f" would be dealt in {num_replicas} shares, so samples would be lost or trained on twice. Leave"
            " `num_replicas` and `rank` unset (the sampler takes them from Lightning's `DistributedSampler`, else from"
            f" `torch.distributed`), or pass the world size, {world}."
        )
    holders: dict[int, list[int]] = {}
    for process, s in enumerate(samplers):
        if s.get("rank") is not None:
            holders.setdefault(int(s["rank"]), []).append(process)
    twice = next(((rank, processes) for rank, processes in holders.items() if len(processes) > 1), None)
    if twice is None:
        return None
    rank, processes = twice
    missing = sorted(set(range(world)) - set(holders))
    return (
        f"`BalancedBatchSampler(rank={rank})` on ranks {', '.join(map(str, processes))}: they would train the same"
        f" share of each step, and the share of rank {', '.join(map(str, missing))} never. Leave `rank` unset (the"
        " sampler takes it from Lightning's `DistributedSampler`, else from `torch.distributed`), or pass each"
        " process's own: `trainer.global_rank`, `fabric.global_rank` or `torch.distributed.get_rank()`."
    )
