"""AdamW's moments kept in bf16 or 8-bit blocks on the host (``OptimizerConfig.state_dtype``,
``optim/low_precision_state.py``): the numerical contract against fp32 state, bitsandbytes' 8-bit
format, exact resume through a checkpoint, the host bytes the planner counts, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError
from roundpipe.optim.low_precision_state import STATE_BLOCK, _decode, _encode

torch.set_num_threads(1)

STEPS = 20
# The contract: after STEPS steps the weights are within this share of the distance the fp32-state
# run moved them from the start (measured: 0.22% for bf16, 2.8% for int8).
CONTRACT = {"bf16": 0.01, "int8": 0.05}


def _train(model, batch, steps: int, state_dtype: str, pipe_state=None):
    """``model`` (a copy) trained ``steps`` steps; returns its parameters and the pipeline's state."""
    model = copy.deepcopy(model)
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=2)) as pipe:
        pipe.configure_optimizer(lr=1e-3, weight_decay=0.01, state_dtype=state_dtype)
        if pipe_state is not None:
            pipe.load_state_dict(pipe_state)
        for _ in range(steps):
            pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
            pipe.step()
        pipe.export_to(model)
        state = pipe.state_dict()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _distance(a: dict, b: dict) -> float:
    return float(sum((a[n].double() - b[n].double()).norm() ** 2 for n in a) ** 0.5)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_low_precision_moments_stay_within_the_contract_of_fp32_adamw(state_dtype):
    """Full fine-tuning of a tiny Llama, 20 AdamW steps (weight decay on): the weights end within
    ``CONTRACT`` of the distance the fp32-state run moved them, and nearer to it than to the start."""
    model = make_model("llama", num_layers=2)
    batch = make_batch(batch=4, seq=10)
    start = {n: p.detach() for n, p in model.named_parameters()}
    fp32, _ = _train(model, batch, STEPS, "fp32")
    low, state = _train(model, batch, STEPS, state_dtype)
    moved = _distance(fp32, start)
    off = _distance(low, fp32)
    print(f"{state_dtype}: {off / moved:.4f} of the fp32-state run's distance moved")
    assert off <= CONTRACT[state_dtype] * moved
    stored = next(iter(state["optimizer"]["state"].values()))
    assert stored["exp_avg"].dtype == (torch.bfloat16 if state_dtype == "bf16" else torch.uint8)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_run_resumed_from_a_checkpoint_continues_bit_for_bit(state_dtype, tmp_path):
    """3 steps, a checkpoint written and read back (the stored codes as they are), 3 more: the
    same weights and moments as 6 steps in one go."""
    from roundpipe.train.checkpoint import CheckpointManager

    model = make_model("qwen3", num_layers=2)
    batch = make_batch(batch=4, seq=10)
    whole, whole_state = _train(model, batch, 6, state_dtype)
    half, half_state = _train(model, batch, 3, state_dtype)
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, half_state)
    _, loaded, _ = manager.load(path)
    start = copy.deepcopy(model)
    with torch.no_grad():  # the masters of step 3 are in the state; the model's own weights too
        for n, p in start.named_parameters():
            p.copy_(half[n])
    resumed, resumed_state = _train(start, batch, 3, state_dtype, pipe_state=loaded)
    for n in whole:
        assert torch.equal(resumed[n], whole[n]), n
    for name, st in whole_state["optimizer"]["state"].items():
        for key, value in st.items():
            got = resumed_state["optimizer"]["state"][name][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, (name, key)


def test_the_8bit_state_is_bitsandbytes_blockwise_format():
    """A moment's codes index bitsandbytes' dynamic map (signed for the first moment, unsigned for
    the second) in blocks of 256 with an fp32 absmax, as its blockwise quantizer writes them."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    for signed, x in ((True, torch.randn(3, 300) * 1e-3), (False, torch.rand(3, 300) * 1e-6)):
        st = {
            "m": torch.zeros(x.numel(), dtype=torch.uint8),
            "m_absmax": torch.zeros(-(-x.numel() // STATE_BLOCK)),
        }
        _encode(x.reshape(-1), st, "m", "int8", signed, 0, x.numel())
        code = bnb.create_dynamic_map(signed=signed)
        _, state = bnb.quantize_blockwise(x, code=code, blocksize=STATE_BLOCK)
        assert torch.equal(st["m_absmax"], state.absmax)
        back = torch.empty(x.numel())
        _decode(st, "m", "int8", signed, 0, x.numel(), back)
        back = back.view(x.shape)
        # each value decodes to the nearest code of its block: within half the largest gap
        scale = state.absmax.repeat_interleave(STATE_BLOCK)[: x.numel()].view(x.shape)
        gaps = (code[1:] - code[:-1]).max()
        assert ((back - x).abs() <= scale * gaps / 2 + 1e-12).all()


def test_an_unknown_state_dtype_is_refused_naming_the_choices():
    pipe = roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:1"))
    with pipe, pytest.raises(ConfigError, match="fp32, bf16, int8"):
        pipe.configure_optimizer(lr=1e-3, state_dtype="fp16")


def test_the_planner_counts_the_moments_in_their_bytes():
    """Qwen3-32B full fine-tuning: the model state on the host with bf16 and int8 moments against
    fp32's (master + moments + gradient + the bf16 copy the GPUs read)."""
    from roundpipe.partition.cost import model_costs, model_totals
    from roundpipe.presets import load_model_config

    config = load_model_config("qwen3-32b")
    host = {
        s: model_totals(model_costs(config, 4096, dtype="bf16", optimizer_state=s))["host_bytes"]
        for s in ("fp32", "bf16", "int8")
    }
    params = model_totals(model_costs(config, 4096, dtype="bf16"))["params"]
    assert host["fp32"] - host["bf16"] == pytest.approx(4 * params, rel=1e-6)
    assert host["fp32"] - host["int8"] == pytest.approx((6 - 8 / STATE_BLOCK) * params, rel=1e-3)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_step_in_chunks_is_the_step_in_one_piece(state_dtype, monkeypatch):
    """A parameter larger than a chunk (and not a whole number of blocks) steps chunk by chunk to
    the same weights and moments, bit for bit, as in one piece."""
    from roundpipe.optim import low_precision_state
    from roundpipe.optim.low_precision_state import LowPrecisionStateAdamW

    def run(chunk: int):
        monkeypatch.setattr(low_precision_state, "CHUNK", chunk)
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(3, 1000))
        opt = LowPrecisionStateAdamW([p], state_dtype=state_dtype, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            p.grad = torch.randn_like(p) * 1e-2
            opt.step()
        return p.detach().clone(), opt.state[p]

    whole, whole_state = run(1 << 20)
    pieces, pieces_state = run(4 * STATE_BLOCK)
    assert torch.equal(whole, pieces)
    assert all(torch.equal(whole_state[k], pieces_state[k]) for k in whole_state)
