"""One generic adapter for decoder-only HF causal LMs: ``[embed, layers.0 .. layers.L-1, head]``.

With ``head_shards=k > 1`` the single ``head`` becomes ``head.0 .. head.{k-1}``, vocabulary shards
of the LM head + loss that hand a packed tensor to each other (see ``head_shards.py``).

The layers reproduce the HF forward of the supported families step for step (see
``families.py``): ``embed_tokens(ids)``; position ids (given, or ``arange(T)[None]`` -- not
padding-aware, as in HF); one mask per attention type from ``transformers.masking_utils``; rotary
``(cos, sin)`` tables; each decoder layer called with exactly HF's keyword arguments (as in a
training forward, ``use_cache=False``); final norm; ``lm_head``; optional logit softcapping; HF's
causal-LM cross-entropy (as a sum, in token chunks, see ``head.py``).

Ownership: every ``Layer.module`` is the model's own module (never a copy), so LoRA modules inside a
block run with it and tied embeddings stay one Parameter shared by ``embed`` and ``head``. At run
time ``Layer.forward`` reads tensors only from its ``module`` argument (a device shell the runtime
built) and from the ``LayerContext``; it never touches the HF model's tensors. The per-layer Python
facts it needs (which mask, the softcap value) are read from the config, which holds no tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ConfigError, InputError, UnsupportedModel
from roundpipe.models.base import Layer, LayerContext, MicrobatchInputs, ModelAdapter
from roundpipe.models.discover import ModelLayout, discover_layout, how_to_add, text_config
from roundpipe.models.families import FAMILIES, GENERIC_CHECKS, FamilySpec, packing_refusal
from roundpipe.models.head import chunked_lm_loss, shift_labels
from roundpipe.models.head_shards import head_tensors, vocab_ranges, vocab_shard_forward
from roundpipe.models.mask_facts import MaskFacts, padding_known
from roundpipe.models.router_loss import capture_router_logits, find_router_loss
from roundpipe.models.views import ViewLogits, context_view, embedding_view, logits_view, run_to_first_layer


class EmbedLayer(Layer):
    """``input_ids`` [b, T] -> hidden [b, T, H]: what the first decoder layer receives.

    ``view=False``: ``module`` is the model's input embedding, called on the ids (it may scale
    inside, as Gemma's does). ``view=True``: the family adds something between the embedding and
    the first layer (a normaliser, a multiplier, a position table), so ``module`` is the base model's
    embedding view (``views.embedding_view``) and its own forward runs.
    """

    def __init__(self, name: str, index: int, module: nn.Module, *, view: bool = False):
        super().__init__(name, index, "embed", module)
        self.view = view

    def forward(self, module: nn.Module, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if not self.view:
            return module(x)
        return run_to_first_layer(
            module,
            input_ids=x,
            attention_mask=ctx.inputs.attention_mask,
            position_ids=ctx.inputs.position_ids,
        )


class BlockLayer(Layer):
    """One HF decoder layer: hidden [b, T, H] -> hidden [b, T, H].

    Called with the arguments the base model's own forward passes it, as recorded for this
    microbatch by the context view (``LayerContext.layer_inputs``); ``attention_type`` (the mask
    discovery saw it get) is what the cost model reads.
    """

    def __init__(
        self,
        name: str,
        index: int,
        module: nn.Module,
        *,
        attention_type: str,
        config: Any,
        routers: tuple[str, ...] = (),
        router_index: int = 0,
    ):
        super().__init__(name, index, "block", module)
        self.attention_type = attention_type
        self.config = config
        self.routers, self.router_index = routers, router_index  # for the load-balancing loss

    def forward(self, module: nn.Module, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        args, kwargs = ctx.layer_inputs[self.index - 1]
        if self.routers:  # leave the router logits in ctx for the load-balancing loss
            with capture_router_logits(module, self.routers, self.router_index) as got:
                out = module(x, *args, **kwargs)
            ctx.router_logits[self.index] = got
        else:
            out = module(x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # older layers return (hidden, ...)


class HeadLayer(Layer):
    """Final norm + LM head + loss: hidden [b, T, H] -> 0-dim fp32 sum of token cross-entropies.

    ``module`` is ``nn.ModuleDict({"norm": ..., "lm_head": ...})`` holding the model's own modules
    (``lm_head`` is the model's LM head, or a ``views.ViewLogits`` around it when the family
    transforms its logits). The norm runs under ordinary autograd; the head and the loss run in
    token chunks of ``ctx.head_chunk_tokens`` (see ``head.chunked_lm_loss``).
    """

    def __init__(self, name: str, index: int, module: nn.Module, *, config: Any, softcapping: bool):
        super().__init__(name, index, "head", module)
        self.config = config
        self.softcapping = softcapping

    def forward(self, module: nn.Module, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if ctx.shift_labels is None:
            raise InputError("the head computes the loss and needs labels; pass labels with the batch")
        softcap = getattr(self.config, "final_logit_softcapping", None) if self.softcapping else None
        hidden = module["norm"](x)
        return chunked_lm_loss(
            hidden,
            ctx.shift_labels,
            module["lm_head"],
            chunk_tokens=ctx.head_chunk_tokens,
            softcap=softcap,
            positions=ctx.inputs.loss_positions,
        )


class HeadShardLayer(Layer):
    """One vocabulary shard of the LM head + loss (``head.{shard}`` of ``num_shards``).

    ``module`` is ``nn.ModuleDict({"norm": ..., "lm_head": ...})`` for shard 0 and
    ``nn.ModuleDict({"lm_head": ...})`` for the others, holding the model's own modules: every
    shard holds the *whole* head (the same Parameters; the tied embedding weight when tied) and uses
    rows ``[vocab_start, vocab_stop)`` of it. ``row_slices()`` names the tensors it reads only those
    rows of, so the runtime uploads (and takes gradients of) just the rows; ``forward`` accepts a
    module holding either the whole tensors or those rows. Input/output: shard 0 takes hidden
    [b, T, H] (run dtype); every shard but the last returns the packed fp32 [b, T, H + 2]; the last
    returns the 0-dim fp32 loss sum (see ``head_shards.py``).
    """

    def __init__(
        self,
        name: str,
        index: int,
        module: nn.Module,
        *,
        shard: int,
        num_shards: int,
        vocab_range: tuple[int, int],
        config: Any,
        softcapping: bool,
    ):
        super().__init__(name, index, "head", module)
        self.shard = shard
        self.num_shards = num_shards
        self.vocab_start, self.vocab_stop = vocab_range
        self.vocab = head_tensors(module["lm_head"]).vocab
        self.config = config
        self.softcapping = softcapping

    def row_slices(self) -> dict[str, tuple[int, int]]:
        """``{parameter path in module: (vocab_start, vocab_stop)}`` for every tensor this shard
        needs only its vocabulary rows of: the head's weight and bias and LoRA B's weight and bias
        (``head_tensors(...).flat()``), and the weight and bias of any other vocabulary-sized Linear
        inside ``lm_head`` that the head does not use now (a modules_to_save wrapper's original
        module, inactive adapters), so that they cost a shard only its rows too. The other tensors
        (the norm, LoRA A) are used whole. Read once, when the runtime wraps the model."""
        lm_head = self.module["lm_head"]
        flat = head_tensors(lm_head).flat()
        sliced = {id(t) for t, rows in flat if rows and t is not None}
        for m in lm_head.modules():
            if isinstance(m, nn.Linear) and m.weight.shape[0] == self.vocab:
                sliced |= {id(t) for t in (m.weight, m.bias) if t is not None}
        sliced -= {id(t) for t, rows in flat if not rows and t is not None}
        return {
            name: (self.vocab_start, self.vocab_stop)
            for name, t in self.module.named_parameters(remove_duplicate=False)
            if id(t) in sliced
        }

    def forward(self, module: nn.Module, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        softcap = getattr(self.config, "final_logit_softcapping", None) if self.softcapping else None
        first = self.shard == 0
        return vocab_shard_forward(
            x,
            ctx.shift_labels,
            module["lm_head"],
            vocab_range=(self.vocab_start, self.vocab_stop),
            vocab=self.vocab,
            first=first,
            last=self.shard == self.num_shards - 1,
            chunk_tokens=ctx.head_chunk_tokens,
            softcap=softcap,
            norm=module["norm"] if first else None,
            positions=ctx.inputs.loss_positions,
            check_labels=not ctx.labels_checked,
        )


class DecoderOnlyAdapter(ModelAdapter):
    """A HF causal LM seen as ``[embed, layers.0, ..., layers.{L-1}, head]``.

    Attributes:
        model: the HF causal LM (unwrapped from peft); owns every parameter.
        config: the config that sizes the decoder (``model.config``, or its text config).
        family: the HF ``model_type``.
        layout: where the parts are and how they run (``discover.ModelLayout``).
        spec: the family's registered ``FamilySpec`` (None: nothing registered; discovery decides).
        head_shards: how many layers the head + loss is cut into (1: one ``head`` layer).
        layers: embed (index 0), one block per decoder layer, then ``head`` (``head_shards=1``) or
            ``head.0 .. head.{k-1}`` (vocabulary shards, ``HeadShardLayer``).
        context_module: ``nn.ModuleDict({"rotary_emb": <the model's rotary module>})`` (empty when
            the family has none); buffers only.
        router_loss: the MoE load-balancing loss the config asks for (``router_loss.RouterLoss``),
            or None.
    """

    def __init__(
        self, model: nn.Module, layout: ModelLayout, spec: FamilySpec | None = None, head_shards: int = 1
    ):
        self.model = model
        self.config = text_config(model.config)
        self.family = getattr(self.config, "model_type", None) or getattr(model.config, "model_type", "")
        self.layout = layout
        self.spec = spec
        self.head_shards = head_shards
        base = model.get_submodule(layout.base)
        blocks = list(getattr(base, layout.layers))[: self.config.num_hidden_layers]
        if layout.embedding == "view":
            embed = EmbedLayer("embed", 0, embedding_view(base, layout.layers, layout.rotary), view=True)
        else:
            embed = EmbedLayer("embed", 0, getattr(base, layout.embed))
        self.layers: list[Layer] = [embed]
        self.router_loss = find_router_loss(model, self.config, blocks)
        routers = self.router_loss.routers if self.router_loss else ((),) * len(blocks)
        for i, block in enumerate(blocks):
            self.layers.append(
                BlockLayer(
                    f"layers.{i}",
                    i + 1,
                    block,
                    attention_type=layout.attention_types[i],
                    config=self.config,
                    routers=routers[i],
                    router_index=self.router_loss.index if self.router_loss else 0,
                )
            )
        norm = nn.Identity() if layout.norm is None else getattr(base, layout.norm)
        lm_head = getattr(model, layout.head)
        softcapping = layout.logits == "softcap"
        if layout.logits == "custom":
            lm_head = ViewLogits(logits_view(model, layout.base))
        if head_shards == 1:
            head = nn.ModuleDict({"norm": norm, "lm_head": lm_head})
            self.layers.append(
                HeadLayer("head", len(self.layers), head, config=self.config, softcapping=softcapping)
            )
        else:
            if layout.logits == "custom":
                raise UnsupportedModel(
                    f"{type(model).__name__} transforms its logits in its own forward (a scaling the "
                    f"vocabulary shards do not apply); use head_shards=1"
                )
            ranges = vocab_ranges(head_tensors(lm_head).vocab, head_shards)
            for j, vocab_range in enumerate(ranges):
                parts = {"norm": norm, "lm_head": lm_head} if j == 0 else {"lm_head": lm_head}
                self.layers.append(
                    HeadShardLayer(
                        f"head.{j}",
                        len(self.layers),
                        nn.ModuleDict(parts),
                        shard=j,
                        num_shards=head_shards,
                        vocab_range=vocab_range,
                        config=self.config,
                        softcapping=softcapping,
                    )
                )
        self.attention_types = sorted(set(layout.attention_types))
        self.context_module = nn.ModuleDict({"layers": context_view(base, layout.names())})

    def build_context(
        self,
        context_module: nn.Module,
        inputs: MicrobatchInputs,
        dtype: torch.dtype,
        mask_facts: MaskFacts | None = None,
    ) -> LayerContext:
        """Every decoder layer's arguments and the shifted labels for one microbatch on its device.

        Runs the base model's own forward through the context view (``views.ContextView``) with
        ``inputs_embeds`` zeros of the microbatch's shape in ``dtype`` (masks and rotary tables
        follow the hidden dtype, as in HF), the attention mask and the position ids: the layers get
        exactly what HF's forward would hand them. ``mask_facts``: whether a token of the microbatch is
        padded and whether a row packs several sequences, known from its host copies, so that
        building the masks reads no device value (``mask_facts.padding_known``; None: transformers
        reads the device tensors as usual).
        """
        input_ids = inputs.input_ids
        _check_inputs(inputs)
        batch, seq = input_ids.shape
        device = input_ids.device
        position_ids = inputs.position_ids
        if position_ids is None:
            position_ids = torch.arange(seq, device=device).unsqueeze(0)
        zeros = torch.zeros(batch, seq, int(self.config.hidden_size), dtype=dtype, device=device)
        with padding_known(mask_facts):
            layer_inputs = context_module["layers"](zeros, inputs.attention_mask, inputs.position_ids)
        return LayerContext(
            inputs=inputs,
            position_ids=position_ids,
            layer_inputs=layer_inputs,
            shift_labels=None if inputs.labels is None else shift_labels(inputs.labels),
        )

    def reuse_context(self, ctx: LayerContext, inputs: MicrobatchInputs) -> LayerContext:
        _check_inputs(inputs)
        return dataclasses.replace(
            ctx,
            inputs=inputs,
            shift_labels=None if inputs.labels is None else shift_labels(inputs.labels),
            router_logits={},
        )


def _check_inputs(inputs: MicrobatchInputs) -> None:
    ids = inputs.input_ids
    if ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise InputError(
            f"input_ids must be a [batch, seq] integer tensor, got {tuple(ids.shape)} {ids.dtype}"
        )
    for name in ("attention_mask", "labels"):
        t = getattr(inputs, name)
        if t is not None and t.shape != ids.shape:
            raise InputError(
                f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(ids.shape)}; they must match"
            )
    pos = inputs.position_ids
    if pos is not None and (
        pos.ndim != 2 or pos.shape[1] != ids.shape[1] or pos.shape[0] not in (1, ids.shape[0])
    ):
        raise InputError(
            f"position_ids has shape {tuple(pos.shape)}; it must be [batch, seq] or [1, seq] with "
            f"seq = {ids.shape[1]}"
        )


def _unwrap_peft(model: Any) -> Any:
    """The HF model inside a peft wrapper (LoRA modules stay injected in it); other models as is."""
    try:
        import peft
    except ImportError:  # peft is optional: without it no model can be a PeftModel
        return model
    if isinstance(model, peft.PeftModel):
        config = model.peft_config.get(model.active_adapter)
        if config is not None and config.is_prompt_learning:
            raise UnsupportedModel(
                f"peft {config.peft_type} adds virtual tokens outside the model's layers, which the "
                f"pipeline does not run; use an adapter injected into the layers, such as LoRA"
            )
        problem = None if config is None else _peft_method_refusal(config)
        if problem is not None:
            raise UnsupportedModel(problem)
        return model.get_base_model()
    return model


def _peft_method_refusal(config: Any) -> str | None:
    """Why the pipeline cannot train the peft method ``config`` asks for exactly, or None. These
    methods work outside the layers in training (the wrap-time training proof would refuse them
    too, with a less specific message)."""
    if str(config.peft_type).endswith("ADALORA"):
        return (
            f"peft {config.peft_type} trains outside the model's layers: AdaLoraModel.forward adds an "
            f"orthogonal regularizer of every adapter to the loss (orth_reg_weight), and every step "
            f"calls update_and_allocate to reallocate the ranks from the gradients; the pipeline does "
            f"neither. Use LoRA (peft.LoraConfig) instead"
        )
    if str(config.peft_type).endswith("SHIRA"):
        return (
            f"peft {config.peft_type} builds a sparse tensor (torch.sparse_coo_tensor) from its weights "
            f"in every forward, which the pipeline's workers do not run. Use LoRA (peft.LoraConfig) "
            f"instead"
        )
    if getattr(config, "coft", False):
        return (
            f"peft {config.peft_type} with coft=True (constrained OFT) projects oft_R in place in every "
            f"training forward; the pipeline's workers run each step on copies of the weights, so the "
            f"projection would be lost. Use coft=False"
        )
    if getattr(config, "alora_invocation_tokens", None):
        return (
            f"peft {config.peft_type} with alora_invocation_tokens (activated LoRA) applies the adapters "
            f"only after the invocation tokens, at offsets PeftModelForCausalLM.forward computes per "
            f"batch outside the layers; the pipeline runs the layers without them. Use LoraConfig "
            f"without alora_invocation_tokens"
        )
    return None


def adapt_model(model: nn.Module, head_shards: int = 1) -> ModelAdapter:
    """Wrap a HF causal LM (or a peft model around one) as a list of layers, without copying.

    Args:
        model: a ``*ForCausalLM`` of a supported family, optionally inside ``peft.PeftModel``.
        head_shards: cut the LM head + loss into this many vocabulary shards ``head.0 ..
            head.{k-1}`` (near-equal contiguous row ranges, the first ``V % k`` one row larger) so
            the head can be balanced like other layers; the loss and gradients stay exact. 1 (the
            default) keeps one ``head`` layer.

    Returns:
        A ``DecoderOnlyAdapter`` whose ``model`` is the unwrapped HF module.

    Raises:
        ConfigError: ``head_shards`` is not an int in ``1..vocab_size``, or a buffer of the model
            is on the meta device (the message says how to build it).
        UnsupportedModel: the model is not a causal LM of a supported family (the message lists
            the families and how to add one), or its config asks for behaviour the layers would not
            reproduce exactly (the message names the setting to change), or ``head_shards > 1`` and
            the ``lm_head`` is a kind of module the shards cannot slice (the message says to use
            ``head_shards=1``).
    """
    if isinstance(head_shards, bool) or not isinstance(head_shards, int) or head_shards < 1:
        raise ConfigError(f"head_shards must be a positive int (1: one head layer), got {head_shards!r}")
    causal_lm = _unwrap_peft(model)
    config = getattr(causal_lm, "config", None)
    kind = type(causal_lm).__name__
    if not isinstance(causal_lm, nn.Module) or config is None:
        raise UnsupportedModel(f"{kind} is not a Hugging Face model (no config). {how_to_add()}")
    if (
        not callable(getattr(causal_lm, "get_output_embeddings", None))
        or causal_lm.get_output_embeddings() is None
    ):
        raise UnsupportedModel(
            f"{kind} has no LM head: roundpipe trains causal LMs (decoder + LM head + loss). Load the "
            f"model with AutoModelForCausalLM instead. {how_to_add()}"
        )
    model_type = getattr(text_config(config), "model_type", None) or getattr(config, "model_type", None)
    spec = FAMILIES.get(model_type)
    for check in (*GENERIC_CHECKS, *([spec.check_config] if spec is not None and spec.check_config else [])):
        problem = check(text_config(config))
        if problem is not None:
            raise UnsupportedModel(f"{kind}: {problem}.")
    meta = next((n for n, b in causal_lm.named_buffers() if b.is_meta), None)
    if meta is not None:  # parameters may wait for weights=; buffers are never stored, so must be real
        raise ConfigError(
            f"buffer {meta} of the model is on the meta device: build the model under "
            f"accelerate.init_empty_weights(), which leaves buffers real, not torch.device('meta')"
        )
    tensors = [*causal_lm.named_parameters(), *causal_lm.named_buffers()]
    sparse = next(((n, t.layout) for n, t in tensors if t.layout != torch.strided), None)
    if sparse is not None:  # the store keeps dense host copies and streams dense weights
        raise UnsupportedModel(
            f"{kind}: {sparse[0]} is a {sparse[1]} tensor; roundpipe streams dense weights. Store it "
            f"dense, or use an adapter with dense weights, such as LoRA"
        )
    packed = next(
        ((n, t.dtype) for n, t in causal_lm.named_parameters() if t.dtype not in PLAIN_FLOATS), None
    )
    if packed is not None:  # the store would convert the codes to the run dtype without their scales
        raise UnsupportedModel(
            f"{kind}: {packed[0]} holds {str(packed[1]).removeprefix('torch.')} values, a packed or scaled "
            f"weight (a model quantized by BitsAndBytesConfig, an fp8 checkpoint): roundpipe keeps frozen "
            f"weights compressed itself; load the model in bf16 (or build it on meta and pass its saved "
            f"directory as weights=SafetensorsWeights(dir), as roundpipe train does: packed files are read "
            f"as they are) and set RunConfig(quantization='nf4', 'int8' or 'fp8') (run.quantization)"
        )
    layout = discover_layout(causal_lm)
    if spec is not None:
        layout = spec.adjust(layout, text_config(config))
    return DecoderOnlyAdapter(causal_lm, layout, spec, head_shards)


PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def packing_refusal_of(model: nn.Module) -> str | None:
    """Why ``model`` (optionally inside a peft wrapper) cannot train on packed rows, or None
    (``families.packing_refusal``), found before it is wrapped: its layout discovered as
    :func:`adapt_model` discovers it, its family's overrides applied. Discovery reads no weight, so
    a model on the meta device is asked the same way."""
    causal_lm = _unwrap_peft(model)
    config = text_config(causal_lm.config)
    family = getattr(config, "model_type", None) or getattr(causal_lm.config, "model_type", "")
    layout = discover_layout(causal_lm)
    spec = FAMILIES.get(family)
    if spec is not None:
        layout = spec.adjust(layout, config)
    return packing_refusal(family, layout, config)
