"""Sampled held-out evaluation end to end (`held_out.make_accuracy_fn(sampled=...)`) on a tiny
random model, against metrics recomputed here from one whole-set call of the sampler."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import _xla
import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sampled_eval_task as T  # noqa: E402

from jaxrlhf import data  # noqa: E402
from jaxrlhf.rollout.sampler import sample  # noqa: E402
from jaxrlhf.runs import config_base, held_out, tasks  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    """`{"mean@4", "pass@k", "maj@k"}` from one `sample` call over all 7 prompts (rows
    p·n + j), the correctness rule applied in NumPy, pass@k in exact rationals and maj@k
    by `Counter.most_common` (equal counts keep the order first seen)."""
    model, params, task = T.build("device")
    p, n = task.test_prompts, T.SAMPLED.num_samples
    out = sample(model, params, p["prompt_ids"], p["prompt_mask"], jax.random.key(3), max_new_tokens=task.response_len,
                 temperature=T.SAMPLED.temperature, eos_id=task.eos_id, pad_id=task.pad_id, num_samples=n)
    first_PxN = np.asarray(out.response_ids)[:, 0].reshape(T.NUM_PROMPTS, n)
    correct_PxN = np.asarray(T.correct_rule(first_PxN, p["parity"][:, None]))
    want = {f"mean@{n}": correct_PxN.mean()}
    for k in T.SAMPLED.ks:
        want[f"pass@{k}"] = np.mean([float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))
                                     for c in correct_PxN.sum(1)])
        votes = [Counter(row[:k].tolist()).most_common(1)[0][0] for row in first_PxN]
        want[f"maj@{k}"] = np.mean([bool(T.correct_rule(v, par)) for v, par in zip(votes, p["parity"])])
    return want, correct_PxN


@pytest.fixture(scope="module")
def device_metrics():
    return T.evaluate("device")


@pytest.mark.heavy  # a further case: sampled evaluation against its whole-set reference
def test_sampled_metrics_match_the_whole_set_reference(reference, device_metrics):
    """Batches of 2 prompts (the last one short) sample what one whole-set call samples."""
    want, correct_PxN = reference
    assert 0.2 < correct_PxN.mean() < 0.8 and 0 < correct_PxN.any(1).mean()  # the check has something to see
    assert {k: device_metrics[k] for k in want} == pytest.approx(want, abs=1e-12)
    assert {"accuracy", "reward"} <= set(device_metrics)


def test_host_reward_gives_the_device_reward_metrics(device_metrics):
    """The same rule as a host reward on "decoded" text, with object extras repeated per sample."""
    assert T.evaluate("host") == pytest.approx(device_metrics, abs=1e-12)


def test_continuous_batching_gives_the_same_evaluation(device_metrics, monkeypatch):
    """`train.eval_slots`: 3 slots fed from each batch's rows (8 sampled, 7 greedy) decode
    the same tokens, so every metric is the static batch's; both decodes went through the
    continuous sampler."""
    calls = []

    def spy(*args, **kw):
        calls.append((kw["slots"], kw["temperature"]))
        return real(*args, **kw)

    real = held_out.sample_continuous
    monkeypatch.setattr(held_out, "sample_continuous", spy)
    assert T.evaluate("device", slots=3) == pytest.approx(device_metrics, abs=1e-12)
    assert {(3, 0.0), (3, T.SAMPLED.temperature)} <= set(calls)


def test_sampled_metrics_are_consistent(reference, device_metrics):
    got = device_metrics
    n, ks = T.SAMPLED.num_samples, T.SAMPLED.ks
    assert got["pass@1"] == pytest.approx(got[f"mean@{n}"], abs=1e-12)  # pass@1 = c / n per prompt
    passes = [got[f"pass@{k}"] for k in ks]
    assert passes == sorted(passes) and passes[0] < passes[-1]
    assert all(0.0 <= got[f"{m}@{k}"] <= 1.0 for m in ("pass", "maj") for k in ks)
    assert got["maj@1"] == pytest.approx(reference[1][:, 0].mean(), abs=1e-12)  # the first sample alone


def test_sampled_eval_off_returns_only_the_greedy_metrics():
    model, params, task = T.build("device")
    assert set(held_out.make_accuracy_fn(model, task, batch_size=8)(params)) == {"accuracy", "reward"}


def test_addition_final_answer_is_the_text_up_to_eos():
    task = tasks.addition(config_base.task(num_train=4, num_test=4))
    tok = data.CharTokenizer()
    rows = [tok.encode("95") + [data.EOS_ID, data.PAD_ID], tok.encode("951") + [data.PAD_ID] * 1,
            [data.BOS_ID] + tok.encode("95") + [data.EOS_ID], [data.EOS_ID, data.PAD_ID, data.PAD_ID, data.PAD_ID]]
    ids = np.asarray([r + [data.PAD_ID] * (4 - len(r)) for r in rows])
    mask = np.asarray([[True] * 3 + [False], [True] * 3 + [False], [True] * 4, [True] + [False] * 3])
    assert task.answers(ids, mask) == ["95", None, "<bos>95", ""]  # 2nd: no EOS, no answer
    default = tasks.Task(**{**{f: getattr(task, f) for f in task.__dataclass_fields__}, "final_answer": None})
    assert default.answers(ids, mask) == [tuple(tok.encode("95")), None, (data.BOS_ID, *tok.encode("95")), ()]


@pytest.mark.heavy  # 8 devices; sharded checks also in parallel/
@pytest.mark.slow
def test_sharded_placement_matches_one_device(tmp_path):
    """Mesh fsdp=2 on 2 CPU devices (parameters and prompt rows split, 7 prompts padded to
    8) gives the numbers of one device, for the device and the host reward."""
    out = tmp_path / "mesh.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    env["XLA_FLAGS"] = _xla.flags()  # the task script adds its device count
    proc = subprocess.run([sys.executable, str(Path(T.__file__)), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for kind in ("device", "host"):
        assert results[f"{kind}/mesh"] == pytest.approx(results[f"{kind}/local"], abs=1e-6), kind
    assert results["device/local"] == pytest.approx(results["host/local"], abs=1e-12)


def test_summary_table_has_a_column_per_sampled_metric():
    from jaxrlhf.runs.experiment import _print_summary

    cols = ["mean@4", "pass@1", "pass@4", "maj@1", "maj@4"]
    rng = np.random.default_rng(0)
    rows = [(name, {k: float(v) for k, v in zip(["accuracy", "reward", *cols], rng.random(7))})
            for name in ("start", "after GRPO")]
    sampled = T.SampledEval(num_samples=4, ks=(1, 4), temperature=0.7)
    lines = _print_summary(rows, [], 1.0, show=False, sampled=sampled).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| stage"))
    assert [c.strip() for c in lines[header].strip("|").split("|")][3:] == cols
    for (name, m), line in zip(rows, lines[header + 2:]):
        assert line == f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in ["accuracy", "reward", *cols]) + " |"
    assert "temperature 0.7" in "\n".join(lines)
    plain = _print_summary(rows, [], 1.0, show=False).splitlines()
    assert plain[1] == "| stage | held-out exact match | held-out reward |"


def test_a_bad_eval_k_stops_the_run_before_any_work(tmp_path):
    import importlib.util

    from jaxrlhf.runs import train_and_evaluate

    spec = importlib.util.spec_from_file_location("addition_grpo", Path(T.__file__).parents[2] / "configs" /
                                                  "addition_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.train.eval_samples, config.train.eval_k = 2, "1,4"
    with pytest.raises(ValueError, match=r"train\.eval_k='1,4' with train\.eval_samples=2"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_jsonl_final_answer_is_what_the_host_reward_compares(tmp_path):
    """maj@k on JSONL data votes on the extracted final answer of the text before EOS, and
    equal answers score equally under the task's reward."""
    tok = data.CharTokenizer()
    tok.to_hf().save_pretrained(tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1+2=", "answer": "#### 3"}))
    task = tasks.jsonl(config_base.jsonl_task(path=str(tmp_path / "train.jsonl"), chat_template=False),
                       tokenizer_path=str(tmp_path / "tok"))
    texts = ["1+2=3", "2 3", "(3)", "=4", "", "3=3+", "3-1=2"]
    rows = [tok.encode(t) + [data.EOS_ID] for t in texts] + [tok.encode("12") + tok.encode("3")]  # last: no EOS
    width = max(map(len, rows)) + 1
    ids = np.asarray([r + [data.EOS_ID] * (width - len(r)) for r in rows])
    mask = np.asarray([[j < len(r) for j in range(width)] for r in rows])
    answers = task.answers(ids, mask)
    assert answers == [data.extract_final_answer(t) for t in texts] + [data.extract_final_answer("123")]
    out = rewards_input(task, ids, mask)
    scores = task.reward.host_scores(out, {"answer": ["#### 3"] * len(rows)})["exact_answer"]
    by_answer = {}
    for a, s in zip(answers, scores):
        assert by_answer.setdefault(a, s) == s, a
    assert sorted(set(scores.tolist())) == [0.0, 1.0]


def rewards_input(task, ids, mask):
    from jaxrlhf import rewards

    prompt = np.ones((ids.shape[0], 1), ids.dtype)
    return rewards.RewardInput(prompt, prompt.astype(bool), ids, mask, np.concatenate([prompt, ids], 1),
                               np.concatenate([prompt.astype(bool), mask], 1))


def test_held_out_reward_is_over_the_rows_some_reward_scores():
    """A Python reward in TRL's convention may return None for a row (no score): the held-out
    `reward` is the mean over the scored rows, `accuracy` (the first component) is unchanged,
    and a batch no weighted reward scores at all is an error naming the function."""
    import dataclasses

    from jaxrlhf import rewards

    model, params, task = T.build("device")

    def some(prompts, responses, ex):  # 2.0 on even prompts, no score on odd ones
        return [2.0 if p == 0 else None for p in ex["parity"]]

    def none(prompts, responses, ex):
        return [None] * len(prompts)

    want = held_out.make_accuracy_fn(model, task, batch_size=T.BATCH_SIZE)(params)["accuracy"]
    for fn, expect in ((some, 2.0), (none, None)):
        reward = rewards.combine([(0.0, task.reward), (1.0, rewards.host_reward(fn, T.IdsTokenizer(), name="some"))])
        evaluate = held_out.make_accuracy_fn(model, dataclasses.replace(task, reward=reward), batch_size=T.BATCH_SIZE)
        if expect is None:
            with pytest.raises(ValueError, match=r"no row of the batch has a score: .*none"):
                evaluate(params)
        else:
            assert evaluate(params) == {"accuracy": pytest.approx(want, abs=1e-12), "reward": pytest.approx(expect)}
