"""The built-in calculator task (`data.calculator`): the expert's episodes score 1 and the
SFT arrays learn its tokens only, malformed calls are observations, the splits are
disjoint, and episodes of an untrained policy end within the engine's limits."""

import jax
import numpy as np
import pytest

from jaxrlhf.data import calculator as calc
from jaxrlhf.data.char_tokenizer import EOS_ID

TASK = calc.CalculatorTask(num_terms=3, num_digits=3, memory_rate=0.5)
TOK = calc.TOKENIZER


def _step(env, text, cut=False):
    ids = TOK.encode(text.removesuffix("<eos>")) + ([EOS_ID] if text.endswith("<eos>") else [])
    return env.step(ids, cut)


def test_expert_episodes_score_one_and_the_splits_are_disjoint():
    train = calc.make_rows(TASK, 300, split="train", seed=0)
    test = calc.make_rows(TASK, 100, split="test", seed=5)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert len({r["question"] for r in train}) == 300
    kinds = set()
    for row in train[:100]:
        env = calc.CalculatorEnv()
        prompt = env.reset(row)
        assert TOK.decode(prompt) == row["question"] + "="
        for action in calc.expert_actions(TASK, row):
            step = _step(env, action)
        assert step.done and step.reward == 1.0 and env.stats["correct"] == 1
        assert env.stats["malformed"] == env.stats["one_number"] == env.stats["too_long"] == 0
        kinds.add(env.stats["tool_calls"])
    assert kinds == {0, 2}  # from memory (memory_rate) or two pairwise calls


def test_an_episode_in_tokens():
    env = calc.CalculatorEnv()
    env.reset({"question": "123+456+789"})  # no answer field: the sum
    assert TOK.decode(_step(env, "[123+456]").ids) == "=579;"
    assert TOK.decode(_step(env, "[579+789]").ids) == "=1368;"
    step = _step(env, "1368<eos>")
    assert step == (([], 1.0, True)) and env.stats["tool_calls"] == 2
    env.reset({"question": "1+2", "answer": "3"})
    assert _step(env, "4<eos>") == ([], 0.0, True)  # a wrong answer
    assert env.stats["correct"] == 0


@pytest.mark.parametrize("text,kind", [("[12+]", "malformed"), ("[7]", "one_number"), ("x", None),
                                       ("5[1+2]", "malformed"), ("]", "malformed"), ("[1+2+3", None),
                                       ("[1234567890123+1]", "too_long"), ("[1++2]", "malformed")])
def test_a_malformed_call_is_an_observation(text, kind):
    env = calc.CalculatorEnv()
    env.reset({"question": "1+2"})
    if kind is None:  # not a call: no "]" at the end; an answer that is not digits scores 0, or a cut turn
        step = env.step(TOK.encode(text.replace("x", "")) + [EOS_ID], False) if text == "x" else \
            env.step(TOK.encode(text), True)
        assert step.done and step.reward == 0.0
        return
    step = _step(env, text)
    assert TOK.decode(step.ids) == "=?;" and not step.done and step.reward == 0.0
    assert env.stats[kind] == 1 and env.stats["tool_calls"] == 1
    assert _step(env, "3<eos>") == ([], 1.0, True)  # the episode goes on after it


def test_sft_arrays_learn_the_policy_tokens_only():
    rows = calc.make_rows(TASK, 64, split="train")
    a = calc.sft_arrays(TASK, rows)
    p = TASK.prompt_len
    assert a["tokens"].shape == (64, p + TASK.episode_len)
    assert not a["loss_mask"][:, :p].any() and (a["loss_mask"] <= a["input_mask"]).all()
    for i, row in enumerate(rows):
        prompt, ids, mask = calc.demonstration(TASK, row)
        assert a["tokens"][i, p:p + len(ids)].tolist() == ids
        learnt = "".join(TOK.decode([t], stop_at_eos=False, skip_special_tokens=False)
                         for t in a["tokens"][i][a["loss_mask"][i]])
        assert learnt == "".join(calc.expert_actions(TASK, row))  # the calls and the answer, no result
        assert "=" not in learnt and ";" not in learnt


def test_untrained_policy_episodes_end_within_the_limits():
    from jaxrlhf.models import ModelConfig, Transformer, init_params
    from jaxrlhf.rollout import episodes

    model = Transformer(ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                                    num_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=64))
    params = init_params(model, jax.random.key(0))
    rows = calc.make_rows(TASK, 8, split="test")
    envs = [calc.CalculatorEnv() for _ in rows]
    out = episodes.run_episodes(model, params, envs, rows, jax.random.key(1), max_turns=3, max_turn_tokens=4,
                                max_total_tokens=24, max_env_tokens=8, eos_id=calc.STOP_IDS, temperature=1.0)
    assert np.isfinite(out.rewards).all() and (out.turns <= 3).all()
    assert (out.turns >= 1).all() and all(c in (None, *episodes.LIMITS) for c in out.cut)
    assert all(e.stats["tool_calls"] >= sum(e.stats[k] for k in calc.ERROR_KINDS) for e in envs)
    mask, env_mask = np.asarray(out.sample.response_mask), out.env_mask
    assert not (mask & env_mask).any()
