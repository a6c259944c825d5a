"""``lmfunc.model.router`` and ``lmfunc.model.moe``: the router's choices, weights and losses against the formulas written out
here, the aux-loss-free bias step by hand, both expert paths against a per-token loop (fp64), and
the capacity path's drops under Megatron's two policies."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmfunc.model import moe, router


def per_token_moe(x, weights, experts, w_gate, w_up, w_down, keep=None):
    """Each token's chosen experts one by one: sum_j weight_j * SwiGLU_{e_j}(x_t)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            if keep is not None and not keep[t, j]:
                continue
            e = int(experts[t, j])
            hidden = F.silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            out[t] = out[t] + weights[t, j] * (hidden @ w_down[e])
    return out


def expert_weights(num_experts=4, hidden=8, ffn=12, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) / math.sqrt(shape[1])
            for shape in ((num_experts, hidden, ffn), (num_experts, hidden, ffn), (num_experts, ffn, hidden))]


def test_softmax_routing_takes_the_top_logits_then_normalises_them():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.2, 4.0]])
    weights, experts = router.route(logits, topk=2)
    assert experts.tolist() == [[1, 2], [3, 0]]
    e = math.exp
    assert weights[0].tolist() == pytest.approx([e(3) / (e(3) + e(2)), e(2) / (e(3) + e(2))])
    assert weights[1].tolist() == pytest.approx([e(4) / (e(4) + e(0.5)), e(0.5) / (e(4) + e(0.5))])
    pre, _ = router.route(logits, topk=2, pre_softmax=True, scaling_factor=2.5)
    whole = sum(e(v) for v in (1.0, 3.0, 2.0, 0.0))
    assert pre[0].tolist() == pytest.approx([2.5 * e(3) / whole, 2.5 * e(2) / whole])


def test_sigmoid_routing_with_a_bias_that_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.0, -1.0)]
    weights, experts = router.route(logits, topk=2, score_function="sigmoid")
    assert experts.tolist() == [[0, 1]] and weights[0].tolist() == pytest.approx([s[0] / (s[0] + s[1]), s[1] / (s[0] + s[1])])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])  # lifts expert 3 (score 0.27 + 1) above expert 1 (0.73)
    weights, experts = router.route(logits, topk=2, score_function="sigmoid", expert_bias=bias)
    assert experts.tolist() == [[3, 0]] and weights[0].tolist() == pytest.approx([s[3] / (s[0] + s[3]), s[0] / (s[0] + s[3])])
    single, _ = router.route(logits, topk=1, score_function="sigmoid")
    assert single[0].tolist() == pytest.approx([s[0]])  # one expert: its score, not normalised
    with pytest.raises(ValueError, match="sigmoid"):
        router.route(logits, topk=2, expert_bias=bias)


def test_group_limited_routing_picks_experts_only_from_the_best_groups():
    # 6 experts in 3 groups of 2; the plain top-2 is experts 0 and 3
    scores = torch.tensor([[0.9, 0.0, 0.8, 0.85, 0.1, 0.2]])
    assert scores.topk(2).indices.tolist() == [[0, 3]]
    # two groups, each scored by its best expert (topk 2 / 2 groups): groups 0 (0.9) and 1 (0.85)
    values, experts = router.group_limited_topk(scores, topk=2, num_groups=3, group_topk=2)
    assert experts.tolist() == [[0, 3]] and values[0].tolist() == pytest.approx([0.9, 0.85])
    # one group, scored by the sum of its best two: group 1 (1.65) beats group 0 (0.9)
    _, experts = router.group_limited_topk(scores, topk=2, num_groups=3, group_topk=1)
    assert experts.tolist() == [[3, 2]]
    weights, routed = router.route(torch.logit(scores), topk=2, score_function="sigmoid", num_groups=3, group_topk=1)
    assert routed.tolist() == [[3, 2]] and weights[0].tolist() == pytest.approx([0.85 / 1.65, 0.8 / 1.65])
    with pytest.raises(ValueError, match="divisible"):
        router.group_limited_topk(scores, topk=2, num_groups=4, group_topk=2)


