"""Speculative decoding: greedy output equal to plain greedy, the sampled law exactly the target's
(with negative controls that must fail the same test), rollback and the acceptance histogram."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm.cli.common import load_draft
from jaxllm.engine import speculative as spec
from jaxllm.engine.generate import spec_cache_length
from jaxllm.engine.sampling import filter_logits
from jaxllm.layers.quant import QuantizedWeight
from jaxllm.model.cache import init_cache, rollback
from jaxllm.model.transformer import jitted_step
from test_cli import run_cli, tiny_model  # noqa: F401 (a fixture)
from tiny_models import VARIANTS, VOCAB, build, random_tokens


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """drafts(name) -> the params of variant `name` with other random weights (seed 1)."""
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(f"draft_{name}")
            build(name, path, seed=1)
            made[name] = jaxllm.load(path, dtype="float32")
        return made[name]
    return get


def _prompts(seed=0):
    """A ragged batch with repeats inside each prompt, so prompt lookup finds matches."""
    return [random_tokens(n, seed=seed + n).tolist() * 2 for n in (3, 7, 5)]


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


# Prompt lookup from one matching token: random tiny models' answers seldom repeat a pair, so
# the default (two) would verify too seldom to test much
LOOKUP1 = spec.NGram(min_n=1)


def _greedy_identity(params, draft, new=24, k=3, **kw):
    prompts = _prompts()
    plain = jaxllm.generate(params, prompts, max_new_tokens=new, eos_token_ids=[], **kw)
    for proposer in (LOOKUP1, draft):
        out = jaxllm.generate(params, prompts, max_new_tokens=new, eos_token_ids=[], speculative=proposer,
                              num_speculative=k, **kw)
        _same(out, plain)
        assert out.stats.verify_rounds > 0
    return out


def test_greedy_equals_plain_greedy(tiny, drafts):
    out = _greedy_identity(tiny("llama").params, drafts("llama"))
    assert out.stats.histogram[0] > 0  # a different random draft: many rejections


def test_a_drafts_missing_token_fed_in_its_first_step_proposes_the_same(tiny, drafts, monkeypatch):
    """The draft's last missing token (a fully accepted round's last draft, or a plain step's)
    fed beside the pending one in a two-token step proposes what its own catch-up step did."""
    params, draft, prompts = tiny("llama").params, drafts("llama"), _prompts()
    run = lambda: jaxllm.generate(params, prompts, max_new_tokens=24, eos_token_ids=[], speculative=draft,
                                  num_speculative=3, synthetic_acceptance=0.6)
    _tuned(monkeypatch, draft_pair=False)
    apart = run()
    _tuned(monkeypatch, draft_pair=True)
    paired = run()
    _same(paired, apart)
    assert paired.stats == apart.stats and paired.stats.histogram[-1] > 0  # rounds that kept all


def test_the_drafts_cache_is_whole_blocks_for_the_attention_kernel(drafts):
    """The draft's cache is the target's plus a catch-up chunk: not rounded, it missed the decode
    attention kernel's multiple of 16, and every draft step on a GPU took XLA's attention."""
    length = spec_cache_length(16, 32, 3)
    cache = spec.Draft().init(drafts("llama"), jnp.asarray([random_tokens(16).tolist()]), jnp.zeros((1,), jnp.int32),
                              length, False)
    assert cache.length % spec.SPEC_CACHE_MULTIPLE == 0 and cache.length >= length + spec.Draft.chunk


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(VARIANTS) - {"llama"}))  # mistral, qwen2_swa: sliding windows
def test_greedy_equals_plain_greedy_every_family(tiny, drafts, name):
    _greedy_identity(tiny(name).params, drafts(name), k=7)


@pytest.mark.slow
def test_greedy_equals_plain_with_int8_cache(tiny, drafts):
    _greedy_identity(tiny("llama").params, drafts("llama"), k=2, kv_dtype="int8")


@pytest.mark.slow
def test_greedy_equals_plain_to_the_end_of_the_context(tiny, drafts):
    """llama_dynamic's context is 64 tokens: prompt + new tokens fill it, drafts reach past it."""
    params = tiny("llama_dynamic").params
    prompt = [random_tokens(20, seed=3).tolist() * 2]
    plain = jaxllm.generate(params, prompt, max_new_tokens=24, eos_token_ids=[])
    for proposer in (LOOKUP1, drafts("llama_dynamic")):
        _same(jaxllm.generate(params, prompt, max_new_tokens=24, eos_token_ids=[], speculative=proposer,
                              num_speculative=5), plain)


