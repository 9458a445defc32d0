"""The wrap-time training proof: a model whose training the layers do not reproduce is refused.

The forward proof runs the unwrapped model in eval mode; each model here passes it, and differs
only in training: a loss term added outside the layers, a backward changed between two layers, a
random draw the pipeline cannot replay, and the peft methods that do such things (AdaLoRA's
orthogonal regularizer, aLoRA's activation offsets). Each is refused at wrap time by a message that
names what differs.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from support.tiny_models import make_model
from torch import nn

import roundpipe
from roundpipe.errors import UnsupportedModel
from roundpipe.models import adapt_model
from roundpipe.models.verify import verify_model

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _wrap(model, **config):
    config = dict(devices="cpu:1", policy="roundpipe", partition=None) | config
    return roundpipe.wrap(model, roundpipe.RunConfig(**config))


def _peft(model, config):
    import peft

    return peft.get_peft_model(model, config)


# --- an extra loss term ----------------------------------------------------------------------


def _regularized_llama():
    import transformers

    class RegularizedLlama(transformers.LlamaForCausalLM):
        """Adds an L2 term on the LM head to its loss in training, as a regularizer would."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if self.training and out.loss is not None:
                out.loss = out.loss + 0.01 * self.lm_head.weight.pow(2).sum()
            return out

    plain = make_model("llama")
    model = RegularizedLlama(plain.config)
    model.load_state_dict(plain.state_dict())
    return model.train()


@pytest.mark.parametrize("verify_model", [True, False])
def test_a_loss_term_added_outside_the_layers_is_refused(verify_model):
    """verify_model=False proves on the tiny model of the same class, which adds the term too."""
    with pytest.raises(
        UnsupportedModel, match=r"the model's loss \(.*\) differs from the layers' loss"
    ) as info:
        _wrap(_regularized_llama(), verify_model=verify_model).close()
    assert "adds a term to the loss" in str(info.value)


# --- a backward changed between the layers ----------------------------------------------------


class _DoubleGrad(torch.autograd.Function):
    """The identity forward; twice the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _autograd_function(out):
    return _DoubleGrad.apply(out)


def _tensor_hook(out):
    out = out.view_as(out)
    if out.requires_grad:
        out.register_hook(lambda grad: 2 * grad)
    return out


@pytest.mark.parametrize("lora", [None, "all-linear"])
@pytest.mark.parametrize("change", [_autograd_function, _tensor_hook])
def test_a_backward_changed_between_layers_is_refused_naming_the_layer(monkeypatch, change, lora):
    """The model's forward hands layer 0's output to layer 1 through a custom autograd function (or
    a tensor hook) that doubles the gradient: the forward is the same, so the forward proof passes;
    the gradient reaching layers.0's output differs, and it is named."""
    model = make_model("llama", lora=lora, num_layers=3)
    inner = model.get_base_model() if lora else model
    base = inner.model
    original = base.forward

    def forward(*args, **kwargs):
        handle = base.layers[0].register_forward_hook(lambda m, a, out: change(out))
        try:
            return original(*args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(base, "forward", forward)
    with pytest.raises(
        UnsupportedModel, match=r"the gradient reaching the output of layer layers\.0 is the first"
    ):
        _wrap(model).close()


@pytest.mark.parametrize("lora", [None, "all-linear"])
def test_a_backward_hook_inside_a_layer_is_refused_naming_its_parameter(monkeypatch, lora):
    """The model's forward puts a backward hook on layer 1's MLP that doubles the gradient it hands
    back: the forward and the gradient reaching layers.1's output are the same, the gradients of
    the parameters before the MLP in layer 1 are not; the first of them is named with its layer."""
    model = make_model("llama", lora=lora, num_layers=3)
    inner = model.get_base_model() if lora else model
    base = inner.model
    original = base.forward

    def forward(*args, **kwargs):
        double = base.layers[1].mlp.register_full_backward_hook(
            lambda m, grad_in, grad_out: (2 * grad_in[0],)
        )
        try:
            return original(*args, **kwargs)
        finally:
            double.remove()

    monkeypatch.setattr(base, "forward", forward)
    found = r"the first trainable parameter whose gradient differs is \S*layers\.1\.\S* \(layer layers\.1, LlamaDecoderLayer\)"
    with pytest.raises(UnsupportedModel, match=found):
        _wrap(model).close()


def test_a_parameter_used_outside_the_layers_is_refused_by_name(monkeypatch):
    """A trainable parameter of no layer that the model's forward uses: the pipeline would never
    train it."""
    model = make_model("llama")
    model.extra_scale = nn.Parameter(torch.tensor(1.5))
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if model.training and out.loss is not None:
            out.loss = out.loss * model.extra_scale / model.extra_scale.detach()
        return out

    monkeypatch.setattr(model, "forward", forward)
    with pytest.raises(
        UnsupportedModel, match=r"trainable parameter extra_scale belongs to none of the layers"
    ):
        _wrap(model).close()


# --- a random draw the pipeline cannot replay -------------------------------------------------


class _UnseededDropout(nn.Module):
    """Drops a tenth of the activations with a mask drawn outside torch's default generator."""

    def __init__(self, inner: nn.Module, source: str):
        super().__init__()
        self.inner, self.source, self.dropout = inner, source, 0.1

    def forward(self, x):
        y = self.inner(x)
        if not self.training or self.dropout == 0.0:
            return y
        if self.source == "generator":
            gen = torch.Generator().manual_seed(time.time_ns() % 2**31)
            keep = torch.rand(y.shape, generator=gen) >= self.dropout
        else:
            keep = torch.tensor([random.random() >= self.dropout for _ in range(y.numel())]).view(y.shape)
        return y * keep / (1 - self.dropout)


@pytest.mark.parametrize("source", ["generator", "python"])
def test_an_unreplayed_random_draw_is_refused_naming_the_layer(source):
    model = make_model("llama", num_layers=3)
    mlp = model.model.layers[1].mlp
    mlp.act_fn = _UnseededDropout(mlp.act_fn, source)
    with pytest.raises(
        UnsupportedModel, match=r"two different outputs of layer layers\.1 \(LlamaDecoderLayer\)"
    ):
        _wrap(model).close()


def test_dropout_from_torchs_generator_passes_the_replay_check():
    """nn.Dropout draws from torch's default generator, which the pipeline replays: accepted."""
    model = make_model("llama", num_layers=2)
    mlp = model.model.layers[1].mlp
    mlp.act_fn = nn.Sequential(mlp.act_fn, nn.Dropout(0.1))
    _wrap(model).close()


# --- peft methods that train outside the layers -----------------------------------------------


def _adalora():
    import peft

    return _peft(
        make_model("llama"),
        peft.AdaLoraConfig(
            task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], init_r=4, target_r=2, total_step=10,
            init_lora_weights=False,
        ),
    )  # fmt: skip


