"""What transformers' SDPA mask builder reads off a padding mask, told from the host copy instead.

``transformers.masking_utils.sdpa_mask`` leaves the causal mask to SDPA's ``is_causal`` when no
token is padded, and to find out it reads the padding mask's values on its device
(``_ignore_causal_mask_sdpa``: ``padding_mask.sum() == padding_mask.numel()``, turned into a Python
bool). On a GPU that is a host sync: the worker thread waits until its stream has run everything it
issued, twice per microbatch context, and the GPU idles while the worker then issues the next
task. roundpipe has every microbatch's attention mask on the host before it uploads it, so it knows
the answer without asking the device.

:func:`padding_known` tells it: inside the block, on the calling thread, the mask builder's
decisions for a training forward (as many queries as keys, no cache, no offsets) are taken from
``all_ones`` and equal what transformers would decide from the values; every other call goes to
transformers' own function. The wrappers are installed into ``transformers.masking_utils`` once, on
first use, and change nothing outside such a block.

Without an attention mask, transformers looks for packed sequences instead: position ids that
restart inside a row (``find_packed_sequence_indices``), and reads on the device whether any row
has more than one sequence. The host copy of the position ids answers that too (``MaskFacts``).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_facts = threading.local()
_install_lock = threading.Lock()


@dataclass(frozen=True)
class MaskFacts:
    """What the mask builders would read off a microbatch's device tensors, known on the host."""

    all_ones: bool  # no token is padded (no attention mask: none is)
    packed: bool  # some row's position ids restart: several sequences packed in it


@contextmanager
def padding_known(facts: MaskFacts | None):
    """Inside, the mask builders take "no token is padded" and "no row is packed" from ``facts``
    (None: they read the device tensors themselves, as usual)."""
    _install()
    previous = getattr(_facts, "known", None)
    _facts.known = facts
    try:
        yield
    finally:
        _facts.known = previous


def host_facts(attention_mask, position_ids) -> MaskFacts:
    """The facts of a microbatch from its host copies of the attention mask and position ids."""
    all_ones = attention_mask is None or bool(attention_mask.bool().all())
    return MaskFacts(
        all_ones=all_ones,
        packed=position_ids is not None and bool(_sequence_index(position_ids)[:, -1].any()),
    )


def _sequence_index(position_ids):
    """transformers' rule (``find_packed_sequence_indices``): a new sequence starts wherever the
    position does not follow the one before it; per token, how many have started in its row."""
    start = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=start, dim=-1) != 1).cumsum(-1)


def _known(padding_mask, q_length, kv_length, q_offset, kv_offset) -> bool | None:
    """The host's answer when this is a training forward's mask and one was given, else None."""
    known = getattr(_facts, "known", None)
    all_ones = None if known is None else known.all_ones
    if all_ones is None or padding_mask is None or q_length != kv_length:
        return None
    if not (type(q_offset) is int and type(kv_offset) is int and q_offset == kv_offset == 0):
        return None
    return all_ones if padding_mask.shape[-1] == kv_length else None


def _install() -> None:
    from transformers import masking_utils

    with _install_lock:
        causal = masking_utils._ignore_causal_mask_sdpa
        if not getattr(causal, "_roundpipe", False):
            masking_utils._ignore_causal_mask_sdpa = _causal_wrapper(causal)
        bidirectional = getattr(masking_utils, "_ignore_bidirectional_mask_sdpa", None)
        if bidirectional is not None and not getattr(bidirectional, "_roundpipe", False):
            masking_utils._ignore_bidirectional_mask_sdpa = _bidirectional_wrapper(bidirectional)
        packed = getattr(masking_utils, "find_packed_sequence_indices", None)
        if packed is not None and not getattr(packed, "_roundpipe", False):
            masking_utils.find_packed_sequence_indices = _packed_wrapper(packed)


def _mark(wrapper):
    """Tag ``wrapper`` as ours (read back with ``getattr(f, "_roundpipe", False)``), so that
    installing twice wraps once."""
    wrapper.__dict__["_roundpipe"] = True
    return wrapper


def _causal_wrapper(original):
    @functools.wraps(original)
    def ignore_causal_mask_sdpa(
        padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None
    ):
        all_ones = _known(padding_mask, q_length, kv_length, q_offset, kv_offset)
        if all_ones is None:
            return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
        # transformers: no special pattern for a local window the keys reach; else as many queries
        # as keys and nothing padded (or, from offset 0, nothing padded among the queries and
        # nothing after them: the same thing when queries and keys are the same tokens).
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False
        return all_ones

    return _mark(ignore_causal_mask_sdpa)


def _bidirectional_wrapper(original):
    from transformers import masking_utils

    @functools.wraps(original)
    def ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        all_ones = _known(padding_mask, kv_length, kv_length, 0, 0)
        if all_ones is None or getattr(masking_utils, "_is_torch_xpu_available", False):
            return original(padding_mask, kv_length, local_attention_size)
        return all_ones and (local_attention_size is None or kv_length < local_attention_size)

    return _mark(ignore_bidirectional_mask_sdpa)


def _packed_wrapper(original):
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids):
        known = getattr(_facts, "known", None)
        if known is None:
            return original(position_ids)
        # transformers: None when every row holds one sequence, else each token's sequence index
        return _sequence_index(position_ids) if known.packed else None

    return _mark(find_packed_sequence_indices)
