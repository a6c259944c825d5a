import torch
import torch.nn.functional as F

from lmfunc.loss import masked_cross_entropy


def test_masked_cross_entropy_sum_and_count():
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]]).float()
    total, count = masked_cross_entropy(logits, labels, mask)
    per_token = F.cross_entropy(logits.view(-1, 11), labels.view(-1), reduction="none")
    torch.testing.assert_close(total, (per_token * mask.view(-1)).sum())
    assert float(count) == 7.0
    total, count = masked_cross_entropy(logits, labels)
    torch.testing.assert_close(total / count, F.cross_entropy(logits.view(-1, 11), labels.view(-1)))


def test_low_precision_logits_are_upcast():
    logits, labels = torch.randn(4, 7, 50) * 8, torch.randint(0, 50, (4, 7))
    total, count = masked_cross_entropy(logits.bfloat16(), labels)
    assert total.dtype == torch.float32
    reference = F.cross_entropy(logits.bfloat16().float().view(-1, 50), labels.view(-1), reduction="sum")
    torch.testing.assert_close(total, reference)
