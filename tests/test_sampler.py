"""The sampler on hand-made logits: greedy, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import make_sequence

from pagedserve.sampler import Sampler, build_sampling_metadata
from pagedserve.sampling_params import SamplingParams

V = 8


def req(prompt=(1,), output=(), seed=None, **kw):
    seq = make_sequence(list(prompt), SamplingParams(seed=seed, **kw), eos=0)
    for t in output:
        seq.append_token(t)
    if seed is not None:
        seq.seed = seed
    return seq


def sample(logits, reqs, seed=0):
    md = build_sampling_metadata(reqs, V, torch.device("cpu"))
    return Sampler()(torch.tensor(logits, dtype=torch.float32), md,
                     torch.Generator().manual_seed(seed))


LOGITS = [0.0, 1.0, 3.0, 2.9, 0.5, -1.0, 2.0, 0.0]


def test_greedy_is_argmax():
    assert sample([LOGITS], [req(temperature=0)]).token_ids == [2]


def test_top_k_1_and_tiny_top_p_are_greedy():
    for _ in range(20):
        assert sample([LOGITS], [req(top_k=1)]).token_ids == [2]
        assert sample([LOGITS], [req(top_p=0.01)]).token_ids == [2]


def test_top_k_and_top_p_restrict_the_support():
    seen_k, seen_p = set(), set()
    for s in range(300):
        seen_k.add(sample([LOGITS], [req(top_k=2)], seed=s).token_ids[0])
        seen_p.add(sample([LOGITS], [req(top_p=0.5)], seed=s).token_ids[0])
    assert seen_k == {2, 3}
    assert seen_p == {2, 3}  # p(2)+p(3) ~ 0.58 >= 0.5, p(2) ~ 0.3 < 0.5


def test_min_p_removes_unlikely_tokens():
    seen = {sample([LOGITS], [req(min_p=0.5)], seed=s).token_ids[0] for s in range(300)}
    assert seen <= {2, 3, 6} and {2, 3} <= seen  # e^2/e^3 = 0.37 < 0.5 -> 6 gone
    assert 6 not in seen


def test_sampling_frequencies_follow_temperature():
    counts = torch.zeros(V)
    for s in range(2000):
        counts[sample([LOGITS], [req(temperature=1.0)], seed=s).token_ids[0]] += 1
    probs = torch.tensor(LOGITS).softmax(-1)
    assert torch.allclose(counts / 2000, probs, atol=0.04)


def test_penalties():
    # repetition penalty 2 on seen tokens: 2 (prompt) -> 1.5, so 3 wins
    assert sample([LOGITS], [req(prompt=[2], temperature=0, repetition_penalty=2.0)]).token_ids == [3]
    # frequency penalty counts output occurrences only
    r = req(prompt=[3], output=[2, 2], temperature=0, frequency_penalty=0.1)
    assert sample([LOGITS], [r]).token_ids == [3]  # 3.0-0.2 < 2.9
    r = req(prompt=[1], output=[2], temperature=0, presence_penalty=0.2)
    assert sample([LOGITS], [r]).token_ids == [3]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = [[9.0, 0, 0, 0, 0, 8.0, 7.0, 0]]  # eos (0) then stop id 5 would win
    out = sample(logits, [req(temperature=0, min_tokens=2, stop_token_ids=[5])])
    assert out.token_ids == [6]
    out = sample(logits, [req(output=[1, 1], temperature=0, min_tokens=2, stop_token_ids=[5])])
    assert out.token_ids == [0]


def test_seeded_row_independent_of_batch_mates_and_position():
    alone = [sample([LOGITS], [req(seed=42)], seed=s).token_ids[0] for s in range(5)]
    assert len(set(alone)) == 1  # the engine's generator does not matter to a seeded row
    mates = [req() for _ in range(5)]
    batch = mates[:3] + [req(seed=42)] + mates[3:]
    out = sample([LOGITS] * 6, batch, seed=7)
    assert out.token_ids[3] == alone[0]


def test_logprobs_are_raw_and_ranked():
    out = sample([LOGITS], [req(prompt=[2], temperature=0, logprobs=3, repetition_penalty=1.5)])
    lp = torch.tensor(LOGITS).log_softmax(-1)
    assert out.token_ids == [3]  # the penalty moved the choice...
    assert math.isclose(out.sampled_logprobs[0], lp[3].item(), rel_tol=1e-6)  # ...not logprobs
    assert out.sampled_ranks == [2]
    assert out.top_ids[0] == [2, 3, 6]


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.5),
    dict(max_tokens=-1), dict(max_tokens=0), dict(n=0), dict(logprobs=21), dict(stop=[""]),
    dict(repetition_penalty=0), dict(presence_penalty=3), dict(temperature=float("nan")),
    dict(min_tokens=5, max_tokens=2), dict(logprobs=True), dict(max_tokens=True),
    dict(temperature=True), dict(seed=True), dict(seed=2**64), dict(seed="7"),
    dict(ignore_eos="no"), dict(include_stop_str_in_output="yes"), dict(output_kind="delta"),
    dict(stop=123), dict(stop_token_ids=5), dict(stop_token_ids=[True]),
    dict(repetition_penalty=1e-300), dict(repetition_penalty=1e5),
])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        SamplingParams(**bad)


def test_extreme_but_valid_values_stay_sane():
    # top_p rounds to 0 in float32: the most likely token must still be kept
    assert sample([LOGITS], [req(top_p=1e-300)]).token_ids == [2]
    # a huge temperature with a banned (-inf) token: uniform over the rest, never NaN
    out = sample([LOGITS], [req(temperature=1e300, min_tokens=1)])
    assert out.token_ids[0] != 0