def test_draft_equal_to_target_accepts_everything(tiny):
    params = tiny("llama").params
    prompts = _prompts()
    plain = jaxllm.generate(params, prompts, max_new_tokens=25, eos_token_ids=[])
    out = jaxllm.generate(params, prompts, max_new_tokens=25, eos_token_ids=[], speculative=params,
                          num_speculative=3)
    _same(out, plain)
    assert out.stats.histogram[:3] == (0, 0, 0) and out.stats.acceptance_rate == 1.0
    assert out.stats.tokens_per_step == 4.0  # 24 tokens after the prefill's, 6 rounds a row


def _tuned(monkeypatch, **kw):
    monkeypatch.setattr(spec, "TUNING", dataclasses.replace(spec.TUNING, **kw))


@pytest.mark.parametrize("pausing", [dict(verify_cost=0.0), dict(verify_cost=99.0, min_pause=2, max_pause=8)])
def test_adaptive_k_changes_no_token(tiny, drafts, monkeypatch, pausing):
    """Default k, adaptive: never pausing, or pausing after every verify round (the rounds that
    do not pay, doubling the pause), the answer is plain greedy's; a paused draft model catches
    up on the plain steps' tokens, so the target as its own draft still accepts everything."""
    _tuned(monkeypatch, **pausing)
    params = tiny("llama").params
    prompts = _prompts()
    plain = jaxllm.generate(params, prompts, max_new_tokens=24, eos_token_ids=[])
    for proposer in ("ngram", drafts("llama"), params):
        out = jaxllm.generate(params, prompts, max_new_tokens=24, eos_token_ids=[], speculative=proposer)
        _same(out, plain)
        assert 0 < out.stats.verify_rounds
        if pausing["verify_cost"] > 0:  # verify rounds, then pauses of 2, 4, 8, 8 ... plain steps
            assert out.stats.verify_rounds <= 6
    assert out.stats.acceptance_rate == 1.0
    if not pausing["verify_cost"]:
        assert out.stats.verify_rounds == out.stats.rounds  # the target as its draft: never paused


def test_adaptive_k_shortens_a_costly_poor_drafts_run(tiny, drafts):
    """A random draft as large as the target (a draft step costs a target step) accepts nothing:
    the first round proposes k = 3, the probes after it one draft, and most steps are plain."""
    params = tiny("llama").params
    out = jaxllm.generate(params, _prompts(), max_new_tokens=24, eos_token_ids=[], speculative=drafts("llama"))
    stats = out.stats
    live_rounds = sum(stats.histogram)  # a live row's verify round
    assert stats.accepted == 0 and 3 < live_rounds and stats.drafted < 3 * live_rounds
    assert stats.verify_rounds < stats.rounds / 3


def test_default_decodes_plainly_above_the_batch_limit(tiny, monkeypatch):
    """Prompt lookup's limit is max_batch rows, a draft model's max_batch_draft."""
    _tuned(monkeypatch, max_batch=2, max_batch_draft=2)
    params = tiny("llama").params
    prompts = _prompts()
    plain = jaxllm.generate(params, prompts, max_new_tokens=16, eos_token_ids=[])
    for proposer in (params, LOOKUP1):
        out = jaxllm.generate(params, prompts, max_new_tokens=16, eos_token_ids=[], speculative=proposer)
        _same(out, plain)
        assert out.stats.off_at_batch and out.stats.verify_rounds == 0 and out.stats.tokens_per_step == 1.0
    _tuned(monkeypatch, max_batch=2, max_batch_draft=3)
    assert not jaxllm.generate(params, prompts, max_new_tokens=16, eos_token_ids=[],
                               speculative=params).stats.off_at_batch
    fixed = jaxllm.generate(params, prompts, max_new_tokens=16, eos_token_ids=[], speculative=params,
                            num_speculative=3)  # a fixed k speculates at any batch
    _same(fixed, plain)
    assert not fixed.stats.off_at_batch and fixed.stats.verify_rounds > 0
    assert jaxllm.generate(params, prompts[:2], max_new_tokens=16, eos_token_ids=[],
                           speculative=params).stats.verify_rounds > 0


