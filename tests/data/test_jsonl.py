"""JSONL/Parquet readers: field names, clear errors naming file:line and field, skip counts."""

import json

import pytest

from jaxrlhf.data import jsonl
from jaxrlhf.data.char_tokenizer import BOS_ID, CharTokenizer
from jaxrlhf.data.records import DataError

TOK = CharTokenizer()


def _write(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


def test_reads_prompts_with_custom_keys(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"question": "1+2=", "answer": "3"}, "", {"question": "10+5=", "answer": 15}])
    data = jsonl.read_prompts(p, TOK, prompt_key="question", answer_key="answer")
    assert data.prompt_text == ["1+2=", "10+5="]
    assert data.prompt_ids[0] == [BOS_ID] + TOK.encode("1+2=")
    assert data.answer == ["3", "15"]  # numbers are kept as text
    assert data.location == [f"{p}:1", f"{p}:3"]  # the blank line 2 is ignored
    assert data.skipped.total == 0
    assert jsonl.read_prompts(p, TOK, prompt_key="question", answer_key=None).answer == [None, None]


@pytest.mark.parametrize("line, field, reason, message", [
    ('{"prompt": "1+2=", ', None, "invalid_json", "invalid JSON"),
    ('[1, 2]', None, "not_an_object", "expected a JSON object, got list"),
    ({"answer": "3"}, "prompt", "missing_key", "missing"),
    ({"prompt": 12, "answer": "3"}, "prompt", "wrong_type", "expected a string, got int"),
    ({"prompt": "1+2=", "answer": ["3"]}, "answer", "wrong_type", "expected a string or a number, got list"),
    ({"prompt": "  ", "answer": "3"}, "prompt", "empty", "is empty"),
    ({"prompt": "1+2=a", "answer": "3"}, "prompt", "untokenizable", "'a' is not in the vocabulary"),
    ({"prompt": "111+222=", "answer": "333"}, "prompt", "too_long", "has 9 tokens, more than max_prompt_tokens=8"),
])
def test_errors_name_file_line_and_field(tmp_path, line, field, reason, message):
    p = _write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, line])
    with pytest.raises(DataError) as info:
        jsonl.read_prompts(p, TOK, max_prompt_tokens=8)
    err = info.value
    assert (err.location, err.field, err.reason) == (f"{p}:2", field, reason)
    assert str(err).startswith(f"{p}:2: field '{field}': " if field else f"{p}:2: ")
    assert message in str(err)


def test_skip_mode_counts_per_reason(tmp_path, caplog):
    p = _write(tmp_path / "mixed.jsonl", [
        {"prompt": "1+1=", "answer": "2"},
        "not json",
        {"prompt": "", "answer": "0"},
        {"prompt": "2+2="},
        {"prompt": 5, "answer": "5"},
        "{broken",
        {"prompt": "3+3=", "answer": "6"},
    ])
    data = jsonl.read_prompts(p, TOK, on_error="skip")
    assert data.prompt_text == ["1+1=", "3+3="]
    assert dict(data.skipped.counts) == {"invalid_json": 2, "empty": 1, "missing_key": 1, "wrong_type": 1}
    assert data.skipped.total == 5
    assert f"{p}:2" in data.skipped.messages[0]
    assert "skipped 5 records" in caplog.text
    with pytest.raises(ValueError, match="on_error"):
        jsonl.read_prompts(p, TOK, on_error="ignore")


def test_non_utf8_byte_names_file_and_line_and_is_skipped(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}).encode() for i in range(70)]
    rows[69] = b'{"prompt": "9+1=\xff", "answer": "10"}'  # line 70: a Latin-1 byte, not UTF-8
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(DataError) as info:
        jsonl.read_prompts(p, TOK)
    assert (info.value.location, info.value.reason) == (f"{p}:70", "invalid_utf8")
    assert str(info.value) == f"{p}:70: not UTF-8 (byte 0xff at column 17)"
    data = jsonl.read_prompts(p, TOK, on_error="skip")
    assert len(data.prompt_text) == 69 and f"{p}:70" not in data.location
    assert dict(data.skipped.counts) == {"invalid_utf8": 1}


def test_preference_pairs_and_their_errors(tmp_path):
    p = _write(tmp_path / "pairs.jsonl", [
        {"q": "1+2=", "good": "3", "bad": "4"},
        {"q": "1+2=", "good": "3"},
        {"q": "1+2=", "good": "3", "bad": "4444"},
    ])
    keys = dict(prompt_key="q", chosen_key="good", rejected_key="bad")
    pairs = jsonl.read_preference_pairs(p, TOK, max_response_tokens=3, on_error="skip", **keys)
    assert pairs.chosen_ids == [TOK.encode("3")] and pairs.rejected_text == ["4"]
    assert dict(pairs.skipped.counts) == {"missing_key": 1, "too_long": 1}
    with pytest.raises(DataError, match=rf"{p}:2: field 'bad': missing"):
        jsonl.read_preference_pairs(p, TOK, **keys)


def test_chat_template_is_applied(tmp_path):
    hf = CharTokenizer().to_hf()
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}={% endif %}")
    p = _write(tmp_path / "chat.jsonl", [
        {"prompt": "1+2", "answer": "3"},
        {"prompt": [{"role": "user", "content": "4+4"}], "answer": "8"},
        {"prompt": [{"role": "user"}], "answer": "8"},
    ])
    data = jsonl.read_prompts(p, hf, chat_template=True, on_error="skip")
    assert data.prompt_text == ["<bos>1+2=", "<bos>4+4="]
    assert data.prompt_ids[0] == [BOS_ID] + TOK.encode("1+2=")  # one BOS: the template's
    assert dict(data.skipped.counts) == {"wrong_type": 1}
    with pytest.raises(ValueError, match="no chat template"):
        jsonl.read_prompts(p, TOK, chat_template=True)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", ""], "answer": ["3", "0"]}), p)
    with pytest.raises(DataError, match=rf"{p}:2: field 'prompt': is empty"):
        jsonl.read_prompts(p, TOK)
    assert jsonl.read_prompts(p, TOK, on_error="skip").answer == ["3"]


