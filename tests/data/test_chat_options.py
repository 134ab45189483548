"""Chat-model options of the records readers: `chat_template_kwargs` reach every chat
template rendering (prompts, SFT chats, preference pairs), and prompts over
`max_prompt_tokens` are dropped or left-truncated by `long_prompts`, counted either way."""

import logging
import re
import signal
import time

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


# jinja2's sandbox refuses a `range` over 100 000 items (range(10**6) is a bad_template row at
# once), so the stall is two nested ranges of 10**5: 10**10 iterations, hours of rendering.
LOOPING = "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_template_that_loops_past_its_time_stops_naming_the_template_and_the_row(on_error):
    from jaxrlhf.data import chat

    tok = data.CharTokenizer().to_hf()
    tok.chat_template = LOOPING
    start = time.monotonic()
    with pytest.raises(chat.TemplateTimeout) as e:  # not a skipped row: every row would wait its second
        data.prompts_from_records(_rows({"q": "1+2", "a": "3"}), tok, prompt_key="q", answer_key="a",
                                  chat_template=True, on_error=on_error, chat_template_timeout=1)
    assert time.monotonic() - start < 5
    assert str(e.value).startswith("f.jsonl:1: field 'q': the chat template of ")
    assert f"({LOOPING[:60]!r}...)" in str(e.value)  # the template's first 60 characters name it
    assert "took more than 1 s to render one chat (task.chat_template_timeout)" in str(e.value)


def test_a_template_within_its_time_renders_and_leaves_an_outer_timer_armed(tok):
    from jaxrlhf.data import chat

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        assert chat.render(tok, [{"role": "user", "content": "1+2"}], True, timeout=1) == "(1+2="
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < remaining <= 30 and not fired  # the outer timer runs on, its handler restored
        assert signal.getsignal(signal.SIGALRM) is not None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", ["../x", "a/b", "..\\x"])
def test_a_chat_template_name_that_would_write_outside_the_export_is_refused(name):
    from jaxrlhf.data import chat

    tok = data.CharTokenizer().to_hf()
    tok.chat_template = {"default": TEMPLATE, "tool_use": TEMPLATE}
    chat.check_template_names(tok, "model.path")  # names of plain files
    tok.chat_template = {"default": TEMPLATE, name: TEMPLATE}
    with pytest.raises(ValueError, match=rf"^model.path=.*a chat template named {re.escape(repr(name))}, which the "
                                         "export would save outside"):
        chat.check_template_names(tok, "model.path")
