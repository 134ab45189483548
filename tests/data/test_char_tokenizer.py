"""The character tokenizer, and its Hugging Face export round trip."""

import numpy as np
import pytest
import transformers

from jaxrlhf.data.char_tokenizer import ARITHMETIC_CHARS, BOS_ID, EOS_ID, PAD_ID, CharTokenizer


def test_special_ids_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    ids = tok.encode("37+58=", add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and len(ids) == 8
    assert tok.decode(ids) == "37+58="
    assert tok.decode([7, EOS_ID, 8]) == "3"  # nothing after EOS
    assert tok.decode([PAD_ID, 7], skip_special_tokens=False) == "<pad>3"
    with pytest.raises(ValueError, match="'x' is not in the vocabulary"):
        tok.encode("3x")


def test_hf_export_round_trips_exactly(tmp_path):
    tok = CharTokenizer()
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert len(hf) == tok.vocab_size
    rng = np.random.default_rng(0)
    texts = ["", " ", "37+58=", "  1 2  "] + [
        "".join(rng.choice(list(ARITHMETIC_CHARS), size=rng.integers(1, 12))) for _ in range(30)]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf(text)["input_ids"] == [BOS_ID] + ids
        assert hf.decode(ids) == text
        assert hf.decode([BOS_ID] + ids + [EOS_ID, PAD_ID], skip_special_tokens=True) == text
