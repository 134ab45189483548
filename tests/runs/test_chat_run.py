"""A chat model's options through a GRPO run (`hf_gsm8k_grpo:tiny`) on a tiny random
checkpoint whose saved `transformers` tokenizer has a chat template reading a variable:
`task.stop_strings` cut the training rollouts and the held-out samples right after the
first stop string, `task.chat_template_kwargs` reach the prompts, and prompts over
`max_prompt_tokens` are left-truncated (`task.long_prompts`) with the count logged."""

import importlib.util
import json
import logging
from pathlib import Path

from jaxrlhf.runs import train_and_evaluate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# "(" opens a user turn, "=" the assistant's ("*=" with `think=False`), ")" ends a turn.
TEMPLATE = ("{% set open = '*=' if (think is defined and not think) else '=' %}"
            "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ open }}{{ m['content'] }}){% else %}"
            "({{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ open }}{% endif %}")
STOPS = ["+", "-", "(", ")", "12"]  # one-character strings, and one of two tokens


def test_grpo_with_stop_strings_template_kwargs_and_long_prompts(tmp_path, caplog):
    from jaxrlhf import data
    from jaxrlhf.models import ModelConfig, random_init, save_pretrained

    tok = data.CharTokenizer().to_hf()
    tok.chat_template = TEMPLATE
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, model_type="qwen2", qkv_bias=True, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    save_pretrained(*random_init(cfg), tmp_path / "ckpt", tokenizer=tok)
    rows = [{"question": f"{a}+{b}", "answer": f"#### {a + b}"} for a, b in [(1, 2), (13, 4), (5, 6), (17, 21)]]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = importlib.util.spec_from_file_location("hf_gsm8k_grpo", CONFIGS / "hf_gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        config.model.path, config.task.path = str(tmp_path / "ckpt"), str(tmp_path / "train.jsonl")
        config.task.update(chat_template=True, chat_template_kwargs='{"think": false}', max_prompt_tokens=6,
                           long_prompts="left_truncate", stop_strings=json.dumps(STOPS))
        config.grpo.sampling.update(max_new_tokens=12, num_samples=4)
        config.task.max_new_tokens = 12
        config.train.update(export=False, eval_every=0)
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.data.records"):
        summary = train_and_evaluate(config, tmp_path / "run")
    assert "left-truncated 2 prompts" in caplog.text  # "(13+4*=" and "(17+21*=": 7 and 8 tokens
    prompts = [p for p, _, _ in summary["samples"]]
    assert prompts and all(p.endswith("*=") and len(p) <= 6 for p in prompts)  # the kwarg; the end kept
    texts = [r for _, r, _ in summary["samples"]]
    for text in texts:  # each response ends at its first stop string, or holds none
        assert not any(s in text[:-1] for s in STOPS)
    assert any(text and any(text.endswith(s) for s in STOPS) for text in texts)
    # the training rollouts are cut too (uncut, this run's mean lengths are 9.8 and 7.9 of the 12 tokens)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(m["grpo/response_length/mean"] < 12 / 2 for m in metrics)
