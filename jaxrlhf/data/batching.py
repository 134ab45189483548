"""Padding ragged token lists into fixed-shape numpy batches, and a resumable shuffled reader.

Layout (docs/concepts.md#shapes-masks-and-the-one-shift): prompts LEFT-padded to P, so
every prompt ends at column P - 1 and generation continues from the same column for the
whole batch; responses RIGHT-padded to T, so valid response tokens are a contiguous prefix.
Ids are int32, masks bool (1 = real token). Fixed P and T keep one compiled program for
every batch.

`BatchIterator` yields the example indices of this process's share of each global batch;
its `position` ({"epoch", "index"}) goes into a checkpoint and restores the stream exactly.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np

from jaxrlhf.data.char_tokenizer import EOS_ID, PAD_ID

Seqs = Sequence[Sequence[int]]


def _check_fit(seqs: Seqs, length: int, truncate: bool, what: str) -> None:
    if truncate:
        return
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(
                f"{what} {i} has {len(s)} tokens, more than the padded length {length} "
                f"(raise the length, filter the data, or pass truncate=True)")


def left_pad(seqs: Seqs, length: int, *, pad_id: int = PAD_ID, truncate: bool = False):
    """(ids_BxP int32, mask_BxP bool): each sequence right-aligned in `length` columns.

    With `truncate`, an overlong sequence keeps its LAST `length` tokens (the end of a
    prompt is what the response continues); otherwise it raises.
    """
    _check_fit(seqs, length, truncate, "prompt")
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), bool)
    for i, s in enumerate(seqs):
        s = list(s)[len(s) - length:] if len(s) > length else list(s)
        if s:
            ids[i, length - len(s):] = s
            mask[i, length - len(s):] = True
    return ids, mask


def right_pad(
    seqs: Seqs, length: int, *, pad_id: int = PAD_ID, append_id: int | None = None, truncate: bool = False
):
    """(ids_BxT int32, mask_BxT bool): each sequence left-aligned, `append_id` (e.g. EOS)
    added after it. With `truncate`, an overlong sequence keeps its FIRST `length` tokens
    (so a cut response loses its EOS, as a truncated generation does); otherwise it raises."""
    seqs = [list(s) + ([append_id] if append_id is not None else []) for s in seqs]
    _check_fit(seqs, length, truncate, "response")
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), bool)
    for i, s in enumerate(seqs):
        s = s[:length]
        ids[i, : len(s)] = s
        mask[i, : len(s)] = True
    return ids, mask


def prompt_response_batch(
    prompts: Seqs,
    responses: Seqs,
    *,
    prompt_len: int,
    response_len: int,
    pad_id: int = PAD_ID,
    eos_id: int | None = EOS_ID,
    truncate: bool = False,
) -> dict[str, np.ndarray]:
    """{prompt_ids, prompt_mask: [B, P]; response_ids, response_mask: [B, T]}.

    `eos_id` is appended to every response (pass None if the responses already end in it).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    prompt_ids, prompt_mask = left_pad(prompts, prompt_len, pad_id=pad_id, truncate=truncate)
    response_ids, response_mask = right_pad(
        responses, response_len, pad_id=pad_id, append_id=eos_id, truncate=truncate)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                response_ids=response_ids, response_mask=response_mask)


def sft_batch(
    prompts: Seqs,
    answers: Seqs,
    *,
    prompt_len: int,
    response_len: int,
    pad_id: int = PAD_ID,
    eos_id: int | None = EOS_ID,
    truncate: bool = False,
    response_loss: Seqs | None = None,
) -> dict[str, np.ndarray]:
    """`prompt_response_batch` with response = answer ⧺ EOS, plus the joined sequence:

      tokens_BxL, input_mask_BxL: prompt ⧺ response, L = P + T (real tokens contiguous);
      loss_mask_BxL: True exactly on response tokens (EOS included), never on the prompt;
        with `response_loss` (one 0/1 flag per answer token, e.g. a chat's assistant turns
        only, `eos_id=None`) only on the flagged ones.

    The loss at position i predicts tokens[:, i] from logits at i - 1: apply
    `loss_mask[:, 1:]` to the logits `[:, :-1]`.
    """
    batch = prompt_response_batch(
        prompts, answers, prompt_len=prompt_len, response_len=response_len, pad_id=pad_id,
        eos_id=eos_id, truncate=truncate)
    batch["tokens"] = np.concatenate([batch["prompt_ids"], batch["response_ids"]], axis=1)
    batch["input_mask"] = np.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
    loss_BxT = batch["response_mask"]
    if response_loss is not None:
        loss_BxT = loss_BxT & right_pad(response_loss, response_len, pad_id=0, truncate=truncate)[0].astype(bool)
    batch["loss_mask"] = np.concatenate([np.zeros_like(batch["prompt_mask"]), loss_BxT], axis=1)
    return batch


