"""Reward functions in worker processes under a clock (`jaxrlhf.reward_workers`), and the
values a Python reward may return (`rewards.trl_reward`: bool, None, the bound on |score|).

The workers run functions of a module written to tmp_path and put on sys.path (a spawned
worker gets the parent's sys.path). The run-level test, a hung function stopping `python -m
jaxrlhf.train`, is in tests/runs/test_exits.py.
"""

import logging
import math
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import data, reward_workers, rewards

TOK = data.CharTokenizer()

MODULE = '''
import time

def maybe_hang(completions, **kwargs):
    if completions[0] == "999":
        time.sleep(3600)
    return [float(len(c)) for c in completions]

def bye(completions, **kwargs):
    raise SystemExit(3)

def boom(completions, **kwargs):
    raise KeyError("no such field")

def unpicklable(completions, **kwargs):
    return (lambda: 0)
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "clocked_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "clocked_rewards"
    reward_workers.close_all()


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts as ended)."""
    try:
        return "\nState:\tZ" in open(f"/proc/{pid}/status").read()
    except OSError:
        return True


def _inputs(prompts: list[str], responses: list[str]) -> rewards.RewardInput:
    p = np.asarray([TOK.encode(x) for x in prompts])
    r = np.asarray([TOK.encode(x) + [TOK.eos_id] for x in responses])
    seq = np.concatenate([p, r], axis=1)
    return rewards.RewardInput(p, np.ones_like(p), r, np.ones_like(r), seq, np.ones_like(seq))


def test_a_call_past_the_timeout_is_an_error_naming_the_function_and_the_worker_is_stopped(module, caplog):
    clocked = reward_workers.Clocked(f"{module}:maybe_hang", timeout=2, progress_every=0.5)
    assert clocked(prompts=["1+1="], completions=["22"]) == [2.0]
    pid = clocked.pid
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="jaxrlhf"):
        with pytest.raises(reward_workers.RewardTimeout, match=r"reward function clocked_rewards:maybe_hang did not "
                                                               r"return within 2 s \(reward.timeout=2\) on 2 "):
            clocked(prompts=["a", "b"], completions=["999", "x"])
    assert time.monotonic() - start < 2 + 3  # abandoned, not awaited
    assert clocked.pid is None and _gone(pid)
    lines = [r.getMessage() for r in caplog.records if "has run" in r.getMessage()]
    assert lines[0] == "reward function clocked_rewards:maybe_hang has run 0.5 s on 2 completions (timeout 2 s)"
    assert 3 <= len(lines) <= 4  # at 0.5, 1, 1.5 s (and 2 s where the clock lands just before the deadline)


def test_on_timeout_zero_scores_the_batch_0_counts_it_and_the_next_call_gets_a_fresh_worker(module, caplog):
    clocked = reward_workers.Clocked(f"{module}:maybe_hang", timeout=2, on_timeout="zero")
    reward = rewards.trl_reward(clocked, TOK, name="maybe_hang")
    with caplog.at_level(logging.WARNING, logger="jaxrlhf"):
        scores = reward.host_scores(_inputs(["1+1=", "2+2="], ["999", "444"]), {})
    assert scores["maybe_hang"].tolist() == [0.0, 0.0] and scores["maybe_hang/timeouts"].tolist() == [1.0, 1.0]
    assert float(reward.metrics(scores)["reward/maybe_hang/timeouts"]) == 1.0 and clocked.timeouts == 1
    assert "reward function clocked_rewards:maybe_hang did not return within 2 s" in caplog.text
    assert clocked.pid is None  # killed
    scores = reward.host_scores(_inputs(["1+1="], ["22"]), {})
    assert scores["maybe_hang"].tolist() == [2.0] and scores["maybe_hang/timeouts"].tolist() == [0.0]
    pid = clocked.pid
    reward_workers.close_all()
    assert clocked.pid is None and _gone(pid)


def test_what_the_function_raises_in_its_worker_comes_back_as_in_process(module):
    inputs = _inputs(["1+1="], ["2"])

    def run(fn):
        return rewards.trl_reward(reward_workers.Clocked(f"{module}:{fn}", timeout=30), TOK).host_scores(inputs, {})

    with pytest.raises(rewards.RewardFunctionError, match=r"^reward function clocked_rewards:bye called sys.exit\(3\): "
                                                          "a reward function returns its scores"):
        run("bye")
    with pytest.raises(RuntimeError, match=r"reward 'boom' raised KeyError: 'no such field'") as e:
        run("boom")
    assert "in the reward function's worker process" in str(e.value.__cause__.__cause__)  # the worker's traceback
    with pytest.raises(RuntimeError, match=r"reward 'unpicklable' raised TypeError: returned function, which cannot "
                                           "be sent back from its worker process"):
        run("unpicklable")
    with pytest.raises(ValueError, match=r"reward.on_timeout='later': expected one of \('error', 'zero'\)"):
        reward_workers.Clocked(f"{module}:bye", timeout=1, on_timeout="later")


def test_bool_scores_count_as_0_and_1_and_none_is_left_out_of_its_term():
    inputs = _inputs(["1+1=", "2+2=", "3+3="], ["2", "4", "7"])
    flags = rewards.trl_reward(lambda completions, **kw: [c == "2" for c in completions], TOK, name="flags")
    some = rewards.trl_reward(lambda completions, **kw: [1.0, None, 3.0], TOK, name="some")
    exact = rewards.jax_reward(lambda ids, mask, ex: jnp.ones(ids.shape[0]), name="exact")
    reward = rewards.combine([(1.0, exact), (1.0, flags), (2.0, some)])
    total, scores = reward(inputs)
    assert scores["flags"].tolist() == [1.0, 0.0, 0.0] and math.isnan(scores["some"][1])
    # exact 1 + flags + 2 · some, the None of row 1 adding nothing: [1 + 1 + 2, 1 + 0 + 0, 1 + 0 + 6]
    np.testing.assert_allclose(total, [4.0, 1.0, 7.0])
    metrics = reward.metrics(scores)
    assert float(metrics["reward/some"]) == 2.0  # (1 + 3) / 2: the mean over the scored rows
    assert float(metrics["reward/flags"]) == pytest.approx(1 / 3)


def test_a_row_no_weighted_reward_scores_is_dropped_on_request_and_an_error_by_default():
    inputs = _inputs(["1+1=", "2+2="], ["2", "4"])
    none = rewards.trl_reward(lambda completions, **kw: [0.5, None], TOK, name="none")
    exact = rewards.jax_reward(lambda ids, mask, ex: jnp.ones(ids.shape[0]), name="exact")
    reward = rewards.combine([(0.0, exact), (1.0, none)])
    with pytest.raises(ValueError, match=r"row 1 \(prompt '2\+2='\) has no score: every reward with a weight \(none\) "
                                         r"returned None for it \(1 of 2 rows\).*reward.task_weight > 0"):
        reward.host_scores(inputs, {})  # the default: an error
    scores = reward.host_scores(inputs, {}, drop_unscored=True)  # GRPO and PPO: the row is dropped from the update
    np.testing.assert_array_equal(reward.scored({**scores, "exact": np.ones(2)}), [True, False])
    weighted = rewards.combine([(0.1, exact), (1.0, none)])
    weighted.host_scores(inputs, {})  # the task's reward scores every row
    np.testing.assert_array_equal(weighted.scored({**scores, "exact": np.ones(2)}), [True, True])
    never = rewards.trl_reward(lambda completions, **kw: [None, None], TOK, name="never")
    with pytest.raises(ValueError, match=r"no row of the batch has a score: every reward with a weight \(\S+\) returned "
                                         r"None for all 2 rows"):
        never.host_scores(inputs, {}, drop_unscored=True)


def test_a_score_past_the_bound_is_an_error_naming_the_function_and_the_row():
    def huge(completions, **kwargs):
        return [0.0, 1e30]

    long_prompt = "9" * 100
    reward = rewards.trl_reward(huge, TOK, max_abs_score=1e6)
    with pytest.raises(ValueError, match=rf"reward function {__name__}:\S*huge returned 1e\+30 for row 1 \(prompt "
                                         rf"'{'9' * 80}'\); \|score\| may be at most 1e\+06 \(reward.max_abs_score\)"):
        reward.host_scores(_inputs(["1+1=" + "9" * 96, long_prompt], ["2", "4"]), {})
    assert rewards.trl_reward(huge, TOK).host_scores(_inputs(["1", "2"], ["2", "4"]), {})["huge"][1] == 1e30
    with pytest.raises(ValueError, match=r"reward 'nan' returned nan for response 0"):
        rewards.trl_reward(lambda completions, **kw: [float("nan")], TOK, name="nan").host_scores(
            _inputs(["1"], ["2"]), {})


def test_the_config_puts_functions_in_workers_unless_timeout_is_none(module):
    from jaxrlhf.runs import config_base, tasks

    def fns(**kw):
        return [fn for _, _, fn in tasks.python_rewards(config_base.reward(fns=f"{module}:bye", **kw))]

    clocked, = fns()
    assert isinstance(clocked, reward_workers.Clocked) and (clocked.timeout, clocked.on_timeout) == (300, "error")
    assert clocked.pid is None  # started at its first call
    plain, = fns(timeout=None)
    assert not isinstance(plain, reward_workers.Clocked) and plain.__name__ == "bye"
    with pytest.raises(ValueError, match=r"reward.timeout=-1: expected seconds > 0, or None for no limit"):
        fns(timeout=-1)
    with pytest.raises(ValueError, match=r"reward.on_timeout='skip'"):
        fns(on_timeout="skip")
