"""Sampling: filters never choose outside their set, temperature follows softmax, penalty as transformers."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxllm
from jaxllm.engine import sampling
from jaxllm.engine.sampling import apply_repetition_penalty

V = 64
DRAWS = 400  # per row and seed


@partial(jax.jit, static_argnames=("draws", "use_top_k", "use_top_p", "use_min_p"))
def _draw(logits_RV, seed, temperature, top_k, top_p, min_p, *, draws, use_top_k, use_top_p, use_min_p):
    """[R, draws] samples: each row repeated `draws` times, one key for the whole batch."""
    batch = jnp.repeat(logits_RV, draws, axis=0)
    tokens = jaxllm.sample(batch, jax.random.key(seed), temperature, top_k, top_p, min_p, greedy=False,
                           use_top_k=use_top_k, use_top_p=use_top_p, use_min_p=use_min_p)
    return tokens.reshape(logits_RV.shape[0], draws)


def draw(logits, seed, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, draws=DRAWS) -> np.ndarray:
    return np.asarray(_draw(jnp.asarray(logits, jnp.float32), seed, jnp.float32(temperature),
                            jnp.int32(top_k), jnp.float32(top_p), jnp.float32(min_p), draws=draws,
                            use_top_k=top_k > 0, use_top_p=top_p < 1, use_min_p=min_p > 0))


def _softmax(z):
    z = z - z.max()
    return np.exp(z) / np.exp(z).sum()


def allowed_sets(logits, temperature, top_k, top_p, min_p) -> tuple[np.ndarray, np.ndarray]:
    """Per row, in float64: (allowed mask [R, V], distribution over it [R, V]).

    Definitions as transformers states them: top-k keeps the k largest (ties with the k-th kept),
    top-p the smallest set of most likely tokens whose mass reaches top_p, min-p the tokens with
    probability >= min_p * the largest; each applies to what the previous filter left.
    """
    masks, dists = [], []
    for row in np.asarray(logits, np.float64) / temperature:
        keep = np.ones(V, bool)
        if top_k:
            keep &= row >= np.sort(row)[::-1][top_k - 1]
        if top_p < 1:
            p = np.where(keep, _softmax(np.where(keep, row, -np.inf)), 0.0)
            order = np.argsort(-p, kind="stable")
            mass_before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
            n_keep = max(1, int(np.sum(mass_before < top_p)))
            top = np.zeros(V, bool)
            top[order[:n_keep]] = True
            keep &= top
        if min_p:
            p = _softmax(np.where(keep, row, -np.inf))
            keep &= p >= min_p * p.max()
        masks.append(keep)
        dists.append(_softmax(np.where(keep, row, -np.inf)))
    return np.array(masks), np.array(dists)


def _hf_allowed(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The same sets from transformers' own logits warpers."""
    scores = torch.as_tensor(np.asarray(logits, np.float32))
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(transformers.MinPLogitsWarper(min_p))
    ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)
    for w in warpers:
        scores = w(ids, scores)
    return torch.isfinite(scores).numpy()


FILTERS = [
    dict(top_k=5),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(top_k=12, top_p=0.8, min_p=0.05, temperature=0.7),
    dict(top_p=0.9, temperature=1.5),
    dict(top_k=1, temperature=2.0),
]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filters_never_choose_outside_their_set(filters):
    logits = np.random.default_rng(0).normal(0, 2.0, (8, V)).astype(np.float32)
    args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | filters
    mask, dist = allowed_sets(logits, **args)
    np.testing.assert_array_equal(mask, _hf_allowed(logits, **args))  # the reference is transformers'
    assert mask.sum(axis=1).max() > 1 or args["top_k"] == 1  # the set is not trivially the argmax
    seen = np.zeros_like(mask)
    for seed in range(5):
        tokens = draw(logits, seed, **args)
        for r in range(len(logits)):
            outside = set(tokens[r].tolist()) - set(np.flatnonzero(mask[r]).tolist())
            assert not outside, f"row {r} chose {outside}, outside its set"
            seen[r, tokens[r]] = True
    # ...and every token of the set that is not vanishingly rare is chosen at some point.
    never_chosen = mask & (dist > 0.01) & ~seen
    assert not never_chosen.any(), f"allowed tokens never chosen: {np.argwhere(never_chosen)}"


