"""The optimizer is ``torch.optim.AdamW``, parameter by parameter, for every option it takes.

``torch.optim.AdamW`` skips a parameter whose ``.grad`` is None: no weight decay, no moment update,
no step count. Autograd leaves ``.grad`` None when the parameter is not in the step's graph (a
LoRA on Mamba's ``dt_proj``, whose weight the mixer reads directly; a parameter some batches do
not use); a gradient that is exactly zero is still a gradient. These tests train such models with
roundpipe and with plain PyTorch + ``torch.optim.AdamW`` (weight decay on), and compare losses,
weights and the optimizer's state (step counts, moments) parameter by parameter.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.reference import RunResult, assert_exact, trainable_weights
from support.tiny_models import make_batch, make_model, place_flag_token, with_flag_token
from torch import nn

import roundpipe
from roundpipe.errors import ConfigError

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# Non-default on purpose: every option configure_optimizer takes differs from its default.
ADAMW = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1)


class ScaledOnEvenLengths(nn.Module):
    """An MLP whose output a trainable per-channel ``scale`` multiplies only for sequences of even
    length: on a batch of odd length ``scale`` is not in the graph and autograd leaves its
    ``.grad`` None. (The length is the same in every microbatch of a batch without padding.)"""

    def __init__(self, mlp: nn.Module, hidden: int):
        super().__init__()
        self.mlp = mlp
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        y = self.mlp(x)
        return y * self.scale if x.shape[1] % 2 == 0 else y


def _sometimes_used_model(*, lora: bool):
    model = make_model("llama", num_layers=3, lora="default" if lora else None)
    base = model.get_base_model() if lora else model
    torch.manual_seed(1)
    layer = base.model.layers[1]
    layer.mlp = ScaledOnEvenLengths(layer.mlp, base.config.hidden_size)
    return model


def _mamba_with_dt_proj_lora(targets=("x_proj", "dt_proj")):
    """Tiny Mamba with LoRA on ``targets``: the mixer reads ``dt_proj.weight`` itself
    (``dt_proj.weight @ time_step``), so a ``dt_proj`` LoRA never gets a gradient."""
    import peft
    import transformers

    from roundpipe.models.tiny import tiny_config

    config = tiny_config(transformers.CONFIG_MAPPING["mamba"]())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False
    )  # fmt: skip
    return peft.get_peft_model(model, lora)


def _batches(*lengths: int, vocab: int = 256) -> list[dict]:
    return [make_batch(batch=4, seq=n, vocab=vocab, padding=None, seed=i) for i, n in enumerate(lengths)]


def _lr_at(lrs, step: int) -> float | None:
    return None if lrs is None else lrs[step]


# ----------------------------------------------------------------------------- the two sides
def plain_run(model, batches, steps, *, lrs=None, max_grad_norm=None, stale=False, **adamw):
    """``torch.optim.AdamW`` on one device; batch ``t % len(batches)`` at step ``t``; ``lrs``: the
    learning rate of each step; ``stale``: the async optimizer's contract (step t computes on the
    weights from before update t-1). Returns the run and the optimizer state by parameter name."""
    latest = copy.deepcopy(model)
    runner = copy.deepcopy(latest) if stale else latest
    names = [n for n, p in latest.named_parameters() if p.requires_grad]
    params = [p for p in latest.parameters() if p.requires_grad]
    run_params = [p for p in runner.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **adamw)
    previous = [p.detach().clone() for p in params]
    losses = []
    for t in range(steps):
        if stale:
            with torch.no_grad():
                for rp, w in zip(run_params, previous):
                    rp.copy_(w)
        loss = runner(**batches[t % len(batches)], use_cache=False).loss
        loss.backward()
        if stale:
            for p, rp in zip(params, run_params):
                p.grad, rp.grad = rp.grad, None
            previous = [p.detach().clone() for p in params]
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {n: dict(opt.state[p]) for n, p in zip(names, params) if opt.state.get(p)}
    return RunResult(losses, trainable_weights(latest)), state


def roundpipe_run(model, batches, steps, *, lrs=None, max_grad_norm=None, run=None, accumulate=1, **adamw):
    """roundpipe's side of ``plain_run``; ``accumulate``: each step's batch in that many slices of
    rows, each a ``forward_backward`` over the step's label tokens (the loss is the last slice's)."""
    model = copy.deepcopy(model)
    run = dict(devices="cpu:2", num_microbatches=2) | (run or {})
    with roundpipe.wrap(model, roundpipe.RunConfig(**run)) as pipe:
        pipe.configure_optimizer(max_grad_norm=max_grad_norm, **adamw)
        losses = []
        for t in range(steps):
            if lrs is not None:
                pipe.set_lr(lrs[t])
            b = batches[t % len(batches)]
            parts = [{k: v.tensor_split(accumulate)[i] for k, v in b.items()} for i in range(accumulate)]
            tokens = int((b["labels"][:, 1:] != -100).sum())
            for i, part in enumerate(parts):
                out = pipe.forward_backward(
                    part["input_ids"],
                    labels=part["labels"],
                    attention_mask=part.get("attention_mask"),
                    accumulate=i < accumulate - 1,
                    loss_tokens=tokens,
                )
            pipe.step()
            losses.append(out.loss)
        pipe.export_to(model)
        state = pipe.state_dict()["optimizer"]["state"]
    return RunResult(losses, trainable_weights(model)), state


def _by_model_name(state: dict, names) -> dict:
    """roundpipe's optimizer state renamed to the model's parameter names (roundpipe names a
    parameter relative to the model it wraps: a suffix of the peft name)."""
    out = {}
    for key, st in state.items():
        (full,) = [n for n in names if n == key or n.endswith("." + key)]
        out[full] = st
    return out


def assert_same_state(got: dict, want: dict, names) -> None:
    """Same parameters with state, the same step count each, moments equal to round-off."""
    got = _by_model_name(got, names)
    assert sorted(got) == sorted(want), (
        f"parameters with optimizer state differ: only roundpipe {sorted(set(got) - set(want))}, "
        f"only torch {sorted(set(want) - set(got))}"
    )
    for name, st in want.items():
        assert float(got[name]["step"]) == float(st["step"]), (
            f"{name}: step {float(got[name]['step'])}, torch {float(st['step'])}"
        )
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got[name][moment],
                st[moment],
                rtol=1e-4,
                atol=1e-4 * float(st[moment].abs().max()),  # an element near zero: summation order
                msg=lambda m, n=name, k=moment: f"{n} {k}: {m}",
            )


def _check(
    model, batches, steps, *, run=None, lrs=None, max_grad_norm=None, stale=False, accumulate=1, **adamw
):
    adamw = ADAMW | adamw
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    plain, plain_state = plain_run(
        model, batches, steps, lrs=lrs, max_grad_norm=max_grad_norm, stale=stale, **adamw
    )
    exact, _ = plain_run(
        copy.deepcopy(model).double(),
        batches,
        steps,
        lrs=lrs,
        max_grad_norm=max_grad_norm,
        stale=stale,
        **adamw,
    )
    got, got_state = roundpipe_run(
        model, batches, steps, lrs=lrs, max_grad_norm=max_grad_norm, run=run, accumulate=accumulate, **adamw
    )
    if accumulate > 1:  # each step reports its last slice's loss: the weights say it all
        got = RunResult(plain.losses, got.weights)
    assert_exact(got, plain, exact)
    assert_same_state(got_state, plain_state, names)
    return plain_state


# ----------------------------------------------------------------------------- no gradient
def test_a_lora_that_never_gets_a_gradient_is_neither_decayed_nor_stepped():
    """Mamba's mixer reads ``dt_proj.weight`` directly, so a LoRA on ``dt_proj`` is never in the
    graph: torch.optim.AdamW leaves it alone (no decay, no state); so must roundpipe."""
    model = _mamba_with_dt_proj_lora()
    batches = _batches(12, vocab=model.config.vocab_size)
    state = _check(model, batches, 3)
    assert not any("dt_proj" in n for n in state)  # the case this test is about: no gradient there
    assert any("x_proj" in n for n in state)


def test_a_stage_none_of_whose_parameters_gets_a_gradient_trains_the_others():
    """With LoRA on ``dt_proj`` and ``lm_head`` only the head's adapter is in the graph: a backward
    stage of one Mamba layer has trainable parameters but nothing to differentiate, and nothing to
    hand down (the embedding is frozen). Plain PyTorch trains the head's adapter; so must roundpipe."""
    model = _mamba_with_dt_proj_lora(targets=("dt_proj", "lm_head"))
    batches = _batches(12, vocab=model.config.vocab_size)
    state = _check(model, batches, 2, run=dict(policy="roundpipe", partition=None))
    assert state and all("lm_head" in n for n in state)


