"""The test stand-in's copy of Kimi-K2.5's remote-code tokenizer: `TikTokenTokenizer` on transformers' Python backend.

Shaped like the one Kimi-K2.5 ships (tests/kimi_standin.py copies it into the model folder as
`tokenization_kimi.py`, named by `auto_map`): byte-level BPE ranks in `tiktoken.model`, a fixed block of
reserved special tokens right after them, named from `added_tokens_decoder`, and an `encode` that goes to
tiktoken directly unless called with keyword arguments. Like the original it is a "slow" tokenizer, so
`return_offsets_mapping` gives no `offset_mapping`: nothing in the pipeline may rely on character offsets.
"""

from __future__ import annotations

import os
from pathlib import Path
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

# Where Kimi's current file takes GPT-2's byte spelling from; its older revision imported it from
# transformers.models.gpt2.tokenization_gpt2, which transformers 5 removed (docs/engines.md).
from transformers.convert_slow_tokenizer import bytes_to_unicode

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    # Kimi-K2.5 reserves 256 ids after its 163,584 ranks; the stand-in reserves 17, SmolLM2's own number of
    # special tokens, so the vocabulary keeps SmolLM2's 49,152 ids.
    num_reserved_special_tokens = 17
    # The split the ranks were learned with (GPT-2's, which SmolLM2 uses).
    pat_str = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(vocab_file)
        names = {int(i): str(token) for i, token in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        self.unk_id = self.special_tokens.get(str(unk_token))
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.decoder = {i: "".join(self.byte_encoder[b] for b in self.model.decode_single_token_bytes(i)) for i in range(self.n_words)}
        self.encoder = {token: i for i, token in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, **kwargs)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs) -> list[int]:
        # Kimi's own shortcut: plain calls go to tiktoken (special tokens recognised in the text); calls
        # with transformers' arguments (add_special_tokens, return_tensors, ...) take the generic path.
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids, **kwargs) -> str:
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            copyfile(self.vocab_file, target)
        return (target,)
