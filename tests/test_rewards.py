"""The reward interface: JAX, host and reward-model components, weights, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import data, rewards
from jaxrlhf.data import batching

TOK = data.CharTokenizer()


def _inputs(prompt_ids, response_ids, response_mask):
    prompt_ids = jnp.asarray(prompt_ids)
    response_ids, response_mask = jnp.asarray(response_ids), jnp.asarray(response_mask)
    prompt_mask = prompt_ids != data.PAD_ID
    return rewards.RewardInput(prompt_ids, prompt_mask, response_ids, response_mask,
                               jnp.concatenate([prompt_ids, response_ids], 1),
                               jnp.concatenate([prompt_mask, response_mask], 1))


def _toy():
    """3 responses of 4 tokens (ids 4..9), lengths 4, 2, 3."""
    ids = jnp.array([[4, 5, 5, 6], [5, 7, 0, 0], [8, 5, 9, 0]])
    mask = jnp.arange(4)[None] < jnp.array([4, 2, 3])[:, None]
    return _inputs(jnp.ones((3, 2), jnp.int32), ids, mask)


def count5(ids, mask, extras):
    return jnp.sum((ids == 5) & mask, axis=1).astype(jnp.float32)


def length(ids, mask, extras):
    return jnp.sum(mask, axis=1).astype(jnp.float32)


def test_combine_weights_and_component_metrics():
    inputs = _toy()
    reward = rewards.combine([(2.0, count5), (-0.5, rewards.jax_reward(length, name="len"))])
    assert reward.names == ("count5", "len") and reward.is_jax
    total, parts = reward(inputs)
    # count5 = [2, 1, 1], len = [4, 2, 3]: 2·[2, 1, 1] − 0.5·[4, 2, 3] = [2, 1, 0.5]
    np.testing.assert_allclose(total, [2.0, 1.0, 0.5])
    metrics = reward.metrics(parts)  # unweighted component means
    np.testing.assert_allclose([metrics["reward/count5"], metrics["reward/len"]], [4 / 3, 3.0])
    # Nested: weights multiply; and the whole thing traces under jit.
    nested = rewards.combine([(3.0, reward)])
    np.testing.assert_allclose(jax.jit(lambda x: nested.total(nested.device_scores(x, {})))(inputs),
                               [6.0, 3.0, 1.5])


def test_reward_model_component_sees_prompt_and_response():
    inputs = _toy()
    rm = rewards.model_reward(lambda seq, attn: jnp.sum(attn, axis=1).astype(jnp.float32), name="rm")
    total, _ = rewards.combine([(1.0, rm), (1.0, count5)])(inputs)
    np.testing.assert_allclose(total, [2 + 4 + 2, 2 + 2 + 1, 2 + 3 + 1])  # prompt 2 + response + count5
    assert rm.is_jax


def test_reward_model_with_params_given_at_call_time():
    inputs = _toy()
    rm = rewards.model_reward(lambda w, seq, attn: w * jnp.sum(attn, axis=1).astype(jnp.float32), name="rm",
                              takes_params=True, vocab_size=TOK.vocab_size)
    reward = rewards.combine([(2.0, rm), (1.0, count5)])
    assert reward.is_jax and reward.components[0].takes_params and reward.components[0].vocab_size == TOK.vocab_size
    total = jax.jit(lambda w, x: reward.total(reward.device_scores(x, {}, w)))(jnp.float32(0.5), inputs)
    np.testing.assert_allclose(total, [6 + 2, 4 + 1, 5 + 1])  # 2·0.5·(prompt 2 + response) + count5
    np.testing.assert_allclose(reward(inputs, params=1.0)[0], [12 + 2, 8 + 1, 10 + 1])
    with pytest.raises(ValueError, match="pass params"):
        reward(inputs)
    # two components that take params share them (an ensemble's score and its disagreement)
    both = rewards.combine([(1.0, rm), (0.0, rewards.model_reward(rm.components[0].fn, name="rm2", takes_params=True))])
    scores = both.device_scores(inputs, {}, jnp.float32(0.5))
    np.testing.assert_allclose(scores["rm2"], scores["rm"])
    np.testing.assert_allclose(both.total(scores), scores["rm"])  # weight 0: logged, not in the total
    # prompt ⧺ response split back into its parts
    again = rewards.RewardInput.from_sequences(inputs.sequences, inputs.attention_mask, 2)
    for a, b in zip(again, inputs):
        np.testing.assert_array_equal(a, b)


def test_wrong_shape_or_dtype_names_the_reward():
    inputs = _toy()
    per_token = rewards.jax_reward(lambda ids, mask, ex: mask.astype(jnp.float32), name="per_token")
    with pytest.raises(ValueError, match=r"reward 'per_token' returned shape \(3, 4\); expected \[N\] = \(3,\)"):
        per_token(inputs)
    ints = rewards.jax_reward(lambda ids, mask, ex: jnp.sum(mask, axis=1), name="ints")
    with pytest.raises(ValueError, match="reward 'ints' returned dtype int32"):
        ints(inputs)
    short = rewards.host_reward(lambda p, r, ex: [1.0, 0.0], TOK, name="short")
    with pytest.raises(ValueError, match=r"reward 'short' returned shape \(2,\)"):
        short(inputs)
    words = rewards.host_reward(lambda p, r, ex: ["yes"] * len(r), TOK, name="words")
    with pytest.raises(ValueError, match="reward 'words'"):
        words(inputs)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        rewards.host_reward(lambda p, r, ex: [0.0] * len(r), None)
    with pytest.raises(ValueError, match="unique"):
        rewards.combine([(1.0, count5), (1.0, count5)])


def test_jax_and_host_exact_match_agree_on_the_addition_task():
    task = data.AdditionTask(num_digits=2)
    problems = data.make_problems(task, 12, seed=3)
    arrays = data.rl_arrays(task, problems)
    # Responses: correct for rows 0-3, a wrong digit for 4-7, correct but cut before EOS for
    # 8-9, correct then EOS then junk for 10-11.
    responses = []
    for i, ans in enumerate(problems.answer_ids):
        if 4 <= i < 8:
            wrong = str((int(TOK.decode(ans[:1])) + 1) % 10)
            responses.append(TOK.encode(wrong) + list(ans[1:]) + [data.EOS_ID])
        elif 8 <= i < 10:
            responses.append(list(ans))
        elif i >= 10:
            responses.append(list(ans) + [data.EOS_ID] + TOK.encode("12"))
        else:
            responses.append(list(ans) + [data.EOS_ID])
    resp_ids, resp_mask = batching.right_pad(responses, task.response_len + 2)
    inputs = _inputs(arrays["prompt_ids"], resp_ids, resp_mask)

    on_device = rewards.jax_reward(
        lambda ids, mask, ex: data.exact_match_reward(ids, mask, ex["answer_ids"], ex["answer_mask"]), name="jax")

    def exact_text(prompts, responses, extras):
        assert prompts == problems.prompt_text  # decoded prompts, BOS and padding dropped
        return data.exact_match_text(responses, extras["answer_text"], finished=extras["finished"])

    on_host = rewards.host_reward(exact_text, TOK, name="host")
    reward = rewards.combine([(1.0, on_device), (1.0, on_host)])
    assert not reward.is_jax
    extras = {"answer_ids": jnp.asarray(arrays["answer_ids"]), "answer_mask": jnp.asarray(arrays["answer_mask"]),
              "answer_text": problems.answer_text}
    total, parts = reward(inputs, extras)
    want = [1.0] * 4 + [0.0] * 6 + [1.0] * 2
    np.testing.assert_array_equal(parts["jax"], want)
    np.testing.assert_array_equal(parts["host"], want)
    np.testing.assert_array_equal(total, 2 * np.asarray(want))


def test_as_reward():
    assert rewards.as_reward(count5).names == ("count5",)
    r = rewards.jax_reward(count5)
    assert rewards.as_reward(r) is r
    with pytest.raises(TypeError):
        rewards.as_reward(3.0)


def test_trl_reward_gets_keywords_and_the_row_fields(monkeypatch, tmp_path):
    """A function in TRL's `reward_funcs` convention, found by import path, is called with
    keywords: the decoded prompts and completions and every extra but `finished`."""
    (tmp_path / "my_trl_rewards.py").write_text(
        "def has_answer(completions, answer, **kwargs):\n"
        "    assert 'finished' not in kwargs and len(kwargs['prompts']) == len(completions)\n"
        "    return [float(a in c) for c, a in zip(completions, answer)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.import_reward_fn("my_trl_rewards:has_answer")
    reward = rewards.trl_reward(fn, TOK)
    inputs = _toy()
    texts = [TOK.decode(ids[m]) for ids, m in zip(np.asarray(inputs.response_ids), np.asarray(inputs.response_mask))]
    _, parts = reward(inputs, {"answer": [texts[0][-1], "#", texts[2][0]]})
    assert reward.names == ("has_answer",)
    np.testing.assert_array_equal(parts["has_answer"], [1.0, 0.0, 1.0])


@pytest.mark.parametrize("spec, match", [
    ("no_such_module_x:fn", r"module 'no_such_module_x' does not import \(ModuleNotFoundError"),
    ("jaxrlhf.rewards:no_such_fn", r"module 'jaxrlhf.rewards' has no attribute 'no_such_fn'"),
    ("jaxrlhf.rewards:KINDS", r"'KINDS' is a tuple, not a function"),
    ("jaxrlhf.rewards", r"expected an import path 'package.module:function'"),
])
def test_import_reward_fn_errors_name_the_path(spec, match):
    with pytest.raises(ValueError, match=rf"reward {spec!r}: {match}"):
        rewards.import_reward_fn(spec)


@pytest.mark.parametrize("fn, match", [
    (lambda p, r, ex: [1.0, float("nan"), 0.0], r"reward 'bad' returned nan for response 1 \(1 of 3"),
    (lambda p, r, ex: {}["missing"], r"reward 'bad' raised KeyError: 'missing'"),
])
def test_a_host_reward_that_fails_is_named(fn, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        rewards.host_reward(fn, TOK, name="bad")(_toy())