def _chi_square(counts, probs) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _binned_chi_square(counts, probs, min_expected=5.0) -> tuple[float, int]:
    """Chi-square of counts against probs, the tokens expected fewer than min_expected times pooled
    into one bin; (statistic, degrees of freedom)."""
    expected = probs * counts.sum()
    rare = expected < min_expected
    obs = np.append(counts[~rare], counts[rare].sum())
    exp = np.append(expected[~rare], expected[rare].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@pytest.mark.slow
@pytest.mark.parametrize("filters", [f for f in FILTERS if f.get("top_k") != 1],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filtered_sampling_follows_the_softmax_of_what_is_left(filters):
    """Within the set a filter keeps, each token comes as often as the softmax over that set says
    (transformers renormalizes the same way), not uniformly or by the unfiltered softmax."""
    logits = np.random.default_rng(1).normal(0, 2.0, (8, V)).astype(np.float32)
    args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | filters
    mask, dist = allowed_sets(logits, **args)
    tokens = draw(logits, 7, draws=20000, **args)
    checked = 0
    for r in range(len(logits)):
        if mask[r].sum() < 3:
            continue
        counts = np.bincount(tokens[r], minlength=V).astype(np.float64)
        chi, dof = _binned_chi_square(counts, dist[r])
        # Far in the tail for these degrees of freedom (mean dof, sd sqrt(2 dof)): < 1e-6.
        bound = dof + 8 * np.sqrt(2 * dof) + 10
        assert chi < bound, f"row {r}: chi-square {chi:.1f} over {dof} dof against the softmax of the set"
        uniform = np.where(mask[r], 1.0 / mask[r].sum(), 0.0)
        assert _binned_chi_square(counts, uniform)[0] > bound  # the bound tells a uniform draw apart
        checked += 1
    assert checked >= 4


def test_temperature_sampling_follows_softmax():
    logits = np.array([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0]], np.float32)
    temperature = 0.7
    tokens = np.asarray(_draw(jnp.asarray(logits), 0, jnp.float32(temperature), jnp.int32(0),
                              jnp.float32(1), jnp.float32(0), draws=40000, use_top_k=False,
                              use_top_p=False, use_min_p=False))[0]
    counts = np.bincount(tokens, minlength=8).astype(np.float64)
    # 7 degrees of freedom: chi-square exceeds 30 with probability < 1e-4.
    assert _chi_square(counts, _softmax(logits[0] / temperature)) < 30
    assert _chi_square(counts, _softmax(logits[0])) > 300  # the bound can tell temperatures apart


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).normal(0, 1, (16, V)).astype(np.float32)
    np.testing.assert_array_equal(jaxllm.sample(jnp.asarray(logits), jax.random.key(0)), logits.argmax(-1))


@pytest.mark.parametrize("vocab", [151936, 49152, 1000, 37])  # 128 blocks, 128, 8, none
def test_greedy_argmax_in_blocks_is_the_first_largest(vocab):
    """`sampling.argmax` (ARGMAX_BLOCKS blocks, then the blocks) picks what numpy's argmax picks:
    the first of equal maxima, and the first NaN where there is one."""
    rng = np.random.default_rng(vocab)
    cases = [rng.normal(0, 1, (3, vocab)), np.round(rng.normal(0, 1, (3, vocab)))]  # many ties
    nan = rng.normal(0, 1, (3, vocab))
    nan[1, rng.integers(vocab)] = np.nan
    nan[2, rng.integers(vocab, size=3)] = np.nan
    flat = np.zeros((3, vocab))
    flat[0, 5::7] = -0.0
    flat[1, -1], flat[2] = np.inf, -np.inf
    for logits in (*cases, nan, flat):
        logits = logits.astype(np.float32)
        for pick in (sampling.argmax, jax.jit(sampling.argmax)):  # op by op, and fused
            np.testing.assert_array_equal(pick(jnp.asarray(logits)), logits.argmax(-1))