def test_the_load_balancing_losses_follow_their_formulas():
    g = torch.Generator().manual_seed(0)
    batch, seq, experts, k, coeff = 3, 5, 4, 2, 0.01
    logits = torch.randn(batch * seq, experts, generator=g, dtype=torch.float64)
    scores, chosen = router.aux_loss_scores(logits, k, "softmax")
    assert torch.allclose(scores, torch.softmax(logits.float(), dim=-1))
    assert chosen.sum(dim=1).tolist() == [k] * (batch * seq)
    tokens = batch * seq
    f = chosen.float().sum(dim=0) / (tokens * k)
    p = scores.sum(dim=0) / tokens
    assert float(router.load_balancing_loss(scores, chosen, k, coeff)) == pytest.approx(coeff * experts * float((f * p).sum()))
    per_sequence = []
    for b in range(batch):
        s, c = scores.view(batch, seq, experts)[b], chosen.view(batch, seq, experts)[b]
        per_sequence.append(coeff * experts * float(((c.float().sum(0) / (seq * k)) * (s.sum(0) / seq)).sum()))
    got = router.sequence_load_balancing_loss(scores.view(batch, seq, experts), chosen.view(batch, seq, experts), k, coeff)
    assert float(got) == pytest.approx(sum(per_sequence) / batch)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / tokens
    assert float(router.router_z_loss(logits, 1e-3)) == pytest.approx(1e-3 * z, rel=1e-6)
    sig, _ = router.aux_loss_scores(logits, k, "sigmoid")
    assert torch.allclose(sig.sum(dim=-1), torch.ones(tokens))


