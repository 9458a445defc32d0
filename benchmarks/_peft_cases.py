"""The peft matrix of benchmarks/peft_coverage.py: each configuration, with the file of
huggingface/peft's test suite (and the entry in it) its values come from.

The tiny models' module names stand in for the test models': ``lin0``/``lin1`` of peft's MLP become
``q_proj``/``v_proj``, ``emb`` becomes ``embed_tokens``; a string ``target_modules`` (a regex peft
matches against the full module name) gets a ``.*`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INVOCATION_TOKEN = 1  # aLoRA's invocation token; peft_coverage puts it into every sample

DECODER = "tests/test_decoder_models.py"
CUSTOM = "tests/test_custom_models.py"
INIT = "tests/test_initialization.py"
COMMON = "tests/testing_common.py"
TARGET_PARAMS = "tests/test_target_parameters.py"


@dataclass(frozen=True)
class Case:
    """One peft configuration of the matrix.

    ``kwargs`` are the config's arguments as the source file gives them (with the tiny model's module
    names); ``source`` names the file of huggingface/peft and the entry in it. ``stochastic``: the
    configuration draws random numbers in training, so it gets the replay check. ``second``: the
    arguments of a second adapter ``other``; ``both_active`` makes both adapters train.
    """

    name: str
    method: str
    config: str
    kwargs: dict
    source: str
    family: str = "llama"
    stochastic: bool = False
    second: dict | None = None
    both_active: bool = False
    extra: dict = field(default_factory=dict)


# peft's tests/testing_utils.set_init_weights_false: adapters start away from the identity, so
# every adapter weight gets an informative gradient (and lora_B is not a zero whose first Adam
# steps move it by about lr whatever the round-off, which fails the 2x rule by chance).
NO_INIT = {"init_lora_weights": False}
LORA_DECODER = {"task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 32, "target_modules": None, "bias": "none"}

CASES: list[Case] = [
    # ---- LoRA ----------------------------------------------------------------------------------
    Case(
        "lora",
        "LoRA",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.0, **NO_INIT},
        f"{DECODER} ALL_CONFIGS LoraConfig (lora_dropout 0)",
    ),
    Case(
        "lora_dropout",
        "LoRA",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.05, **NO_INIT},
        f"{DECODER} ALL_CONFIGS LoraConfig",
        stochastic=True,
    ),
    Case(
        "lora_all_linear",
        "LoRA",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.0, "target_modules": "all-linear", **NO_INIT},
        f"{DECODER} ALL_CONFIGS LoraConfig (lora_dropout 0) with target_modules='all-linear'",
    ),
    Case(
        "lora_bias_all",
        "LoRA",
        "LoraConfig",
        {**LORA_DECODER, "bias": "all", **NO_INIT},
        f"{DECODER} ALL_CONFIGS LoraConfig with bias='all'",
    ),
    Case(
        "lora_bias_lora_only",
        "LoRA",
        "LoraConfig",
        {**LORA_DECODER, "bias": "lora_only", **NO_INIT},
        f"{DECODER} ALL_CONFIGS LoraConfig with bias='lora_only'",
    ),
    Case(
        "lora_b_bias",
        "LoRA",
        "LoraConfig",
        {"target_modules": ["q_proj", "v_proj"], "lora_bias": True, "lora_alpha": 32, **NO_INIT},
        f"{CUSTOM} 'Vanilla MLP 1 LoRA with lora_b bias'",
    ),
    Case(
        "lora_rslora",
        "LoRA",
        "LoraConfig",
        {
            "target_modules": ["q_proj", "embed_tokens", "v_proj"],
            "lora_alpha": 3,
            "r": 16,
            "use_rslora": True,
            **NO_INIT,
        },
        f"{INIT} test_lora_rslora_scaling",
    ),
    Case(
        "lora_rank_alpha_pattern",
        "LoRA",
        "LoraConfig",
        {
            "target_modules": ["q_proj", "embed_tokens", "v_proj"],
            "rank_pattern": {"embed_tokens": 9, "v_proj": 16},
            "alpha_pattern": {"q_proj": 11, "v_proj": 13},
            "lora_alpha": 17,
            "r": 25,
            "use_rslora": False,
            **NO_INIT,
        },
        f"{INIT} test_lora_default_scaling_pattern",
    ),
    Case(
        "lora_rslora_pattern",
        "LoRA",
        "LoraConfig",
        {
            "target_modules": ["q_proj", "embed_tokens", "v_proj"],
            "rank_pattern": {"embed_tokens": 9, "v_proj": 16},
            "alpha_pattern": {"q_proj": 11, "v_proj": 13},
            "lora_alpha": 17,
            "r": 25,
            "use_rslora": True,
            **NO_INIT,
        },
        f"{INIT} test_lora_rslora_scaling_pattern",
    ),
    Case(
        "lora_dora",
        "LoRA (DoRA)",
        "LoraConfig",
        {"target_modules": ["q_proj", "v_proj"], "use_dora": True, **NO_INIT},
        f"{CUSTOM} 'Vanilla MLP 8 LoRA with DoRA'",
    ),
    Case(
        "lora_dora_embedding",
        "LoRA (DoRA)",
        "LoraConfig",
        {"target_modules": ["embed_tokens", "q_proj"], "use_dora": True, **NO_INIT},
        f"{CUSTOM} 'Embedding + transformers Conv1D 3 DoRA'",
    ),
    Case(
        "lora_pissa",
        "LoRA (PiSSA init)",
        "LoraConfig",
        {"init_lora_weights": "pissa", "target_modules": ["q_proj"]},
        f"{INIT} test_lora_config_pissa_olora_warns",
    ),
    Case(
        "lora_pissa_niter",
        "LoRA (PiSSA init)",
        "LoraConfig",
        {"init_lora_weights": "pissa_niter_3", "target_modules": ["q_proj"], "use_rslora": True},
        f"{INIT} test_lora_config_pissa_olora_warns",
    ),
    Case(
        "lora_olora",
        "LoRA (OLoRA init)",
        "LoraConfig",
        {"init_lora_weights": "olora", "target_modules": ["q_proj"]},
        f"{INIT} test_lora_config_pissa_olora_warns",
    ),
    Case(
        "lora_gaussian",
        "LoRA (gaussian init)",
        "LoraConfig",
        {"target_modules": ["q_proj"], "init_lora_weights": "gaussian"},
        f"{INIT} test_lora_linear_init_gaussian",
    ),
    Case(
        "lora_modules_to_save",
        "LoRA",
        "LoraConfig",
        {"target_modules": ["q_proj"], "modules_to_save": ["o_proj"], **NO_INIT},
        f"{CUSTOM} 'Vanilla MLP 5 LoRA'",
    ),
    Case(
        "lora_modules_to_save_head",
        "LoRA",
        "LoraConfig",
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"], **NO_INIT},
        f"{CUSTOM} 'Vanilla MLP 5 LoRA' (lin1 -> lm_head)",
    ),
    Case(
        "lora_embedding",
        "LoRA",
        "LoraConfig",
        {"target_modules": ["embed_tokens", "q_proj"], **NO_INIT},
        f"{CUSTOM} 'Embedding + transformers Conv1D 3 LoRA'",
    ),
    Case(
        "lora_head",
        "LoRA",
        "LoraConfig",
        {"target_modules": ["lm_head", "q_proj"], **NO_INIT},
        f"{CUSTOM} 'Embedding + transformers Conv1D 3 LoRA' (emb -> lm_head)",
    ),
    Case(
        "lora_trainable_tokens",
        "LoRA + trainable tokens",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.0, "trainable_token_indices": [0, 1, 3], **NO_INIT},
        f"{DECODER} ALL_CONFIGS 'LoRA + trainable tokens' (lora_dropout 0)",
    ),
    Case(
        "lora_layers_to_transform",
        "LoRA",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.0, "layers_to_transform": [0], **NO_INIT},
        f"{COMMON} _test_training_layer_indexing",
    ),
    Case(
        "lora_two_adapters_one_active",
        "LoRA, 2 adapters",
        "LoraConfig",
        {"target_modules": ["q_proj"], **NO_INIT},
        f"{CUSTOM} MULTIPLE_ACTIVE_ADAPTERS 'LoRA Different'",
        second={"target_modules": ["v_proj"], **NO_INIT},
    ),
    Case(
        "lora_two_adapters_same",
        "LoRA, 2 adapters",
        "LoraConfig",
        {"target_modules": ["q_proj"], **NO_INIT},
        f"{CUSTOM} MULTIPLE_ACTIVE_ADAPTERS 'LoRA Same'",
        second={"target_modules": ["q_proj"], **NO_INIT},
        both_active=True,
    ),
    Case(
        "lora_two_adapters_different",
        "LoRA, 2 adapters",
        "LoraConfig",
        {"target_modules": ["q_proj"], **NO_INIT},
        f"{CUSTOM} MULTIPLE_ACTIVE_ADAPTERS 'LoRA Different'",
        second={"target_modules": ["v_proj"], **NO_INIT},
        both_active=True,
    ),
    Case(
        "lora_moe_experts_down",
        "LoRA (target_parameters)",
        "LoraConfig",
        {
            "task_type": "CAUSAL_LM",
            "target_modules": [],
            "lora_dropout": 0.0,
            "target_parameters": ["mlp.experts.down_proj"],
            **NO_INIT,
        },
        f"{TARGET_PARAMS} ALL_CONFIGS gpt-oss 'target down_proj'",
        family="qwen3_moe",
    ),
    Case(
        "lora_moe_experts_both",
        "LoRA (target_parameters)",
        "LoraConfig",
        {
            "task_type": "CAUSAL_LM",
            "r": 8,
            "lora_alpha": 32,
            "target_modules": None,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
            **NO_INIT,
        },
        f"{TARGET_PARAMS} ALL_CONFIGS gpt-oss 'down_proj and gate_up_proj on the same module'",
        family="qwen3_moe",
    ),
    Case(
        "lora_moe_experts_and_modules",
        "LoRA (target_parameters)",
        "LoraConfig",
        {
            "task_type": "CAUSAL_LM",
            "target_modules": ["q_proj", "v_proj"],
            "lora_dropout": 0.0,
            "target_parameters": ["mlp.experts.down_proj"],
            **NO_INIT,
        },
        f"{TARGET_PARAMS} ALL_CONFIGS gpt-oss 'q_proj, v_proj as modules, down_proj as parameter'",
        family="qwen3_moe",
    ),
    Case(
        "alora",
        "aLoRA",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.0, "alora_invocation_tokens": [INVOCATION_TOKEN], **NO_INIT},
        f"{DECODER} ALL_CONFIGS 'Activated LoRA' (lora_dropout 0)",
    ),
    Case(
        "alora_never_invoked",
        "aLoRA",
        "LoraConfig",
        {**LORA_DECODER, "lora_dropout": 0.0, "alora_invocation_tokens": [1000], **NO_INIT},
        f"{DECODER} ALL_CONFIGS 'Activated LoRA' [1000] (lora_dropout 0)",
    ),
    Case(
        "monteclora",
        "MonteCLoRA",
        "LoraConfig",
        {
            "target_modules": ["q_proj"],
            "monteclora_config": ("MontecloraConfig", {"num_samples": 2}),
        },
        f"{CUSTOM} 'Vanilla MLP 1 LoRA with Monteclora'",
        stochastic=True,
    ),
    # ---- other tuners --------------------------------------------------------------------------
    Case(
        "adalora",
        "AdaLoRA",
        "AdaLoraConfig",
        {"task_type": "CAUSAL_LM", "target_modules": None, "total_step": 1, **NO_INIT},
        f"{DECODER} ALL_CONFIGS AdaLoraConfig",
    ),
    Case(
        "ia3",
        "IA3",
        "IA3Config",
        {
            "task_type": "CAUSAL_LM",
            "target_modules": None,
            "feedforward_modules": None,
            "init_ia3_weights": False,
        },
        f"{DECODER} ALL_CONFIGS IA3Config",
    ),
    Case(
        "ia3_modules_to_save",
        "IA3",
        "IA3Config",
        {
            "target_modules": ["q_proj"],
            "modules_to_save": ["v_proj"],
            "feedforward_modules": ["q_proj"],
            "init_ia3_weights": False,
        },
        f"{CUSTOM} 'Vanilla MLP 9 IA3'",
    ),
    Case(
        "loha",
        "LoHa",
        "LoHaConfig",
        {"target_modules": ["q_proj", "v_proj"], "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 4 LOHA'",
    ),
    Case(
        "loha_module_dropout",
        "LoHa",
        "LoHaConfig",
        {"target_modules": ["q_proj"], "alpha": 4, "module_dropout": 0.1, "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 6 LOHA'",
        stochastic=True,
    ),
    Case(
        "loha_rank_dropout",
        "LoHa",
        "LoHaConfig",
        {"target_modules": ".*q_proj", "rank_dropout": 0.5, "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 7 LOHA'",
        stochastic=True,
    ),
    Case(
        "lokr",
        "LoKr",
        "LoKrConfig",
        {"target_modules": ["q_proj", "v_proj"], "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 4 LOKR'",
    ),
    Case(
        "lokr_decompose_both",
        "LoKr",
        "LoKrConfig",
        {"target_modules": ".*q_proj", "decompose_both": True, "r": 1, "alpha": 1, "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 8 LOKR'",
    ),
    Case(
        "lokr_module_dropout",
        "LoKr",
        "LoKrConfig",
        {"target_modules": ["q_proj"], "alpha": 4, "module_dropout": 0.1, "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 6 LOKR'",
        stochastic=True,
    ),
    Case(
        "lokr_rank_dropout",
        "LoKr",
        "LoKrConfig",
        {"target_modules": ".*q_proj", "rank_dropout": 0.5, "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 7 LOKR'",
        stochastic=True,
    ),
    Case(
        "vera",
        "VeRA",
        "VeraConfig",
        {
            "task_type": "CAUSAL_LM",
            "r": 8,
            "target_modules": None,
            "vera_dropout": 0.0,
            "projection_prng_key": 0xFF,
            "d_initial": 0.1,
            "save_projection": True,
            "bias": "none",
            "init_weights": False,
        },
        f"{DECODER} ALL_CONFIGS VeraConfig (vera_dropout 0)",
    ),
    Case(
        "vera_dropout",
        "VeRA",
        "VeraConfig",
        {
            "task_type": "CAUSAL_LM",
            "r": 8,
            "target_modules": None,
            "vera_dropout": 0.05,
            "projection_prng_key": 0xFF,
            "d_initial": 0.1,
            "save_projection": True,
            "bias": "none",
            "init_weights": False,
        },
        f"{DECODER} ALL_CONFIGS VeraConfig",
        stochastic=True,
    ),
    Case(
        "oft",
        "OFT",
        "OFTConfig",
        {"task_type": "CAUSAL_LM", "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS OFTConfig",
    ),
    Case(
        "oft_coft",
        "OFT",
        "OFTConfig",
        {
            "r": 2,
            "oft_block_size": 0,
            "target_modules": ["q_proj"],
            "coft": True,
            "eps": 1e-2,
            "init_weights": False,
        },
        f"{CUSTOM} 'Vanilla MLP 7 OFT'",
    ),
    Case(
        "oft_module_dropout",
        "OFT",
        "OFTConfig",
        {
            "r": 2,
            "oft_block_size": 0,
            "target_modules": ["q_proj"],
            "module_dropout": 0.1,
            "use_cayley_neumann": False,
            "init_weights": False,
        },
        f"{CUSTOM} 'Vanilla MLP 6 OFT'",
        stochastic=True,
    ),
    Case(
        "boft",
        "BOFT",
        "BOFTConfig",
        {"task_type": "CAUSAL_LM", "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS BOFTConfig",
    ),
    Case(
        "boft_dropout",
        "BOFT",
        "BOFTConfig",
        {"target_modules": ["v_proj"], "boft_block_size": 2, "boft_dropout": 0.1, "init_weights": False},
        f"{CUSTOM} 'Vanilla MLP 3 BOFT'",
        stochastic=True,
    ),
    Case(
        "hra",
        "HRA",
        "HRAConfig",
        {"task_type": "CAUSAL_LM", "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS HRAConfig",
    ),
    Case(
        "fourierft",
        "FourierFT",
        "FourierFTConfig",
        {"task_type": "CAUSAL_LM", "n_frequency": 10, "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS FourierFTConfig",
    ),
    Case(
        "vblora",
        "VBLoRA",
        "VBLoRAConfig",
        {
            "task_type": "CAUSAL_LM",
            "target_modules": None,
            "vblora_dropout": 0.0,
            "vector_length": 1,
            "num_vectors": 2,
        },
        f"{DECODER} ALL_CONFIGS VBLoRAConfig (vblora_dropout 0)",
    ),
    Case(
        "vblora_dropout",
        "VBLoRA",
        "VBLoRAConfig",
        {
            "task_type": "CAUSAL_LM",
            "target_modules": None,
            "vblora_dropout": 0.05,
            "vector_length": 1,
            "num_vectors": 2,
        },
        f"{DECODER} ALL_CONFIGS VBLoRAConfig",
        stochastic=True,
    ),
    Case(
        "c3a",
        "C3A",
        "C3AConfig",
        {"task_type": "CAUSAL_LM", "block_size": 1, "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS C3AConfig",
    ),
    Case(
        "miss",
        "MiSS",
        "MissConfig",
        {"task_type": "CAUSAL_LM", "target_modules": None, "r": 2, "init_weights": False},
        f"{DECODER} ALL_CONFIGS MissConfig",
    ),
    Case(
        "road",
        "RoAd",
        "RoadConfig",
        {"task_type": "CAUSAL_LM", "variant": "road_1", "group_size": 2, "init_weights": False},
        f"{DECODER} ALL_CONFIGS RoadConfig",
    ),
    Case(
        "shira",
        "SHiRA",
        "ShiraConfig",
        {"r": 1, "task_type": "CAUSAL_LM", "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS ShiraConfig",
    ),
    Case(
        "waveft",
        "WaveFT",
        "WaveFTConfig",
        {"task_type": "CAUSAL_LM", "n_frequency": 8, "target_modules": None, "init_weights": False},
        f"{DECODER} ALL_CONFIGS WaveFTConfig",
    ),
    Case("osf", "OSF", "OSFConfig", {"task_type": "CAUSAL_LM"}, f"{DECODER} ALL_CONFIGS OSFConfig"),
    Case(
        "ln_tuning",
        "LN tuning",
        "LNTuningConfig",
        {"target_modules": ["input_layernorm"]},
        f"{CUSTOM} 'LayerNorm 1 LNTuning'",
    ),
    Case(
        "prompt_tuning",
        "prompt tuning",
        "PromptTuningConfig",
        {"task_type": "CAUSAL_LM", "num_virtual_tokens": 10},
        f"{DECODER} ALL_CONFIGS PromptTuningConfig",
    ),
    Case(
        "prefix_tuning",
        "prefix tuning",
        "PrefixTuningConfig",
        {"task_type": "CAUSAL_LM", "num_virtual_tokens": 10},
        f"{DECODER} ALL_CONFIGS PrefixTuningConfig",
    ),
]