def test_order_keys_order_as_the_floats_do():
    """The int32 keys greedy's argmax compares: numpy's integer argmax over them (the first of equal
    keys) picks what its float argmax picks, NaNs, infinities, -0.0 and ties included; on a GPU XLA's
    float argmax picked the last of three NaNs at a 37-token vocabulary."""
    rng = np.random.default_rng(0)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)
    for _ in range(200):
        x = rng.choice(np.concatenate([specials, rng.normal(0, 1, 6).astype(np.float32)]), size=(4, 9))
        keys = np.asarray(sampling._order_keys(jnp.asarray(x)))
        np.testing.assert_array_equal(keys.argmax(-1), x.argmax(-1))
        np.testing.assert_array_equal(np.asarray(sampling.argmax(jnp.asarray(x))), x.argmax(-1))


def test_same_key_same_tokens_other_key_other_tokens():
    logits = np.random.default_rng(2).normal(0, 1, (4, V)).astype(np.float32)
    a, b, c = (draw(logits, seed, top_p=0.95) for seed in (11, 11, 12))
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.5


@pytest.mark.parametrize("penalty", [1.7, 0.6])
def test_repetition_penalty_matches_transformers(penalty):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (4, V)).astype(np.float32)
    history = rng.integers(0, V, (4, 10))  # token ids already in each row (repeats allowed)
    seen = np.zeros((4, V), bool)
    seen[np.arange(4)[:, None], history] = True
    got = np.asarray(apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), jnp.float32(penalty)))
    ref = transformers.RepetitionPenaltyLogitsProcessor(penalty)(
        torch.as_tensor(history), torch.as_tensor(logits)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(got[~seen], logits[~seen])  # unseen tokens untouched
    if penalty > 1:  # seen tokens lose, whatever their sign
        assert (got[seen] < logits[seen]).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), r"temperature must be >= 0"),
    (dict(temperature=1.0, top_p=2), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_k=-1), r"top_k must be .*>= 0"),
    (dict(temperature=1.0, min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(temperature=jnp.float32(np.inf)), r"temperature must be >= 0 .*finite"),
    (dict(temperature=1e39), r"temperature must be .*normal float32"),
    (dict(temperature=True), r"temperature must be a number, got True \(a bool\)"),
])
def test_sample_checks_its_settings_as_generate_does(kwargs, message):
    logits = jnp.zeros((1, V))
    with pytest.raises(ValueError, match=message):
        jaxllm.sample(logits, jax.random.key(0), **kwargs)


def test_sample_takes_per_row_settings_unchecked():
    """[B, 1] settings (one a row) are taken as they are, as before the checks of scalars came."""
    logits = jnp.asarray(np.random.default_rng(5).normal(0, 2.0, (3, V)), jnp.float32)
    temperature = jnp.array([[0.5], [1.0], [2.0]])
    got = jaxllm.sample(logits, jax.random.key(0), temperature, greedy=False, use_top_k=False, use_top_p=False,
                        use_min_p=False)
    assert got.shape == (3,) and ((0 <= np.asarray(got)) & (np.asarray(got) < V)).all()


def test_sample_takes_jax_scalars_as_settings():
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 2.0, (4, V)), jnp.float32)
    want = jaxllm.sample(logits, jax.random.key(3), 0.7, 5, 0.9, 0.0)
    got = jaxllm.sample(logits, jax.random.key(3), jnp.float32(0.7), jnp.int32(5), jnp.float32(0.9), np.float32(0))
    np.testing.assert_array_equal(got, want)