def test_a_round_without_a_match_takes_the_plain_step(tiny):
    """Prompt lookup verifies only where the last two tokens occurred before: over 16 distinct
    prompt tokens and an answer without a repeated pair, every step is a plain one; an answer
    that repeats one (109, 109, 109) verifies once, there."""
    params = tiny("llama").params
    for first, verified in ((3, 0), (20, 1)):
        prompt = [list(range(first, first + 16))]
        plain = jaxllm.generate(params, prompt, max_new_tokens=8, eos_token_ids=[])
        out = jaxllm.generate(params, prompt, max_new_tokens=8, eos_token_ids=[], speculative="ngram",
                              num_speculative=3)
        _same(out, plain)
        answer = [*prompt[0], *np.asarray(plain.tokens[0]).tolist()]
        pairs = [tuple(answer[i:i + 2]) for i in range(len(answer) - 1)]
        assert len(pairs) - len(set(pairs)) == verified  # the premise
        assert out.stats.verify_rounds == verified and out.stats.rounds == 7


def test_stop_inside_an_accepted_run_and_max_new_mid_round(tiny):
    """The draft is the target, so every round accepts 3: a stop token at the 6th new token and a
    max_new_tokens of 23 (1 + 5 rounds of 4 + 2 of a round's 4) both fall inside accepted runs."""
    params = tiny("llama").params
    prompts = _prompts()
    free = jaxllm.generate(params, prompts, max_new_tokens=24, eos_token_ids=[])
    stop = int(free.tokens[1, 5])
    for new, stops in ((24, [stop]), (23, [])):
        plain = jaxllm.generate(params, prompts, max_new_tokens=new, eos_token_ids=stops)
        out = jaxllm.generate(params, prompts, max_new_tokens=new, eos_token_ids=stops, speculative=params,
                              num_speculative=3)
        _same(out, plain)
        lengths = np.asarray(plain.lengths)
        assert (lengths[1] <= 6 and lengths.max() > 1) if stops else (lengths == 23).all()


@dataclasses.dataclass(eq=False)
class Oracle(spec.Proposer):
    """The target's own greedy continuation, with a wrong token planted at schedule[r] in round r
    (schedule value k: nothing planted), so round r accepts exactly schedule[r] drafts."""

    continuation: np.ndarray  # [1, N]
    schedule: tuple

    def propose(self, aux, state, ctx, k):
        cont = jnp.asarray(np.pad(self.continuation, ((0, 0), (0, 64))))
        j_K = jnp.arange(k)
        d_BK = jnp.take_along_axis(cont, ctx.count_B[:, None] + j_K[None], axis=1)
        planted = jnp.asarray(self.schedule)[ctx.round % len(self.schedule)]
        d_BK = jnp.where(j_K[None] == planted, (d_BK + 1) % VOCAB, d_BK)
        return spec.Proposal(d_BK, jnp.ones(d_BK.shape, bool), None), state


def test_planted_errors_force_every_accepted_count(tiny):
    params = tiny("llama").params
    prompt = [random_tokens(6, seed=4).tolist()]
    k, new = 4, 40
    plain = jaxllm.generate(params, prompt, max_new_tokens=new + k, eos_token_ids=[])
    schedule = (2, 0, 4, 1, 3, 0)
    out = jaxllm.generate(params, prompt, max_new_tokens=new, eos_token_ids=[],
                          speculative=Oracle(np.asarray(plain.tokens), schedule), num_speculative=k)
    plain = jaxllm.generate(params, prompt, max_new_tokens=new, eos_token_ids=[])
    _same(out, plain)
    hist, made, r = [0] * (k + 1), 1, 0
    while made < new:
        hist[schedule[r % len(schedule)]] += 1
        made += schedule[r % len(schedule)] + 1
        r += 1
    assert out.stats.histogram == tuple(hist) and all(hist)


