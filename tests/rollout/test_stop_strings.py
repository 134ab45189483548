"""Stop strings (`rollout.stop_strings`): the cut token found by binary search is the one a
brute-force scan over every decoded prefix finds, on a real `transformers` BPE tokenizer
(byte-level, so stop strings start and end inside tokens and span several), and `cut`
masks, pads and shortens exactly the tokens after it."""

import numpy as np
import pytest

from jaxrlhf.rollout import SampleOutput, stop_strings

CORPUS = ["The answer is 42.</answer> Question: what is 6*7?\n\nAnswer: 42"] * 20 + ["héllo wörld café"] * 10
STOPS = ("</answer>", "\n\n", "é")  # multi-token, whitespace, a two-byte character


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")


def _brute(tok, ids, stops):
    """The first k whose decoded prefix contains a stop string: every prefix decoded."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        if any(s in text for s in stops):
            return k
    return None


def test_binary_search_finds_the_brute_force_cut(tok):
    texts = ["The answer is 42.</answer> Question", "Answer: 42\n\nQuestion: 6*7?\n\n", "café</answer>",
             "éclair", "no stop here at all", "42.</answ"]
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    rng = np.random.default_rng(0)
    rows += [rng.integers(2, len(tok), 24).tolist() for _ in range(200)]  # random tokens: partial bytes and all
    decode = lambda t: tok.decode(t, skip_special_tokens=True)
    found = [stop_strings.first_stop(decode, ids, STOPS) for ids in rows]
    assert found == [_brute(tok, ids, STOPS) for ids in rows]
    assert found[4] is None and found[5] is None  # none found; a stop string begun but not finished
    assert found[3] == 1  # found at the first token
    # "</answer>" begins inside a token and spans more than one; the cut keeps its last
    ends = {len(decode(rows[0][:j])) for j in range(found[0] + 1)}
    text = decode(rows[0][:found[0]])
    start = text.index("</answer>")
    assert text.endswith("</answer>") and start not in ends and sum(start < e for e in ends) >= 2
    assert sum(k is not None for k in found[6:]) > 20  # the random rows exercise the search too


def test_cut_masks_pads_and_shortens_after_the_stop(tok):
    texts = ["Answer: 42</answer> more", "no stop", "é then more text"]
    p, t, pad = 3, 12, tok.pad_token_id
    ids = np.full((3, t), pad, np.int32)
    mask = np.zeros((3, t), bool)
    for r, text in enumerate(texts):
        row = tok.encode(text, add_special_tokens=False)[:t]
        ids[r, :len(row)], mask[r, :len(row)] = row, True
    prompt = np.ones((3, p), np.int32)
    out = SampleOutput(prompt, np.ones((3, p), bool), ids, mask, np.where(mask, -1.0, 0.0).astype(np.float32),
                       np.concatenate([prompt, ids], 1), np.concatenate([np.ones((3, p), bool), mask], 1),
                       mask.sum(1).astype(np.int32))
    cut = stop_strings.cut(out, tok, STOPS, pad_id=pad)
    decode = lambda t: tok.decode(t, skip_special_tokens=True)
    want = [_brute(tok, ids[r][mask[r]].tolist(), STOPS) or int(mask[r].sum()) for r in range(3)]
    np.testing.assert_array_equal(cut.lengths, want)
    for r in range(3):
        keep = np.arange(t) < want[r]
        np.testing.assert_array_equal(cut.response_mask[r], keep)
        np.testing.assert_array_equal(cut.response_ids[r], np.where(keep, ids[r], pad))
        np.testing.assert_array_equal(cut.logprobs[r], np.where(keep, -1.0, 0.0))
        np.testing.assert_array_equal(cut.sequences[r, p:], cut.response_ids[r])
        np.testing.assert_array_equal(cut.attention_mask[r, p:], keep)
    assert decode(cut.response_ids[0][cut.response_mask[0]]).endswith("</answer>")
    assert decode(cut.response_ids[1][cut.response_mask[1]]) == "no stop"


def test_parse_stop_strings():
    assert stop_strings.parse(r"</answer>,\n\n") == ("</answer>", "\n\n")
    assert stop_strings.parse('["a, b", "c"]') == ("a, b", "c")
    assert stop_strings.parse("") == ()
    with pytest.raises(ValueError, match="task.stop_strings.*empty"):
        stop_strings.parse("a,,b")
    with pytest.raises(ValueError, match="task.stop_strings.*JSON list"):
        stop_strings.parse('["a", 1]')