PATHS = {
    "eager": dict(run=None),
    "deferred-clipped": dict(run=None, max_grad_norm=0.05),
    "one-device-4-microbatches": dict(run=dict(devices="cpu:1", num_microbatches=4)),
    "async": dict(run=dict(optimizer_mode="async"), stale=True),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_parameter_used_on_alternate_steps_is_stepped_only_when_used(path, lora):
    """``scale`` is in the graph on even-length batches only: it is decayed, its moments move and
    its step count grows on those steps alone, as torch.optim.AdamW does, on every update path
    (stepped as gradients become final, deferred by clipping, one device, async)."""
    model = _sometimes_used_model(lora=lora)
    state = _check(model, _batches(12, 13), 5, **PATHS[path])
    (scale,) = [n for n in state if n.endswith("mlp.scale")]
    assert float(state[scale]["step"]) == 3  # steps 0, 2, 4 of 5: the case this test is about


@pytest.mark.parametrize(
    "run", [dict(devices="cpu:2", num_microbatches=4), dict(optimizer_mode="async")], ids=["sync", "async"]
)
def test_a_parameter_only_some_microbatches_reach_is_stepped_when_any_does(run):
    """``scale`` is in the graph where the flag token is: on even steps one row of one microbatch
    holds it, on odd steps no row does. One process on the whole batch gets a gradient for it on
    even steps only; so does roundpipe, whichever microbatch, stage and device it comes from."""
    model = make_model("llama", num_layers=3, lora="default")
    token = with_flag_token(model)
    batch = make_batch(batch=8, seq=10)
    batches = [
        place_flag_token(batch, token, rows=[5]),
        place_flag_token(make_batch(batch=8, seq=10, seed=1), token, rows=[]),
    ]
    state = _check(model, batches, 5, run=run, stale="optimizer_mode" in run)
    (scale,) = [n for n in state if n.endswith("input_layernorm.scale")]
    assert float(state[scale]["step"]) == 3


def test_gradient_accumulation_steps_a_parameter_any_of_the_calls_reached():
    """Two ``accumulate`` calls per step: on even steps only the first call's rows hold the flag
    token, on odd steps neither's. ``scale`` has a gradient when either call reached it, as
    ``.grad`` accumulated over the calls would be non-None in torch."""
    model = make_model("llama", num_layers=3, lora="default")
    token = with_flag_token(model)
    batches = [
        place_flag_token(make_batch(batch=8, seq=10), token, rows=[1]),
        place_flag_token(make_batch(batch=8, seq=10, seed=1), token, rows=[]),
    ]
    state = _check(model, batches, 3, accumulate=2)
    (scale,) = [n for n in state if n.endswith("input_layernorm.scale")]
    assert float(state[scale]["step"]) == 2


@pytest.mark.parametrize(
    "run",
    [
        dict(dtype="bf16"),
        dict(dtype="fp16"),
        dict(nan_policy="skip"),
        dict(dtype="bf16", optimizer_mode="async"),
    ],
    ids=["bf16", "fp16-loss-scaling", "nan-skip-deferred", "bf16-async"],
)
def test_a_parameter_never_reached_keeps_its_weight_and_has_no_state_in_every_mode(run):
    """Only odd-length batches: ``scale`` is never in the graph. With weight decay on, torch leaves
    it bit for bit as it was and gives it no optimizer state; so does every precision and update
    path of roundpipe (low-precision runs have no exact plain counterpart; this property does)."""
    model = _sometimes_used_model(lora=True)
    (name,) = [n for n, p in model.named_parameters() if n.endswith("mlp.scale")]
    before = dict(model.named_parameters())[name].detach().clone()
    got, state = roundpipe_run(model, _batches(13, 11), 4, run=run, **ADAMW)
    assert torch.equal(got.weights[name], before)
    assert not any(key.endswith("mlp.scale") for key in state)
    assert any("lora_A" in key for key in state)  # the others were stepped


def test_a_gradient_of_exact_zeros_is_still_a_gradient():
    """A parameter in the graph whose gradient is exactly zero (a LoRA A under B = 0) is decayed
    and stepped, as in torch: roundpipe tells 'no gradient' from 'zero gradient' as autograd does."""
    import peft

    model = make_model("llama", num_layers=2)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"], task_type="CAUSAL_LM")
    )  # fmt: skip
    state = _check(model, _batches(12), 3)
    assert any("lora_A" in n for n in state)