def preference_batch(
    prompts: Seqs,
    chosen: Seqs,
    rejected: Seqs,
    *,
    prompt_len: int,
    response_len: int,
    pad_id: int = PAD_ID,
    eos_id: int | None = EOS_ID,
    truncate: bool = False,
) -> dict[str, np.ndarray]:
    """{prompt_ids, prompt_mask: [B, P]; chosen_ids, chosen_mask, rejected_ids, rejected_mask: [B, T]}.

    EOS is appended to both responses, so the reward model's last valid token is EOS for each.
    """
    if not len(prompts) == len(chosen) == len(rejected):
        raise ValueError(f"{len(prompts)} prompts, {len(chosen)} chosen, {len(rejected)} rejected")
    prompt_ids, prompt_mask = left_pad(prompts, prompt_len, pad_id=pad_id, truncate=truncate)
    out = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask)
    for name, seqs in (("chosen", chosen), ("rejected", rejected)):
        out[f"{name}_ids"], out[f"{name}_mask"] = right_pad(
            seqs, response_len, pad_id=pad_id, append_id=eos_id, truncate=truncate)
    return out


def epoch_permutation(num_examples: int, *, seed: int, epoch: int) -> np.ndarray:
    """[N] int64: the order of epoch `epoch`; a pure function of (N, seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class BatchIterator:
    """Endless shuffled batches of example indices, this process's share only.

    Each step takes the next `batch_size * process_count` entries of the epoch's
    permutation (the global batch); process p gets the p-th contiguous slice of
    `batch_size`. So the processes' shares of every global batch are disjoint and together
    cover it, and over an epoch they cover all examples but the last
    `N mod (batch_size * process_count)`, which are dropped to keep shapes fixed (a new
    permutation next epoch reaches them). The state is the pair `position`:
    `{"epoch": e, "index": i}`, i = entries of epoch e's permutation already consumed.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        position: Mapping[str, int] | None = None,
    ):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.global_batch_size = batch_size * process_count
        if num_examples < self.global_batch_size:
            raise ValueError(
                f"{num_examples} examples cannot fill one global batch of {self.global_batch_size}")
        self._epoch, self._index, self._perm = 0, 0, None
        if position is not None:
            self.restore(position)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch_size

    @property
    def position(self) -> dict[str, int]:
        """Where the next batch starts; save it in a checkpoint, pass it to `restore`."""
        return {"epoch": self._epoch, "index": self._index}

    def restore(self, position: Mapping[str, int]) -> None:
        if set(position) != {"epoch", "index"}:
            raise ValueError(f"position must have exactly the keys epoch, index; got {sorted(position)}")
        epoch, index = int(position["epoch"]), int(position["index"])
        if epoch < 0 or not 0 <= index <= self.num_examples:
            raise ValueError(f"invalid position {dict(position)} for {self.num_examples} examples")
        self._epoch, self._index, self._perm = epoch, index, None

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        """[batch_size] int64 example indices."""
        if self._index + self.global_batch_size > self.steps_per_epoch * self.global_batch_size:
            self._epoch, self._index, self._perm = self._epoch + 1, 0, None
        if self._perm is None:
            self._perm = epoch_permutation(self.num_examples, seed=self.seed, epoch=self._epoch)
        start = self._index + self.process_index * self.batch_size
        self._index += self.global_batch_size
        return self._perm[start:start + self.batch_size]


def eval_batches(
    num_examples: int, batch_size: int, *, process_index: int = 0, process_count: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every example exactly once, in order: yields (indices [batch_size], valid [batch_size]).

    The tail is padded with index 0 and valid=False so every batch has the same shape and
    every process runs the same number of steps (as multi-host SPMD requires); weight
    metrics by `valid`.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    global_batch = batch_size * process_count
    for start in range(0, num_examples, global_batch):
        idx = start + process_index * batch_size + np.arange(batch_size)
        valid = idx < num_examples
        yield np.where(valid, idx, 0), valid