def test_cache_after_a_rejected_run_holds_what_plain_decoding_wrote(tiny):
    """A verify step over [t1, t2, x, x] kept to 2 tokens, then t3, t4 one at a time: every live
    slot and the next logits are those of plain decoding of t1..t4."""
    params = tiny("mistral").params
    cfg = params.config
    prompt = random_tokens((2, 6), seed=5)
    cont = random_tokens((2, 4), seed=6)
    run = jitted_step()

    def fresh():
        cache = init_cache(cfg, 2, 24, params.dtype)
        return run(params, jnp.asarray(prompt), cache, fresh=True)[1]

    plain = fresh()
    for t in range(4):
        logits_plain, plain = run(params, jnp.asarray(cont[:, t:t + 1]), plain)
    cache = fresh()
    wrong = (cont[:, :2] + 1) % VOCAB
    _, cache = run(params, jnp.asarray(np.concatenate([cont[:, :2], wrong], axis=1)), cache, all_logits=True)
    cache = rollback(cache, jnp.array([2, 2]))
    for t in (2, 3):
        logits, cache = run(params, jnp.asarray(cont[:, t:t + 1]), cache)
    np.testing.assert_array_equal(np.asarray(cache.end), np.asarray(plain.end))
    for a, b in zip(cache.k + cache.v, plain.k + plain.v):
        np.testing.assert_allclose(np.asarray(a)[:, :, :10], np.asarray(b)[:, :, :10], atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_plain), atol=1e-4)


