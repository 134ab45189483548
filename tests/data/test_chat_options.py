"""Chat-model options of the records readers: `chat_template_kwargs` reach every chat
template rendering (prompts, SFT chats, preference pairs), and prompts over
`max_prompt_tokens` are dropped or left-truncated by `long_prompts`, counted either way."""

import logging

import pytest

from jaxrlhf import data
from jaxrlhf.runs.tasks import template_kwargs

# "(" opens a user turn, "=" the assistant's ("*=" with `think=False`), ")" ends a turn.
TEMPLATE = ("{% set open = '*=' if (think is defined and not think) else '=' %}"
            "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ open }}{{ m['content'] }}){% else %}"
            "({{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ open }}{% endif %}")


@pytest.fixture(scope="module")
def tok():
    tok = data.CharTokenizer().to_hf()
    tok.chat_template = TEMPLATE
    return tok


def _rows(*records):
    return [(f"f.jsonl:{i + 1}", r) for i, r in enumerate(records)]


def test_template_kwargs_reach_every_rendering(tok):
    kw = dict(chat_template=True, chat_template_kwargs=template_kwargs('{"think": false}'))
    prompts = data.prompts_from_records(_rows({"q": "1+2", "a": "3"}), tok, prompt_key="q", answer_key="a", **kw)
    assert prompts.prompt_text == ["(1+2*="]
    plain = data.prompts_from_records(_rows({"q": "1+2", "a": "3"}), tok, prompt_key="q", answer_key="a",
                                      chat_template=True)
    assert plain.prompt_text == ["(1+2="]
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    sft = data.sft_from_records(_rows({"messages": chat}), tok, **kw)
    assert sft.prompt_text == ["(1+2*="] and tok.decode(sft.response_ids[0]) == "3)"
    pairs = data.pairs_from_records(_rows({"prompt": "1+2", "chosen": "3", "rejected": "4"}), tok, **kw)
    assert pairs.prompt_text == ["(1+2*="] and pairs.chosen_text == ["3)"]


@pytest.mark.parametrize("value", ["[1]", "think", '"x"'])
def test_a_value_that_is_not_a_json_object_names_the_field(value):
    with pytest.raises(ValueError, match=r"task.chat_template_kwargs=.*not a JSON object"):
        template_kwargs(value)


def test_long_prompts_dropped_or_left_truncated_and_counted(tok, caplog):
    records = _rows({"q": "12+34", "a": "46"}, {"q": "1+2", "a": "3"}, {"q": "123+456", "a": "579"})
    kw = dict(prompt_key="q", answer_key="a", max_prompt_tokens=5, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.data.records"):
        dropped = data.prompts_from_records(records, tok, **kw)
    assert dropped.answer == ["3"] and dropped.skipped.counts["too_long"] == 2 and "too_long: 2" in caplog.text
    with pytest.raises(data.DataError, match="f.jsonl:1: field 'q'.*max_prompt_tokens=5"):
        data.prompts_from_records(records, tok, **dict(kw, on_error="raise"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.data.records"):
        kept = data.prompts_from_records(records, tok, long_prompts="left_truncate", **kw)
    # BOS kept, then the last 4 tokens: the end of the prompt survives
    assert [tok.decode(ids) for ids in kept.prompt_ids] == ["<bos>2+34", "<bos>1+2", "<bos>+456"]
    assert kept.skipped.truncated == 2 and "left-truncated 2 prompts" in caplog.text
    chat = data.prompts_from_records(records, tok, long_prompts="left_truncate", chat_template=True, **kw)
    assert [tok.decode(ids) for ids in chat.prompt_ids] == ["2+34=", "(1+2=", "+456="]  # generation prompt kept
    with pytest.raises(ValueError, match="long_prompts must be one of"):
        data.prompts_from_records(records, tok, long_prompts="cut", **kw)
