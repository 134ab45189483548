"""Every shipped config loads, is locked, and its tiny variant trains end to end."""

import importlib.util
import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compile_cache import persistent_compile_cache, session_folder  # noqa: E402

from jaxrlhf.algorithms import timing  # noqa: E402
from jaxrlhf.runs import train_and_evaluate  # noqa: E402
from jaxrlhf.runs.loop import Preempted  # noqa: E402

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.py"))


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_is_locked(path):
    module = _load(path)
    assert "python -m jaxrlhf.train --config=configs/" in module.__doc__
    for variant in (None, "tiny"):
        c = module.get_config(variant)
        assert c.is_locked
    with pytest.raises(AttributeError, match='Did you mean "lr"'):
        c.sft.optim.lrr = 1.0  # every config has an SFT section (possibly 0 steps)
    with pytest.raises(ValueError, match="unknown variant"):
        module.get_config("huge")


@pytest.fixture(scope="module")
def compile_cache_dir(tmp_path_factory):
    return session_folder(tmp_path_factory)


def _rows(workdir) -> list[dict]:
    """`metrics.jsonl` without the wall-clock timings (which differ between runs)."""
    rows = map(json.loads, (Path(workdir) / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in row.items() if "/time/" not in k} for row in rows]


# addition_grpo and addition_ppo cover every phase kind; the other tiny variants are heavy.
@pytest.mark.parametrize("path", [p if p.stem in ("addition_grpo", "addition_ppo") else pytest.param(p, marks=pytest.mark.heavy)
                                  for p in CONFIGS if p.stem.startswith("addition_")], ids=lambda p: p.stem)
def test_tiny_variant_runs_end_to_end(path, tmp_path, compile_cache_dir):
    """Each algorithm end to end; then the same run stopped like a SIGTERM at step 1 of its
    last phase, left with what a kill -9 while saving step 2 leaves (that step's metrics row,
    an orbax temporary folder) and resumed: its log and results equal the uninterrupted run's."""
    config = _load(path).get_config("tiny")
    if path.stem == "addition_opd":  # its teacher: a tiny folder with the task's tokenizer
        from test_opd_run import teacher_folder

        with config.unlocked():
            config.opd.teacher_path = str(teacher_folder(tmp_path / "teacher"))
    with persistent_compile_cache(compile_cache_dir):  # the resumed run's programs: compiled once
        summary = train_and_evaluate(config, tmp_path / "full")
        full = tmp_path / "full"
        assert (full / "metrics.jsonl").read_text().strip()
        assert json.loads((full / "summary.json").read_text())["seconds"] > 0
        assert (full / "export" / "config.json").exists()
        if config.algorithm != "reward_model":
            assert {"accuracy", "reward"} <= set(summary["stages"][f"after {config.algorithm.upper()}"])
        _assert_time_split(full)

        if path.stem == "addition_ppo_rule":
            return  # PPO's resume is checked on addition_ppo, which has one more phase
        lines = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
        last = next(k for k in json.loads(lines[-1]) if k != "step").split("/")[0]  # the last phase
        stop = len(lines) - json.loads(lines[-1])["step"] + 1  # its step 1, counting every phase's steps
        calls = itertools.count(1)
        resumed = tmp_path / "resumed"
        with pytest.raises(Preempted):
            train_and_evaluate(config, resumed, should_stop=lambda step: next(calls) == stop)
        with open(resumed / "metrics.jsonl", "a") as log:
            log.write(lines[stop])  # step 2's row, then the kill while its checkpoint was written
        (resumed / last / "2.orbax-checkpoint-tmp").mkdir()
        (resumed / last / "2.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text("{")
        again = train_and_evaluate(config, resumed)
    assert _rows(resumed) == _rows(full)
    assert again["stages"] == summary["stages"]


def _assert_time_split(workdir):
    """Every phase's rows carry `time/update_s`, the RL phases' the whole time split
    (finite, >= 0, the parts within the loop's `time/step_s`), tokens/s = the valid
    response tokens over the rollout's seconds."""
    tokens = {"grpo": "response_tokens", "opd": "response_tokens", "ppo": "num_tokens"}
    for row in map(json.loads, (Path(workdir) / "metrics.jsonl").read_text().splitlines()):
        phase = next(k for k in row if k != "step").split("/")[0]
        names = timing.RL_STEP if phase in tokens else (timing.UPDATE_S,)
        times = {k: row[f"{phase}/{k}"] for k in names}
        assert all(math.isfinite(v) and v >= 0 for v in times.values()), (phase, row["step"], times)
        parts = sum(v for k, v in times.items() if k in timing.PARTS)
        assert parts <= row[f"{phase}/{timing.STEP_S}"], (phase, row["step"], times)
        if phase in tokens:
            assert math.isclose(row[f"{phase}/{timing.TOKENS_PER_S}"],
                                row[f"{phase}/{tokens[phase]}"] / row[f"{phase}/{timing.ROLLOUT_S}"], rel_tol=1e-6)


def _tiny_checkpoint(path, chat_template=None):
    """A tiny random qwen2 checkpoint with the character tokenizer (and `chat_template`, a
    Jinja template, if given), as a Hugging Face folder."""
    import transformers

    from jaxrlhf import data
    from jaxrlhf.models import ModelConfig, random_init, save_pretrained

    tok = data.CharTokenizer().to_hf()
    tok.chat_template = chat_template
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, model_type="qwen2", qkv_bias=True, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    model, params = random_init(cfg)
    save_pretrained(model, params, path, tokenizer=tok)
    assert isinstance(transformers.AutoTokenizer.from_pretrained(path), transformers.PreTrainedTokenizerBase)
    return path


def test_hf_checkpoint_config_runs_on_a_tiny_random_checkpoint_and_jsonl(tmp_path):
    """The realistic config end to end: local HF folder (weights + tokenizer) and JSONL data.
    The `:tiny` variant encodes prompts without the chat template, yet its export keeps the
    source tokenizer's template (it was written as `chat_template: null`)."""
    import transformers

    template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    ckpt = _tiny_checkpoint(tmp_path / "ckpt", chat_template=template)
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2)]]
    rows.append({"question": "", "answer": "1"})  # skipped (empty prompt) and counted
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = _load(next(p for p in CONFIGS if p.stem == "hf_gsm8k_grpo")).get_config("tiny")
    with config.unlocked():
        config.model.path = str(ckpt)
        config.task.path = str(tmp_path / "train.jsonl")
        # The model options reach the model: chunked attention, a bf16 KV cache.
        config.model.attention = "chunked"
        config.model.cache_dtype = "bfloat16"
    summary = train_and_evaluate(config, tmp_path / "run")
    assert "after GRPO" in summary["stages"]
    assert (tmp_path / "run" / "export" / "model.safetensors").exists()
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "export")
    assert exported.chat_template == template
    messages = [{"role": "user", "content": "1+2"}]
    assert exported.apply_chat_template(messages, tokenize=False) == "1+2="


