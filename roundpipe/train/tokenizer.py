"""Tokenizers for training: the model directory's own, or a built-in byte-level one.

``load_tokenizer`` turns the recipe's ``model:`` section into a Hugging Face tokenizer. It only
reads local directories (a recipe never reaches the Hub), and it guarantees a pad token, because
``roundpipe.train.batches`` pads every batch. ``byte_tokenizer`` needs no files at all: each UTF-8
byte is one token, which is what a ``config:`` model with random weights trains on in demos and
tests.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from roundpipe.errors import RecipeError
from roundpipe.train.config import ModelConfig

BYTE_VOCAB_SIZE = 259
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258

# Role headers are plain bytes; an assistant turn ends with the eos token, so a model trained on
# chats learns to stop there, and roundpipe.train.data finds that eos inside the answer. Other turns
# end with a newline, written as an expression: transformers renders templates with trim_blocks,
# which drops a literal newline right after a block tag.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to the printable character the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in byte-level tokenizer: 259 ids and no merges.

    Ids 0..255 are the bytes of the UTF-8 encoding (id ``b`` is byte ``b``), then ``<pad>`` = 256,
    ``<s>`` = 257 (bos) and ``</s>`` = 258 (eos). Encoding with special tokens prepends bos; no
    eos is added (``roundpipe.train.data`` appends it where a sample ends). ``decode(ids,
    skip_special_tokens=True)`` gives back the text exactly, non-ASCII included. It carries
    ``BYTE_CHAT_TEMPLATE``, so the chat format works with it, and ``save_pretrained`` writes a
    directory that ``AutoTokenizer.from_pretrained`` loads back.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<pad>", "<s>", "</s>"])
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=BYTE_CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, len(tokenizer))
    if ids != (PAD_ID, BOS_ID, EOS_ID, BYTE_VOCAB_SIZE):  # a tokenizers release that numbers differently
        raise RuntimeError(
            f"byte tokenizer built with pad, bos, eos, size = {ids}, expected 256, 257, 258, 259"
        )
    return tokenizer


def load_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer a run trains with, always with a pad token.

    ``model.tokenizer == "byte"``, or no tokenizer named for a ``config:`` model, gives
    ``byte_tokenizer()``. Otherwise the tokenizer is read from the local directory
    ``model.tokenizer`` (else ``model.path``) with ``AutoTokenizer``, never from the Hub. A
    tokenizer without a pad token pads with its eos token (``roundpipe.train.batches`` masks padding
    by position, so eos labels are kept).

    Raises:
        RecipeError: no tokenizer is named, the directory does not exist or holds no tokenizer, or
            the tokenizer has neither a pad nor an eos token. The message says which key to set.
    """
    if model.tokenizer == "byte" or (model.tokenizer is None and model.config is not None):
        return byte_tokenizer()
    source = model.tokenizer or model.path
    key = "model.tokenizer" if model.tokenizer else "model.path"
    if source is None:
        raise RecipeError("no tokenizer to load: set model.tokenizer to a tokenizer directory, or to `byte`")
    if not os.path.isdir(source):
        raise RecipeError(
            f"{key}: {source!r} is not a directory. roundpipe reads tokenizers from local directories "
            f"only: download it first (e.g. `hf download NAME --local-dir DIR`), or set model.tokenizer: byte"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=model.trust_remote_code, local_files_only=True
        )
    except Exception as error:
        hint = (
            " If the directory holds its own tokenizer code, set model.trust_remote_code: true."
            if "trust_remote_code" in str(error)
            else ""
        )
        raise RecipeError(
            f"{key}: cannot load a tokenizer from {source!r} ({type(error).__name__}: {error}). It needs "
            f"tokenizer.json or the tokenizer files of its model family; set model.tokenizer to another "
            f"directory, or to `byte`.{hint}"
        ) from error
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise RecipeError(
                f"the tokenizer in {source!r} has neither a pad nor an eos token, and batches need one to "
                f"pad with: add `pad_token` to its tokenizer_config.json, or set model.tokenizer: byte"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
