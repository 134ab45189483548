"""Data: the built-in arithmetic task, padding and batching, JSONL/Parquet/TFDS readers, rewards.

    from jaxrlhf import data
    task = data.AdditionTask(num_digits=2, reverse_answer=True)
    train = data.sft_arrays(task, data.make_problems(task, 5000, split="train", seed=0))
    it = data.BatchIterator(5000, 64, seed=0)      # it.position goes into checkpoints
    idx = next(it)
    batch = {k: v[idx] for k, v in train.items()}  # tokens, input_mask, loss_mask, ...

`data.read_mixture` reads a task's rows from a spec of files and TFDS datasets mixed by
weight (`data.sources`); `data.chat` locates the assistant turns in a chat template's text.
`data.tfds` (TensorFlow Datasets) is not imported here: import `jaxrlhf.data.tfds` to use it.
"""

from jaxrlhf.data.arithmetic import (
    AdditionTask,
    PreferencePairs,
    Problems,
    format_answer,
    format_prompt,
    is_held_out,
    make_preference_pairs,
    make_problems,
    parse_answer,
    preference_arrays,
    rl_arrays,
    sft_arrays,
)
from jaxrlhf.data.batching import (
    BatchIterator,
    epoch_permutation,
    eval_batches,
    left_pad,
    preference_batch,
    prompt_response_batch,
    right_pad,
    sft_batch,
)
from jaxrlhf.data.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, CharTokenizer
from jaxrlhf.data.jsonl import read_preference_pairs, read_prompts, read_records
from jaxrlhf.data.records import (
    DataError,
    PairData,
    PromptData,
    SFTData,
    SkipReport,
    pairs_from_records,
    prompts_from_records,
    sft_from_records,
)
from jaxrlhf.data.sources import parse_spec, read_mixture
from jaxrlhf.data.token_rewards import exact_match, exact_match_reward, token_match_fraction, token_match_reward
from jaxrlhf.data.text_rewards import (
    answer_format_reward,
    decode_responses,
    exact_match_text,
    extract_final_answer,
    final_answer_reward,
    normalize_number,
)
from jaxrlhf.data.word_problems import make_word_problems

__all__ = [
    "AdditionTask", "PreferencePairs", "Problems", "format_answer", "format_prompt", "is_held_out",
    "make_preference_pairs", "make_problems", "parse_answer", "preference_arrays", "rl_arrays",
    "sft_arrays",
    "BatchIterator", "epoch_permutation", "eval_batches", "left_pad", "preference_batch",
    "prompt_response_batch", "right_pad", "sft_batch",
    "BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "CharTokenizer",
    "read_preference_pairs", "read_prompts", "read_records",
    "DataError", "PairData", "PromptData", "SFTData", "SkipReport", "pairs_from_records", "prompts_from_records",
    "sft_from_records", "parse_spec", "read_mixture",
    "exact_match", "exact_match_reward", "token_match_fraction", "token_match_reward",
    "answer_format_reward", "decode_responses", "exact_match_text", "extract_final_answer", "final_answer_reward",
    "normalize_number", "make_word_problems",
]
