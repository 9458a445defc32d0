"""A block's MLP in token chunks (``RunConfig.mlp_chunk_tokens``, ``runtime/mlp_chunks.py``): the
run trains as plain PyTorch does, blocks it cannot run alike are refused at wrap time, and at a
long sequence it fits a device that the MLP in one piece does not."""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import assert_exact, assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import UnsupportedModel

torch.set_num_threads(1)

STEPS = 3


def _exact(model, batch, *, float64: bool = True, **config) -> None:
    plain = reference_train(model, batch, STEPS)
    got = pipeline_train(model, batch, STEPS, **config)
    if float64:
        assert_exact(got, plain, reference_train(copy.deepcopy(model).double(), batch, STEPS))
    else:  # torch's grouped matmul of the experts has no float64: against plain fp32 PyTorch
        assert_same_run(got, plain)


@pytest.mark.parametrize(
    "family, lora, devices, policy",
    [
        ("llama", None, "cpu:2", "roundpipe"),
        ("qwen3", "all-linear", "cpu:2", "1f1b"),
        ("qwen3_moe", None, "cpu:1", "roundpipe"),
    ],
)
def test_an_mlp_in_token_chunks_trains_like_plain_pytorch(family, lora, devices, policy, monkeypatch):
    """6 sequences of 12 tokens per step in 3 microbatches: 24 tokens a microbatch, in chunks of 7
    (the last one short), forward stages without autograd and backward stages under checkpoints."""
    from roundpipe.runtime import mlp_chunks

    checkpointed: list[tuple] = []

    def counted(fn, piece, **kwargs):
        checkpointed.append(tuple(piece.shape))
        return checkpoint(fn, piece, **kwargs)

    checkpoint = mlp_chunks.checkpoint
    monkeypatch.setattr(mlp_chunks, "checkpoint", counted)
    model = make_model(family, lora=lora, num_layers=3)
    batch = make_batch(batch=6, seq=12)
    _exact(
        model,
        batch,
        float64=family != "qwen3_moe",
        devices=devices,
        num_microbatches=3,
        policy=policy,
        mlp_chunk_tokens=7,
    )
    # at least every block's backward, every microbatch and step (and a backward stage's first
    # forward where the policy fuses one into it): chunks of 7, 7, 7 and 3 of the 24 tokens
    assert sorted({shape[:2] for shape in checkpointed}) == [(1, 3), (1, 7)]
    assert len(checkpointed) % 4 == 0 and len(checkpointed) >= STEPS * 3 * 3 * 4


def test_a_block_that_draws_random_numbers_is_refused_with_what_to_change():
    import peft

    model = make_model("llama")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj"], lora_dropout=0.1))
    with pytest.raises(UnsupportedModel, match="lora_dropout.*set them to 0|mlp_chunk_tokens unset"):
        roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", mlp_chunk_tokens=64))


def test_mlp_chunk_tokens_must_be_a_positive_count():
    from roundpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="mlp_chunk_tokens"):
        roundpipe.RunConfig(mlp_chunk_tokens=0)


# ----------------------------------------------------------------------------- a long sequence
LONG = 8192
CAPACITY = 128 << 20


def _long_model():
    """A llama whose MLP is wide against its hidden size (64 -> 1024), as real models are against
    their attention: at 8,192 tokens its MLP intermediates are most of a block's memory."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=2 * LONG,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _long_run(model, batch, chunk, capacity=None) -> tuple[int, int, int]:
    """(live peak, reserved peak, planned peak) bytes of the device in one step."""
    config = dict(devices="cpu:1", num_microbatches=1, policy="roundpipe", partition=None)
    conf = roundpipe.RunConfig(**config, mlp_chunk_tokens=chunk, device_capacity=capacity)
    with roundpipe.wrap(copy.deepcopy(model), conf) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
        d = pipe.stats()["devices"][0]
        shape = tuple(batch["input_ids"].shape)
        planned = pipe._planner.planned_peaks(pipe.last_plan.table, 1, shape)[0].nbytes
        return d["peak_bytes"], d["reserved_peak_bytes"], planned


def test_at_8k_tokens_an_mlp_in_chunks_fits_a_device_the_mlp_in_one_piece_runs_out_of():
    """One sequence of 8,192 tokens, one layer per stage on one 128 MiB device. In one piece the
    MLP's intermediates take the device's live peak over its capacity (measured without a limit),
    and with the limit the run is refused before it starts; in chunks of 1,024 tokens the same run
    fits, its live peak within the plan's figure (the cost model the memory guard checks), and
    trains like plain PyTorch."""
    from roundpipe.errors import RoundpipeError

    model = _long_model()
    ids = torch.randint(0, 256, (1, LONG), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    whole, whole_reserved, whole_planned = _long_run(model, batch, None)
    assert whole > CAPACITY and whole_planned > CAPACITY, (whole, whole_planned)
    with pytest.raises(RoundpipeError, match="memory|MiB|GiB"):
        _long_run(model, batch, None, CAPACITY)

    live, reserved, planned = _long_run(model, batch, 1024, CAPACITY)
    print(
        f"MLP in one piece: live peak {whole / 2**20:.1f} MiB, reserved {whole_reserved / 2**20:.1f}, planned "
        f"{whole_planned / 2**20:.1f}; in chunks of 1,024 tokens: live peak {live / 2**20:.1f} MiB, reserved "
        f"{reserved / 2**20:.1f}, planned {planned / 2**20:.1f}; capacity {CAPACITY / 2**20:.0f} MiB"
    )
    assert live <= planned < CAPACITY and reserved <= CAPACITY
    assert live < whole / 3
    _exact(
        model,
        batch,
        float64=True,
        devices="cpu:1",
        num_microbatches=1,
        mlp_chunk_tokens=1024,
        device_capacity=CAPACITY,
    )


def test_an_mlp_called_with_more_than_hidden_states_is_refused_not_run_whole():
    """Running such an MLP in one piece would leave the plan's memory figure wrong without a word."""
    from torch import nn

    from roundpipe.runtime.mlp_chunks import chunked_mlp

    class Scaled(nn.Module):
        def forward(self, h, scale=1.0):
            return h * scale

    block = nn.Module()
    block.mlp = Scaled()
    h = torch.ones(2, 8, 4)
    with chunked_mlp(block, 4):
        torch.testing.assert_close(block.mlp(h), h)  # one tensor: chunked, the same numbers
        with pytest.raises(
            UnsupportedModel, match="mlp_chunk_tokens=4: Scaled is called with other arguments"
        ):
            block.mlp(h, scale=2.0)
    torch.testing.assert_close(block.mlp(h, scale=2.0), 2 * h)  # the class's forward again after the block