def _alora():
    import peft

    return _peft(
        make_model("llama"),
        peft.LoraConfig(
            task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
            alora_invocation_tokens=[5, 6, 7],
        ),
    )  # fmt: skip


def test_adalora_is_refused_at_wrap_time():
    with pytest.raises(UnsupportedModel, match=r"ADALORA.*orth_reg_weight.*update_and_allocate"):
        _wrap(_adalora()).close()


def test_alora_is_refused_at_wrap_time():
    with pytest.raises(UnsupportedModel, match=r"alora_invocation_tokens"):
        _wrap(_alora()).close()


@pytest.mark.parametrize(
    "build, found",
    [
        (_adalora, r"the model's loss \(.*\) differs from the layers' loss"),
        (_alora, r"the model's loss \(.*\) differs from the layers' loss"),
    ],
)
def test_the_training_proof_alone_refuses_adalora_and_alora(monkeypatch, build, found):
    """Without the named refusal, the general proof still catches both: AdaLoRA's regularizer is
    an extra loss term; aLoRA's adapters change peft's loss after the invocation tokens (which the
    probe holds) and not the layers'."""
    from roundpipe.models import adapter

    monkeypatch.setattr(adapter, "_peft_method_refusal", lambda config: None)
    with pytest.raises(UnsupportedModel, match=found):
        _wrap(build()).close()


# --- the proof leaves the model as it found it ------------------------------------------------


def test_the_proof_leaves_flags_grads_dropout_and_the_generator_as_they_were():
    model = make_model("llama", lora="all-linear")
    model.get_base_model().model.layers[0].mlp.act_fn = nn.Sequential(nn.SiLU(), nn.Dropout(0.25))
    model.eval()
    model.base_model.model.model.layers[1].train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params[::2]:
        p.grad = torch.full_like(p, 3.0)
    adapter = adapt_model(model)
    flags = [m.training for m in model.modules()]
    torch.manual_seed(7)
    state = torch.get_rng_state()
    assert verify_model(model, adapter) == "model"
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in model.modules()] == flags
    assert model.get_base_model().model.layers[0].mlp.act_fn[1].p == 0.25
    for i, p in enumerate(params):
        assert (p.grad is None) if i % 2 else torch.equal(p.grad, torch.full_like(p, 3.0))


# --- a forward that writes a parameter ------------------------------------------------------------


def test_a_forward_that_writes_a_parameter_in_place_is_refused_naming_it(monkeypatch):
    """The pipeline's workers run each step on copies of the weights, so a change the forward makes
    to a parameter in place (peft OFT's ``coft`` projection of ``oft_R``, a running statistic kept
    as a parameter) would be lost where plain PyTorch keeps it."""
    model = make_model("llama", num_layers=2)
    mlp = model.model.layers[1].mlp
    original = mlp.forward

    def forward(x):
        if mlp.training:
            with torch.no_grad():
                mlp.up_proj.weight.mul_(0.999)
        return original(x)

    monkeypatch.setattr(mlp, "forward", forward)
    with pytest.raises(
        UnsupportedModel, match=r"writes parameter \S*layers\.1\.mlp\.up_proj\.weight in place"
    ):
        _wrap(model).close()


def test_peft_constrained_oft_is_refused_at_wrap_time():
    import peft

    model = _peft(
        make_model("llama"), peft.OFTConfig(r=0, oft_block_size=8, coft=True, target_modules=["q_proj"])
    )
    with pytest.raises(UnsupportedModel, match=r"oft_R\S* in place"):
        _wrap(model).close()


def test_peft_shira_with_sparse_adapter_weights_is_refused_at_wrap_time():
    import peft

    model = _peft(make_model("llama"), peft.ShiraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(UnsupportedModel, match=r"sparse"):
        _wrap(model).close()


def test_a_sparse_tensor_in_the_model_is_refused_naming_it():
    model = make_model("llama")
    model.model.layers[0].mlp.register_buffer("mask", torch.eye(4).to_sparse())
    with pytest.raises(UnsupportedModel, match=r"layers\.0\.mlp\.mask is a torch\.sparse_coo tensor"):
        _wrap(model).close()


def test_ctrl_is_refused_at_wrap_time_naming_what_it_does():
    import transformers

    config = transformers.CTRLConfig(vocab_size=99, n_embd=32, n_layer=2, n_head=4, dff=37, n_positions=64)
    with pytest.raises(UnsupportedModel, match=r"pos_encoding"):
        _wrap(transformers.CTRLLMHeadModel(config)).close()