# ----------------------------------------------------------------------------- every option
def test_learning_rate_changes_between_steps_apply_to_the_next_step_only():
    """set_lr between steps (a warm-up / decay schedule) is torch's param_groups[0]['lr'] = lr."""
    lrs = [0.0, 5e-3, 1e-2, 2e-3]
    _check(make_model("llama", num_layers=2), _batches(12), 4, lrs=lrs)


def test_learning_rate_changes_under_the_async_optimizer_apply_to_the_next_update():
    lrs = [1e-3, 5e-3, 1e-2, 2e-3]
    _check(
        make_model("llama", num_layers=2),
        _batches(12),
        4,
        lrs=lrs,
        run=dict(optimizer_mode="async"),
        stale=True,
    )


@pytest.mark.parametrize(
    "option",
    [dict(betas=(0.0, 0.0)), dict(betas=(0.5, 0.99), weight_decay=0.0), dict(eps=1e-2, weight_decay=1.0)],
    ids=["betas-zero", "no-decay", "large-eps-and-decay"],
)
def test_each_optimizer_option_means_what_it_means_in_torch(option):
    _check(make_model("llama", num_layers=2), _batches(12), 3, **option)


@pytest.fixture(scope="module")
def pipe():
    with roundpipe.wrap(make_model("llama", num_layers=2), roundpipe.RunConfig(devices="cpu:1")) as p:
        yield p