# ---- input bounded before it is expanded ------------------------------------------------------------------------


def _write_long_row(path, chars):
    """Line 1 and 3 good rows, line 2 one valid row whose prompt has `chars` characters
    (written in pieces: the test itself never holds it)."""
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "answer": "2"}) + '\n{"prompt": "')
        for _ in range(chars // 10**6):
            f.write("1" * 10**6)
        f.write('", "answer": "1"}\n' + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    return path


def test_a_huge_line_is_skipped_holding_at_most_the_limit_of_it(tmp_path):
    """A 50 MB line under max_row_bytes=1 KiB: skipped and counted, the rows around it read
    with their own line numbers, and the reader's peak memory stays near the limit (it
    reads at most limit + 1 bytes of the line, then reads past the rest in pieces)."""
    import tracemalloc

    p = _write_long_row(tmp_path / "huge.jsonl", 50 * 10**6)
    tracemalloc.start()
    try:
        data = jsonl.read_prompts(p, TOK, max_row_bytes=1024, on_error="skip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak  # the line is 50 MB
    assert data.location == [f"{p}:1", f"{p}:3"] and data.answer == ["2", "4"]
    assert dict(data.skipped.counts) == {"row_too_long": 1}
    assert data.skipped.messages == [f"{p}:2: the line is longer than max_row_bytes=1024 bytes"]


def test_a_long_line_is_an_error_naming_file_and_line_and_the_limit_is_exact(tmp_path):
    row = {"prompt": "1+1=", "answer": "2"}
    size = len(json.dumps(row))  # 33 bytes, the newline not counted
    p = _write(tmp_path / "d.jsonl", [row, {"prompt": "1+1=", "answer": "22"}, row])
    with pytest.raises(DataError) as info:
        jsonl.read_prompts(p, TOK, max_row_bytes=size)
    assert (info.value.location, info.value.field, info.value.reason) == (f"{p}:2", None, "row_too_long")
    assert str(info.value) == f"{p}:2: the line is longer than max_row_bytes={size} bytes"
    assert len(jsonl.read_prompts(p, TOK, max_row_bytes=size + 1).answer) == 3
    assert len(jsonl.read_prompts(p, TOK, max_row_bytes=None).answer) == 3
    with pytest.raises(ValueError, match=rf"^{p} has more than max_file_bytes=64 bytes"):
        jsonl.read_prompts(p, TOK, max_file_bytes=64)


def test_a_long_parquet_cell_is_a_bad_row_naming_its_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", "1" * 2000, "2+2="], "answer": ["3", "0", "4"]}), p)
    with pytest.raises(DataError) as info:
        jsonl.read_prompts(p, TOK, max_row_bytes=1024)
    assert (info.value.location, info.value.field, info.value.reason) == (f"{p}:2", "prompt", "row_too_long")
    assert str(info.value) == (f"{p}:2: field 'prompt': the row has 2001 bytes of text (2000 in this field), "
                               "more than max_row_bytes=1024")
    data = jsonl.read_prompts(p, TOK, max_row_bytes=1024, on_error="skip")
    assert data.answer == ["3", "4"] and dict(data.skipped.counts) == {"row_too_long": 1}


class _SpyTokenizer:
    """One id per character like `TOK` (longest token "<bos>": 5 bytes); records the length
    of every text it is asked to encode."""

    bos_token_id = BOS_ID

    def __init__(self):
        self.encoded = []

    def get_vocab(self):
        return TOK.vocab

    def encode(self, text, add_special_tokens):
        self.encoded.append(len(text))
        return [BOS_ID] * add_special_tokens + TOK.encode(text)


def test_a_text_longer_than_the_token_limit_can_hold_is_refused_without_tokenizing_it():
    """max_prompt_tokens=8 tokens of at most 5 bytes hold at most 40 bytes: a 41-byte prompt
    (or response) is too_long before the tokenizer sees it; an 8-byte one is tokenized
    (9 tokens with BOS: too_long by its count); a left-truncated prompt is tokenized."""
    from jaxrlhf.data import records

    spy = _SpyTokenizer()
    rows = [("r:1", {"prompt": "1" * 41, "answer": "1"}), ("r:2", {"prompt": "111+222=", "answer": "1"}),
            ("r:3", {"prompt": "1+1=", "answer": "2"})]
    data = records.prompts_from_records(rows, spy, max_prompt_tokens=8, on_error="skip")
    assert data.location == ["r:3"] and spy.encoded == [8, 4]  # never the 41 characters
    assert data.skipped.messages[0] == ("r:1: field 'prompt': has 41 bytes, more than max_prompt_tokens=8 tokens "
                                        "can hold (the tokenizer's longest token is 5 bytes)")
    assert data.skipped.messages[1] == "r:2: field 'prompt': has 9 tokens, more than max_prompt_tokens=8"
    truncated = records.prompts_from_records(rows[:1], spy, max_prompt_tokens=8, long_prompts="left_truncate")
    assert spy.encoded[-1] == 41 and len(truncated.prompt_ids[0]) == 8

    spy = _SpyTokenizer()
    pairs = records.pairs_from_records([("p:1", {"prompt": "1+1=", "chosen": "2" * 16, "rejected": "3"})], spy,
                                       max_response_tokens=3, on_error="skip")
    assert dict(pairs.skipped.counts) == {"too_long": 1} and 16 not in spy.encoded
