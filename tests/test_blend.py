import os

import numpy as np
import pytest

from lmfunc.config import ConfigError
from lmfunc.data.blend import BlendedDataset, MockIndexed, blending_indices, component_sizes, parse_blend
from lmfunc.data.gpt_dataset import GPTDataset


def test_blend_syntax():
    assert parse_blend("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_blend("1 a 3 b")[1] == [0.25, 0.75]
    assert parse_blend("a b") == (["a", "b"], None) and parse_blend("a") == (["a"], None)
    for bad, message in [("0.3 a b", "weights don't parse; expected pairs"), ("x a 0.5 b", "mixes weights and prefixes"),
                         ("0 a 0 b", "positive sum"), ("0.5 0.5 a b", r"weights \[.0.5., .a.\] must be non-negative numbers"), ("0.5 a 0.5 1", "a prefix position holds a number"),
                         ("", "data.path is empty")]:
        with pytest.raises(ConfigError, match=message):
            parse_blend(bad)


def test_blending_follows_the_lagging_share():
    dataset_index, sample_index = blending_indices([0.3, 0.7], 10)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    for d in (0, 1):
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))
    assert blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]  # ties go to the lowest index
    counts = np.bincount(blending_indices([0.2, 0.5, 0.3], 1000)[0])
    assert counts.tolist() == [200, 500, 300]
    assert component_sizes([0.3, 0.7], 1000) == ([302, 704], [300, 700])


def test_blended_dataset_reads_components_and_caches(tmp_path):
    mock_a, mock_b = MockIndexed(vocab_size=50, eod=0, num_documents=20), MockIndexed(vocab_size=7, eod=0, num_documents=20)
    requested, targets = component_sizes([0.25, 0.75], 40)
    parts = [GPTDataset(m, np.arange(20), n, 16, seed=1, cache_dir=str(tmp_path)) for m, n in zip((mock_a, mock_b), requested)]
    blend = BlendedDataset(parts, [0.25, 0.75], sum(targets), cache_dir=str(tmp_path))
    assert len(blend) == 40
    for j in range(40):
        d, k = int(blend.dataset_index[j]), int(blend.dataset_sample_index[j])
        np.testing.assert_array_equal(blend[j], parts[d][k])
    assert max(blend[j].max() for j in range(40) if blend.dataset_index[j] == 1) < 7
    assert any(name.endswith("BlendedDataset-train-description.txt") for name in os.listdir(tmp_path))
    with pytest.raises(ConfigError, match="blend component 0 has"):
        BlendedDataset(parts, [0.9, 0.1], 20_000)


def test_mock_documents_follow_megatron():
    mock = MockIndexed(vocab_size=1000, eod=999, num_documents=5)
    assert mock.sequence_lengths.tolist() == np.random.default_rng(0).integers(1, 4096, 5, dtype=np.int32).tolist()
    doc = mock[0]
    assert len(doc) == mock.sequence_lengths[0] and doc[-1] == 999 and doc[:3].tolist() == [1, 2, 3]
    np.testing.assert_array_equal(mock.get(0, 2, 3), doc[2:5])


def test_mock_data_uses_megatrons_forced_split_whatever_data_split_says(tmp_path):
    """Megatron's BlendedMegatronDatasetConfig sets split "1,1,1" for mock data: every split gets a
    third of the mock documents, so the samples equal Megatron's --mock-data ones."""
    from lmfunc.config.train import DataConfig
    from lmfunc.data.pipeline import build_datasets
    from lmfunc.data.tokenizer import ByteTokenizer

    requested = {"train": 8, "valid": 4, "test": 4}
    built = [build_datasets(DataConfig(mock=True, split=split, seq_length=4096), ByteTokenizer(), requested, 1,
                            str(tmp_path / split.replace(",", "_"))) for split in ("90,10,0", "1,1,1")]
    for name in requested:
        configured, forced = built[0][name], built[1][name]
        assert configured is not None, f"{name}: mock data must ignore data.split's 0 weight"
        assert np.array_equal(np.unique(configured.document_index), np.unique(forced.document_index))
        assert all(np.array_equal(configured[i], forced[i]) for i in range(len(forced)))
    third = 100_000 // 3
    assert np.unique(built[1]["train"].document_index).max() < third + 1