@pytest.mark.parametrize(
    "bad, what",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(lr=math.nan), "lr"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(weight_decay=math.nan), "weight_decay"),
        (dict(weight_decay=math.inf), "weight_decay"),
        (dict(eps=0.0), "eps"),
        (dict(eps=math.nan), "eps"),
        (dict(eps=math.inf), "eps"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(math.nan, 0.9)), "betas"),
        (dict(betas=(0.9,)), "betas"),
        (dict(betas=0.9), "betas"),
        (dict(lr="1e-3"), "lr"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm=math.nan), "max_grad_norm"),
        (dict(max_grad_norm=math.inf), "max_grad_norm"),
    ],
)
def test_an_optimizer_setting_torch_would_reject_or_misread_is_refused_by_name(pipe, bad, what):
    """A NaN weight decay or eps makes torch raise a ValueError and a NaN clipping norm clips
    differently in torch; every such value is a ConfigError that names the setting."""
    with pytest.raises(ConfigError, match=what):
        pipe.configure_optimizer(**bad)


def test_a_layers_update_reads_its_gradients_in_the_fused_step_only(monkeypatch):
    """The host's update of a layer: the step's gradient factor (1 / label tokens, the loss scale's
    inverse, the clip) goes into the fused AdamW kernel as its ``grad_scale``, not into a pass of
    its own over every gradient (host memory traffic: about a quarter of the kernel's again).
    Exactness against plain PyTorch is the other tests'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from roundpipe.optim.adamw import LayerwiseAdamW

    seen: list[tuple[str, int]] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            big = max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0)
            seen.append((str(func.overloadpacket), big))
            return func(*args, **(kwargs or {}))

    step_group = LayerwiseAdamW.step_group

    def recorded(self, *args, **kwargs):
        with Ops():
            return step_group(self, *args, **kwargs)

    monkeypatch.setattr(LayerwiseAdamW, "step_group", recorded)
    model, batch = make_model("llama", num_layers=2), make_batch(batch=4)
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", partition=None)) as pipe:
        pipe.configure_optimizer(**ADAMW, max_grad_norm=1e-3)  # clipped: a factor below 1
        pipe.forward_backward(batch["input_ids"], batch["labels"])
        pipe.step()
        assert pipe.last_grad_norm > 1e-3
    ops = {name for name, _ in seen}
    assert "aten._fused_adamw_" in ops, sorted(ops)
    assert not [(name, n) for name, n in seen if name in ("aten.mul_", "aten.mul", "aten.div_") and n > 1]