def test_same_seed_same_tokens(tiny, drafts):
    params = tiny("llama").params
    kw = dict(max_new_tokens=16, eos_token_ids=[], temperature=1.0, top_k=8, speculative=drafts("llama"),
              num_speculative=3)
    a = jaxllm.generate(params, _prompts(), seed=7, **kw)
    b = jaxllm.generate(params, _prompts(), seed=7, **kw)
    c = jaxllm.generate(params, _prompts(), seed=8, **kw)
    _same(a, b)
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_bad_arguments_are_named(tiny):
    params = tiny("llama").params
    with pytest.raises(ValueError, match="speculative must be"):
        jaxllm.generate(params, [[3, 4]], speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative"):
        jaxllm.generate(params, [[3, 4]], speculative="ngram", num_speculative=0)
    with pytest.raises(ValueError, match="need speculative"):
        jaxllm.generate(params, [[3, 4]], num_speculative=3)


# --- the law of sampled output --------------------------------------------------------------------

K, L, TOP_K = 2, 4, 4  # L >= K + 2: the bonus token and the round after a rollback are inside


def _exact_law(params, prompt):
    """{first L tokens: probability} under temperature 1 and top-k 4, through float32 forward."""
    law = {(): 1.0}
    for _ in range(L):
        prefixes = list(law)
        rows = np.array([prompt + list(p) for p in prefixes], np.int32)
        logits = jaxllm.forward(params, rows)[:, -1]
        p = np.asarray(jax.nn.softmax(filter_logits(logits, TOP_K, 1.0, 0.0, True, False, False), axis=-1))
        law = {pre + (int(t),): law[pre] * float(p[i, t]) for i, pre in enumerate(prefixes)
               for t in np.flatnonzero(p[i] > 0)}
    return law


def _chi_square(law, samples):
    """(statistic, bound) over the law's cells (small ones pooled); inf where a sample is outside it."""
    counts = {}
    for s in map(tuple, samples):
        counts[s] = counts.get(s, 0) + 1
    if set(counts) - set(law):
        return np.inf, 0.0
    n = len(samples)
    big = [c for c in law if law[c] * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    expected = [law[c] * n for c in big] + [n * (1 - sum(law[c] for c in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = len(big)
    return stat, dof + 8 * np.sqrt(2 * dof) + 10  # test_sampling's bound


@pytest.fixture(scope="module")
def law_setup(tiny, drafts):
    params = tiny("llama").params
    prompt = random_tokens(5, seed=11).tolist()
    # The target's weights, each scaled by 1 + 0.2 noise: a draft whose top 4 overlap the
    # target's often but not always (an unrelated random model's never do).
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    draft = jax.tree.unflatten(tree, [x * (1 + 0.2 * jax.random.normal(key, x.shape, x.dtype))
                                      if jnp.issubdtype(x.dtype, jnp.floating) else x
                                      for x, key in zip(leaves, keys)])
    return params, draft, prompt, _exact_law(params, prompt)


def _sampled(params, draft, prompt, rows, seed0=0, k=K):
    out = jaxllm.generate(params, [prompt] * rows, max_new_tokens=L, eos_token_ids=[], temperature=1.0,
                          top_k=TOP_K, seed=list(range(seed0, seed0 + rows)), speculative=draft,
                          num_speculative=k)
    return np.asarray(out.tokens), out.stats


@pytest.mark.slow
def test_sampled_law_is_the_targets(law_setup):
    params, draft, prompt, law = law_setup
    tokens, stats = _sampled(params, draft, prompt, 6000)
    assert 0 < stats.histogram[K] and 0 < stats.histogram[0]  # bonus tokens and rejections drawn
    stat, bound = _chi_square(law, tokens)
    assert stat < bound, (stat, bound, stats)


@pytest.mark.slow
def test_sampled_law_with_adaptive_pauses_is_the_targets(law_setup, monkeypatch):
    """Adaptive k pausing after each verify round that does not return all its drafts: the first
    L tokens mix verify rounds and plain steps, and keep the target's law."""
    _tuned(monkeypatch, verify_cost=K + 0.9, min_pause=1, max_pause=1, max_batch_draft=6000)
    monkeypatch.setitem(spec.DEFAULT_K, "draft", K)
    params, draft, prompt, law = law_setup
    tokens, stats = _sampled(params, draft, prompt, 6000, k=None)
    assert 0 < stats.verify_rounds < stats.rounds, stats
    stat, bound = _chi_square(law, tokens)
    assert stat < bound, (stat, bound, stats)


@pytest.mark.slow
def test_sampled_law_with_prompt_lookup_is_the_targets(tiny):
    """A one-hot q: accept d with probability p(d), else draw from p with d taken out. The
    prompt repeats itself, so its last token has matches and most rounds verify."""
    params = tiny("llama").params
    prompt = random_tokens(4, seed=12).tolist() * 3
    law = _exact_law(params, prompt)
    tokens, stats = _sampled(params, LOOKUP1, prompt, 6000)
    assert stats.verify_rounds > 0 and stats.accepted > 0
    stat, bound = _chi_square(law, tokens)
    assert stat < bound, (stat, bound, stats)


def _accept_bug(p_BJV, q_BKV, d_BK, valid_BK, keys_B, bug):
    B, k = d_BK.shape
    pd = jnp.take_along_axis(p_BJV[:, :k], d_BK[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q_BKV, d_BK[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (k,)))(keys_B)
    n = jnp.sum(jnp.cumprod((u * qd <= pd) & valid_BK, axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(B)
    p = p_BJV[rows, jnp.where(n == k, k - 1, n) if bug == "bonus" else n]
    q = jnp.where((n < k)[:, None], q_BKV[rows, jnp.minimum(n, k - 1)], 0)
    r = p if bug == "residual" else jnp.maximum(p - q, 0)
    return n, spec.race(jax.vmap(lambda key: jax.random.fold_in(key, 2))(keys_B), r)


# (the function replaced, its bug, the rows that make the law fail): a wrong row or cursor writes
# sequences outside the law at once; a wrong residual or a reused uniform only skews it.
CONTROLS = {
    "residual_p": ("accept", lambda *a: _accept_bug(*a, "residual"), 6000),
    "bonus_wrong_row": ("accept", lambda *a: _accept_bug(*a, "bonus"), 1000),
    "cursor_one_short": ("rejected", lambda written, kept_B: written - kept_B + 1, 1000),
    "uniform_reused": ("round_keys", lambda seed_B2, count_B: spec.row_keys(seed_B2, 0), 6000),
}


@pytest.mark.slow
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_negative_controls_fail_the_law(law_setup, monkeypatch, control):
    params, draft, prompt, law = law_setup
    name, bug, rows = CONTROLS[control]
    monkeypatch.setattr(spec, name, bug)
    jax.clear_caches()  # the loop traces the replaced function
    try:
        tokens, _ = _sampled(params, draft, prompt, rows)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    stat, bound = _chi_square(law, tokens)
    assert stat > bound, (control, stat, bound)


def test_stream_yields_what_generate_makes(tiny):
    params = tiny("llama").params
    prompt = _prompts()[1]
    plain = jaxllm.generate(params, [prompt], max_new_tokens=24, eos_token_ids=[])
    gen = jaxllm.stream(params, prompt, max_new_tokens=24, eos_token_ids=[], speculative="ngram", num_speculative=3)
    got = []
    try:
        while True:
            got.append(next(gen))
    except StopIteration as end:
        stats = end.value
    assert got == np.asarray(plain.tokens[0]).tolist()
    assert stats.tokens == 23 and stats.rounds <= 23


@pytest.mark.slow
def test_cli_speculative_answer_equals_the_plain_one_and_reports(tiny_model):
    common = ["generate", "hello world", "--model", str(tiny_model), "--max-new-tokens", "12", "--dtype", "float32"]
    plain = run_cli(*common)
    spec_run = run_cli(*common, "--speculate", "ngram", "--num-speculative", "4", "--verbose")
    assert plain.returncode == 0 and spec_run.returncode == 0, spec_run.stderr
    assert spec_run.stdout == plain.stdout
    assert "tokens per target step" in spec_run.stderr and "histogram" in spec_run.stderr
    drafted = run_cli(*common, "--draft-model", str(tiny_model), "--num-speculative", "3", "--verbose")
    assert drafted.returncode == 0 and drafted.stdout == plain.stdout, drafted.stderr
    assert "drafts accepted (100.0%)" in drafted.stderr  # the model as its own draft
    int8 = run_cli(*common, "--draft-model", str(tiny_model), "--draft-quant", "int8", "--num-speculative", "3")
    assert int8.returncode == 0 and int8.stdout == plain.stdout, int8.stderr  # a quantized draft: the same answer
    args = argparse.Namespace(draft_model=str(tiny_model), dtype="float32", quant="none", draft_quant="int8")
    assert isinstance(load_draft(args).layers[0].wqkv, QuantizedWeight)  # what --draft-quant int8 loads
    bad = run_cli(*common, "--num-speculative", "3")
    assert bad.returncode == 2 and "--num-speculative needs" in bad.stderr


@pytest.mark.slow
def test_default_model_greedy_equals_plain_greedy():
    """SmolLM2-135M, float32: an input-grounded prompt (its text repeated in the answer) with
    prompt lookup, and a random 2-layer draft of its shape (few acceptances)."""
    from jaxllm.model.params import init_params
    params = jaxllm.load(dtype="float32")
    tok = jaxllm.load_tokenizer()
    passage = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n" + passage}]))
    prompts = [ids, ids[:-9]]
    plain = jaxllm.generate(params, prompts, max_new_tokens=40)
    draft = init_params(dataclasses.replace(params.config, num_layers=2), jax.random.key(1), jnp.float32)
    for proposer in ("ngram", draft):
        out = jaxllm.generate(params, prompts, max_new_tokens=40, speculative=proposer)
        _same(out, plain)
    assert out.stats.drafted > 0


@pytest.mark.slow
def test_greedy_with_penalties_equals_plain(tiny, drafts):
    """Each verify position is penalized by its own prefix (the drafts before it counted)."""
    params, kw = tiny("llama").params, dict(max_new_tokens=24, eos_token_ids=[], repetition_penalty=1.8,
                                            frequency_penalty=0.5)
    plain = jaxllm.generate(params, _prompts(), **kw)
    # Prompt lookup rarely matches here (the penalty keeps the answer off the prompt's tokens)
    for proposer in ("ngram", drafts("llama"), params):
        out = jaxllm.generate(params, _prompts(), speculative=proposer, num_speculative=3, **kw)
        _same(out, plain)
    assert out.stats.acceptance_rate == 1.0  # the target as its own draft, penalized alike: all accepted
