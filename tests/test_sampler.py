import itertools

import pytest
import torch

from lmfunc.config import ConfigError
from lmfunc.data.sampler import RandomSampler, SequentialSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["sequential", "random", "random-unsharded"])
def test_restart_at_consumed_samples_continues_exactly(kind, dp):
    total, micro = 203, 3
    width = micro * dp

    def make(consumed, rank):
        if kind == "sequential":
            return SequentialSampler(total, consumed, micro, rank, dp)
        return RandomSampler(total, consumed, micro, rank, dp, data_sharding=kind == "random")

    steps = 2 * (total // width) + 3 if kind != "sequential" else total // width  # random: cross an epoch
    for rank in range(dp):
        full = take(make(0, rank), steps)
        assert len(full) == steps
        for k_steps in (1, 5, steps - 2):
            resumed = take(make(k_steps * width, rank), steps - k_steps)
            assert resumed == full[k_steps:], (rank, k_steps)


def test_sequential_ranks_split_each_global_batch():
    batches = [take(SequentialSampler(20, 4, 2, rank, 2), 10) for rank in range(2)]
    assert batches[0][:2] == [[4, 5], [8, 9]] and batches[1][:2] == [[6, 7], [10, 11]]
    assert len(batches[0]) == 4  # the incomplete last global batch (indices 20..) is dropped


def test_random_epochs_follow_megatron_and_shard_by_bucket():
    total, micro, dp = 20, 2, 2
    bucket = (total // (micro * dp)) * micro  # 10
    epoch0 = torch.randperm(bucket, generator=torch.Generator().manual_seed(0)).tolist()
    r1 = take(RandomSampler(total, 0, micro, 1, dp), 5)
    assert [i for b in r1 for i in b] == [bucket + x for x in epoch0]
    epoch1 = torch.randperm(bucket, generator=torch.Generator().manual_seed(1)).tolist()
    assert take(RandomSampler(total, 20, micro, 0, dp), 1) == [epoch1[:2]]
    unsharded = take(RandomSampler(total, 0, micro, 0, dp, data_sharding=False), 5)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(0)).tolist()
    assert [i for b in unsharded for i in b] == perm[0::2]


def test_bad_sampler_settings_are_named():
    with pytest.raises(ConfigError, match=r"consumed_samples \(30\) is not below the dataset's 20 samples"):
        SequentialSampler(20, 30, 2)
    with pytest.raises(ConfigError, match=r"data-parallel rank 2 is outside \[0, 2\)"):
        RandomSampler(20, 0, 2, rank=2, data_parallel_size=2)
    with pytest.raises(ConfigError, match=r"consumed_samples \(3\) is not a multiple of micro x dp = 4"):
        take(RandomSampler(20, 3, 2, 0, 2), 1)