@pytest.mark.heavy  # end to end
def test_word_problems_config_runs_on_a_tiny_random_checkpoint(tmp_path):
    """The real-model config's task (generated questions, exact answer + format reward) end
    to end on a tiny checkpoint; without a model path it says what to set."""
    config = _load(next(p for p in CONFIGS if p.stem == "smollm2_word_problems")).get_config("tiny")
    with pytest.raises(ValueError, match="needs a tokenizer: set model.path"):
        train_and_evaluate(config, tmp_path / "none")
    with config.unlocked():
        config.model.path = str(_tiny_checkpoint(tmp_path / "ckpt"))
    summary = train_and_evaluate(config, tmp_path / "run")
    assert {"accuracy", "reward"} <= set(summary["stages"]["after GRPO"])
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"grpo/reward/exact_answer", "grpo/reward/format"} <= set(logged)


def test_model_options_reach_the_model_config():
    """`config.model.<option>` (RUNTIME_FIELDS) is what the built model runs with."""
    from jaxrlhf.runs import config_base, setup

    cfg = config_base.model(attention="chunked", cache_dtype="bfloat16", matmul_dtype="bfloat16")
    model, _ = setup.build_model(cfg, vocab_size=16)
    assert (model.config.attention, model.config.cache_dtype, model.config.matmul_dtype) == ("chunked", "bfloat16",
                                                                                              "bfloat16")
    with pytest.raises(ValueError, match="attention='flash'"):
        setup.build_model(config_base.model(attention="flash"), vocab_size=16)


def test_unknown_ppo_reward_is_an_error_before_any_work(tmp_path):
    config = _load(Path(__file__).resolve().parents[2] / "configs" / "addition_ppo_rule.py").get_config("tiny")
    config.unlock()
    config.ppo.reward = "learned"
    with pytest.raises(ValueError, match=r"ppo.reward='learned' is impossible: it must be one of 'model', 'task'"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_rl_schedules_count_optimizer_steps(tmp_path):
    """A PPO iteration makes epochs × minibatches optimizer steps: the learning-rate schedule
    spans all of them, so a linear decay is still above 0 at the last iteration (it reached
    0 halfway when the schedule counted iterations)."""
    config = _load(Path(__file__).resolve().parents[2] / "configs" / "addition_ppo_rule.py").get_config("tiny")
    config.unlock()
    config.ppo.update(steps=3, num_ppo_epochs=2, num_minibatches=1)
    config.ppo.optim.update(lr=1e-3, schedule="linear", warmup_steps=0)
    config.sft.steps = 0  # PPO's schedule alone is the point
    config.train.update(eval_every=0, export=False)
    train_and_evaluate(config, tmp_path)
    lrs = [r["ppo/lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
           if "ppo/lr" in r]
    # logged before each iteration's updates, at optimizer steps 0, 2, 4 of 6
    assert lrs == pytest.approx([1e-3, 1e-3 * 4 / 6, 1e-3 * 2 / 6], rel=1e-5)