def test_per_row_top_k_keeps_exactly_each_rows_top_k():
    """Per-row top_k, [B, 1] or [B], no longer crashes (it raised "indices and arr must have the
    same number of dimensions"), and each row keeps exactly its own top k, ties with the k-th
    value included; a row's 0 keeps every token."""
    logits = np.random.default_rng(6).normal(0, 2.0, (2, 10)).astype(np.float32)
    got = jaxllm.sample(jnp.asarray(logits), jax.random.key(0), temperature=1.0, top_k=jnp.array([[2], [5]]),
                        use_top_k=True)
    assert got.shape == (2,)
    tied = np.array([3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 5.0, 2.0, 1.5], np.float32)  # k=3 ties four 2.0s
    logits = np.concatenate([logits, tied[None], logits[:1]])
    top_k = np.array([2, 5, 3, 0])
    kept = np.isfinite(np.asarray(sampling.filter_logits(jnp.asarray(logits), jnp.asarray(top_k)[:, None], 1.0, 0.0,
                                                         True, False, False)))
    for r, k in enumerate(top_k):
        want = logits[r] >= np.sort(logits[r])[::-1][k - 1] if k else np.ones(10, bool)
        np.testing.assert_array_equal(kept[r], want, err_msg=f"row {r}, top_k {k}")
    assert kept[2].sum() == 6 and kept[3].all()
    draws = 500  # and sampling with them chooses within, and all over, each row's set
    batch = jnp.asarray(np.repeat(logits, draws, axis=0))
    for per_row in (np.repeat(top_k, draws), np.repeat(top_k, draws)[:, None]):
        tokens = np.asarray(jaxllm.sample(batch, jax.random.key(1), 1.0, jnp.asarray(per_row))).reshape(4, draws)
        for r in range(4):
            chosen = np.zeros(10, bool)
            chosen[tokens[r]] = True
            assert not (chosen & ~kept[r]).any(), f"row {r} chose outside its top {top_k[r]}"
            likely = kept[r] & (_softmax(np.where(kept[r], logits[r], -np.inf)) > 0.02)
            assert chosen[likely].all(), f"row {r} never chose some of its top {top_k[r]}"


def test_per_row_filters_keep_what_each_rows_settings_keep_alone():
    """A batch whose rows have different temperature/top_k/top_p/min_p keeps in each row exactly
    the set transformers' warpers keep with that row's settings; neutral values keep every token."""
    logits = np.random.default_rng(7).normal(0, 2.0, (6, V)).astype(np.float32)
    rows = [dict(temperature=0.7, top_k=12, top_p=1.0, min_p=0.0),
            dict(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0),
            dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.2),
            dict(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
            dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),  # every filter at its neutral value
            dict(temperature=2.0, top_k=1, top_p=0.9, min_p=0.0)]
    column = {name: jnp.asarray([r[name] for r in rows])[:, None] for name in rows[0]}
    scaled = jnp.asarray(logits) / column["temperature"]
    kept = np.isfinite(np.asarray(sampling.filter_logits(scaled, column["top_k"], column["top_p"], column["min_p"],
                                                         True, True, True)))
    for r, settings in enumerate(rows):
        want = _hf_allowed(logits[r:r + 1], **settings)[0]
        np.testing.assert_array_equal(kept[r], want, err_msg=f"row {r}: {settings}")
    assert kept[4].all() and kept[5].sum() == 1 and 1 < kept[1].sum() < V


def test_each_row_draws_with_its_own_key_what_it_draws_alone():
    """[B] keys, one a row: a row's token depends on its logits, settings and key alone, not on
    the rows around it; a row at temperature 0 takes its argmax in a sampled batch."""
    logits = jnp.asarray(np.random.default_rng(8).normal(0, 2.0, (4, V)), jnp.float32)
    settings = dict(temperature=[0.8, 0.0, 1.3, 1.0], top_k=[0, 5, 20, 3], top_p=[0.9, 1.0, 1.0, 0.7],
                    min_p=[0.0, 0.0, 0.1, 0.0])
    for index in range(20):
        keys = sampling.row_keys(jnp.asarray([[11, 0], [12, 0], [13, 0], [5, 1]], jnp.uint32), index)
        batch = jaxllm.sample(logits, keys, **{k: jnp.asarray(v) for k, v in settings.items()})
        for r in range(4):
            alone = jaxllm.sample(logits[r:r + 1], keys[r:r + 1], **{k: v[r] for k, v in settings.items()})
            assert int(batch[r]) == int(alone[0]), f"row {r}, token index {index}"
        assert int(batch[1]) == int(jnp.argmax(logits[1]))