def test_the_aux_loss_free_bias_moves_toward_the_mean_load():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    load = router.tokens_per_expert(experts, 5)
    assert load.tolist() == [4, 2, 1, 1, 0]  # mean 1.6
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0, 0.3])
    assert router.updated_expert_bias(bias, load, 0.01).tolist() == pytest.approx([0.09, -0.01, -0.19, 0.01, 0.31])
    keep = torch.tensor([[True, True], [False, True], [True, True], [True, True]])
    assert router.tokens_per_expert(experts, 5, keep).tolist() == [3, 2, 1, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dropless_experts_equal_a_per_token_loop(dtype):
    """fp64 (the experts looped) and fp32 (grouped matmuls), outputs and gradients against the fp64 loop."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 8, generator=g, dtype=torch.float64)
    routing = router.route(torch.randn(10, 4, generator=g), topk=2)
    weights = expert_weights()
    expected = per_token_moe(x, routing.weights.double(), routing.experts, *weights)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    inputs = [t.to(dtype).requires_grad_() for t in (x, *weights)]
    got = moe.experts_dropless(inputs[0], router.Routing(routing.weights, routing.experts), *inputs[1:])
    assert torch.allclose(got.double(), expected, atol=tolerance, rtol=tolerance)
    cotangent = torch.randn(10, 8, generator=g, dtype=torch.float64)
    reference = [t.clone().requires_grad_() for t in (x, *weights)]
    want = torch.autograd.grad(per_token_moe(reference[0], routing.weights.double(), routing.experts, *reference[1:]),
                               reference, cotangent)
    grads = torch.autograd.grad(got, inputs, cotangent.to(dtype))
    for a, b in zip(grads, want):
        assert torch.allclose(a.double(), b, atol=10 * tolerance, rtol=10 * tolerance)


def test_an_expert_never_chosen_gets_no_rows_and_zero_gradient():
    x = torch.randn(6, 8)
    routing = router.Routing(torch.full((6, 2), 0.5), torch.tensor([[0, 1]] * 6))
    weights = [w.float().requires_grad_() for w in expert_weights()]
    out = moe.experts_dropless(x, routing, *weights)
    grads = torch.autograd.grad(out.square().sum(), weights)
    assert all(float(g[2:].abs().sum()) == 0 for g in grads) and all(float(g[:2].abs().sum()) > 0 for g in grads)


def test_capacity_drops_what_megatrons_policies_drop():
    # 5 tokens, top-1, 2 experts, capacity 2: expert 0 gets tokens 0, 1, 3, 4 (weights .6 .9 .7 .8)
    routing = router.Routing(torch.tensor([[0.6], [0.9], [0.5], [0.7], [0.8]]), torch.tensor([[0], [0], [1], [0], [0]]))
    assert moe.expert_capacity(num_tokens=5, num_experts=2, topk=1, capacity_factor=0.8) == 2
    by_probs = moe.queue_positions(routing, 2, "probs")
    assert by_probs.reshape(-1).tolist() == [3, 0, 0, 2, 1]  # expert 0 ranks .9, .8, .7, .6
    by_position = moe.queue_positions(routing, 2, "position")
    assert by_position.reshape(-1).tolist() == [0, 1, 0, 2, 3]
    x = torch.randn(5, 8, dtype=torch.float64)
    weights = expert_weights(num_experts=2)
    for policy, kept_tokens in (("probs", [1, 2, 4]), ("position", [0, 1, 2])):
        out, keep = moe.experts_with_capacity(x, routing, *weights, capacity=2, policy=policy)
        assert keep.reshape(-1).nonzero().reshape(-1).tolist() == kept_tokens
        assert torch.allclose(out, per_token_moe(x, routing.weights.double(), routing.experts, *weights, keep=keep))
        dropped = [t for t in range(5) if t not in kept_tokens]
        assert float(out[dropped].abs().sum()) == 0


def test_among_pairs_of_equal_weight_a_full_expert_keeps_the_earliest_tokens():
    """The one intended difference from Megatron's "probs" policy, which ranks ties with
    ``torch.topk`` (unspecified among equal values): lmfunc keeps the earliest tokens, so a run's
    drops are the same on every machine."""
    routing = router.Routing(torch.full((6, 1), 0.5), torch.tensor([[0], [1], [0], [0], [1], [0]]))
    positions = moe.queue_positions(routing, 2, "probs").reshape(-1).tolist()
    assert positions == [0, 0, 1, 2, 1, 3]
    x = torch.randn(6, 8, dtype=torch.float64)
    _, keep = moe.experts_with_capacity(x, routing, *expert_weights(num_experts=2), capacity=2, policy="probs")
    assert keep.reshape(-1).nonzero().reshape(-1).tolist() == [0, 1, 2, 4]


def test_with_room_for_every_pair_the_capacity_path_is_the_dropless_one():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 8, generator=g)
    routing = router.route(torch.randn(12, 4, generator=g), topk=2, score_function="sigmoid")
    weights = [w.float() for w in expert_weights()]
    out, keep = moe.experts_with_capacity(x, routing, *weights, capacity=12)
    assert bool(keep.all())
    assert torch.allclose(out, moe.experts_dropless(x, routing, *weights), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_expert_paths_compile_to_one_graph_with_the_eager_values(dtype):
    """Compiled fullgraph, forward and backward: the grouped matmuls (a custom op) in every dtype."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=g).to(dtype)
    logits = torch.randn(16, 4, generator=g)
    weights = [w.to(dtype) for w in expert_weights(ffn=16)]

    def layer(x, logits, w_gate, w_up, w_down):
        routing = router.route(logits, topk=2)
        dropped, _ = moe.experts_with_capacity(x, routing, w_gate, w_up, w_down, capacity=6)
        dropless = moe.experts_dropless(x, routing, w_gate, w_up, w_down)
        grads = torch.autograd.grad(dropless.float().square().sum(), (x, w_gate, w_up, w_down))
        return (dropless.detach(), dropped.detach(), *grads)

    def run(fn):
        with torch.enable_grad():
            return fn(*(t.detach().requires_grad_(t.is_floating_point()) for t in (x, logits, *weights)))

    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = run(torch.compile(layer, fullgraph=True))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the rounding of a different op order
    for got, want in zip(compiled, run(layer)):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < tolerance
