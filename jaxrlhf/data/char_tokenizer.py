"""A character-level tokenizer for the built-in synthetic tasks, exportable to Hugging Face.

Special ids are fixed: pad = 0, bos = 1, eos = 2, unk = 3; every other id is one character.
The same vocabulary can be written as a `transformers` tokenizer folder, so that models and
checkpoints trained on the synthetic task load through `AutoTokenizer` like any other.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Sequence

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Digits and the operators of the arithmetic task; a space so that free text round-trips.
ARITHMETIC_CHARS = "0123456789+-*=() "


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """One token per character, plus the four special tokens at ids 0..3.

    `encode` is strict: an unknown character raises (the HF export maps it to `<unk>`
    instead, as HF tokenizers do), because a silent `<unk>` in synthetic data is a bug.
    """

    chars: str = ARITHMETIC_CHARS

    pad_id: int = dataclasses.field(default=PAD_ID, init=False)
    bos_id: int = dataclasses.field(default=BOS_ID, init=False)
    eos_id: int = dataclasses.field(default=EOS_ID, init=False)
    unk_id: int = dataclasses.field(default=UNK_ID, init=False)

    def __post_init__(self):
        if len(set(self.chars)) != len(self.chars):
            raise ValueError(f"duplicate characters in {self.chars!r}")

    @property
    def vocab(self) -> dict[str, int]:
        """Token string -> id, special tokens first."""
        tokens = list(SPECIAL_TOKENS) + list(self.chars)
        return {t: i for i, t in enumerate(tokens)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.chars)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text -> ids; raises ValueError on a character outside the vocabulary."""
        offset = len(SPECIAL_TOKENS)
        index = {c: i + offset for i, c in enumerate(self.chars)}
        try:
            ids = [index[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {self.chars!r}") from None
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True, skip_special_tokens: bool = True) -> str:
        """Ids -> text; with `stop_at_eos`, nothing from the first EOS on.

        Special tokens are dropped unless `skip_special_tokens=False` (then written as
        "<pad>", ..., as the HF export does).
        """
        offset = len(SPECIAL_TOKENS)
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID and stop_at_eos:
                break
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the vocabulary (size {self.vocab_size})")
            if i >= offset:
                out.append(self.chars[i - offset])
            elif not skip_special_tokens:
                out.append(SPECIAL_TOKENS[i])
        return "".join(out)

    def decode_batch(self, ids_BxT: Sequence[Sequence[int]], *, stop_at_eos: bool = True) -> list[str]:
        return [self.decode(row, stop_at_eos=stop_at_eos) for row in ids_BxT]

    def to_hf(self):
        """The same vocabulary as a `transformers.PreTrainedTokenizerFast`.

        `hf(text)["input_ids"]` starts with BOS (like Llama's tokenizer); with
        `add_special_tokens=False` it equals `self.encode(text)`.
        """
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=self.vocab, unk_token=UNK_TOKEN))
        # Every character is its own pre-token, spaces included; Fuse joins them back without
        # the separating spaces that WordLevel decoding would otherwise insert.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.post_processor = processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, BOS_ID)])
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        return PreTrainedTokenizerFast(
                tokenizer_object=tok, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                unk_token=UNK_TOKEN, padding_side="left", clean_up_tokenization_spaces=False)

    def save_pretrained(self, directory: str | os.PathLike) -> str:
        """Writes a folder that `transformers.AutoTokenizer.from_pretrained` loads."""
        self.to_hf().save_pretrained(os.fspath(directory))
        return os.fspath(directory)