def test_a_row_keeps_its_draws_whatever_row_it_sits_in():
    logits = jnp.asarray(np.random.default_rng(9).normal(0, 1.0, (3, V)), jnp.float32)
    seeds = jnp.asarray([[1, 0], [2, 0], [3, 0]], jnp.uint32)
    order = jnp.array([2, 0, 1])
    for index in range(10):
        a = jaxllm.sample(logits, sampling.row_keys(seeds, index), 1.0)
        b = jaxllm.sample(logits[order], sampling.row_keys(seeds[order], index), 1.0)
        np.testing.assert_array_equal(np.asarray(a)[order], b)


def test_greedy_rows_of_a_sampled_batch_take_their_argmax():
    logits = jnp.asarray(np.random.default_rng(10).normal(0, 1.0, (64, V)), jnp.float32)
    temperature = jnp.asarray([0.0, 5.0] * 32)
    tokens = np.asarray(jaxllm.sample(logits, jax.random.key(0), temperature, top_p=0.95)).reshape(32, 2)
    np.testing.assert_array_equal(tokens[:, 0], np.asarray(logits).argmax(-1)[0::2])
    assert (tokens[:, 1] != np.asarray(logits).argmax(-1)[1::2]).mean() > 0.5  # the hot rows do sample


def test_presence_and_frequency_penalties_against_a_hand_computed_reference():
    """OpenAI's: logit - frequency * count - presence * (count > 0), one pair of penalties a row."""
    logits = jnp.asarray([[1.0, 2.0, -1.0, 0.5, 0.0, 3.0], [0.0, 1.0, 2.0, -2.0, 1.0, 0.5]])
    counts = jnp.asarray([[0, 2, 1, 0, 0, 3], [1, 0, 0, 4, 0, 0]], jnp.int32)
    got = sampling.apply_presence_frequency_penalty(logits, counts, jnp.asarray([[0.5], [-1.0]]),
                                                    jnp.asarray([[0.25], [0.5]]))
    want = [[1.0, 2.0 - 0.5 - 0.5, -1.0 - 0.25 - 0.5, 0.5, 0.0, 3.0 - 0.75 - 0.5],
            [0.0 - 0.5 + 1.0, 1.0, 2.0, -2.0 - 2.0 + 1.0, 1.0, 0.5]]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=[1.0, -1.0]), r"temperature must be >= 0 .*got -1.0 \(row 1\)"),
    (dict(top_k=[2, 2, 2]), r"top_k must be a number or a list of 2 \(one a row\), got 3 values"),
    (dict(top_p=np.array([[0.5, 0.5]])), r"top_p must be a number, got an array of shape \(1, 2\)"),
    (dict(min_p=np.array([False, True])), r"min_p must be a number, got np.False_ \(a bool\) \(row 0\)"),
    (dict(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=[0.0, float("nan")]), r"frequency_penalty must be in \[-2, 2\].*\(row 1\)"),
    (dict(seed=[1, 2 ** 64]), r"seed must be at most 9223372036854775807.*\(row 1\)"),
    (dict(seed=[1.5, 2]), r"seed must be an integer, got 1.5 \(row 0\)"),
    (dict(temperature=[]), r"temperature must be a number or a list of 2 \(one a row\), got 0 values"),
])
def test_per_row_settings_are_checked_row_by_row(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampling.SamplingConfig(**kwargs).validate(rows=2)


def test_flags_count_what_any_row_uses_and_greedy_batches_stay_greedy():
    flags = sampling.SamplingConfig(temperature=[0.0, 0.0], top_k=[5, 0], top_p=0.5).validate().static()
    assert flags == sampling.SamplingFlags()  # greedy rows' filters cost nothing: no sort, no key
    flags = sampling.SamplingConfig(temperature=[0.0, 0.7], top_k=[5, 0], min_p=[0.0, 0.1],
                                    frequency_penalty=[0.0, 0.5]).validate().static()
    assert flags == sampling.SamplingFlags(greedy=False, top_k=False, top_p=False, min_p=True, penalties=True,
                                           argmax_rows=True)
    values = sampling.SamplingConfig(temperature=[0.0, 1e-9], seed=[-1, 2 ** 40 + 3]).validate().values(2)
    np.testing.assert_array_equal(values.temperature, np.float32([0, 1e-6]))  # as one value was clamped
    np.testing.assert_array_equal(values.seed, [[2 ** 32 - 1, 2 ** 32 - 1], [3, 2 ** 8]])
