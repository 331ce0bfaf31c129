"""The config schema: reference defaults (spec sections 1, 3 and 5) and validation.

Every experiment config (configs/*.py) starts from `default_config()` and changes only
what differs. Keys are grouped by the module that consumes them. `validate_config`
checks the whole tree before anything is compiled and names the offending key.
"""

import ml_collections

from bov_jax.data.config import default_data_config


def value_path_config(
    source: str = "residual",
    combine: str = "replace",
    scale: str = "none",
    layers: str = "last_third",
    bank_shared: bool = False,
    bank_init: str = "aligned",
    fixed_coeff: float = 0.5,
) -> ml_collections.ConfigDict:
    """The value-path composition (see bov_jax/model/values.py).

    The defaults describe the baseline: every layer uses its own c_v(x).
    `fixed_coeff` is the constant on both terms of combine=add with scale=fixed
    (0.5 in the paper) and the constant on the source for combine=replace.
    """
    return ml_collections.ConfigDict(
        dict(
            source=source,
            combine=combine,
            scale=scale,
            layers=layers,
            bank_shared=bank_shared,
            bank_init=bank_init,
            fixed_coeff=fixed_coeff,
        )
    )


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.seed = 42

    m = c.model = ml_collections.ConfigDict()
    m.depth = 12
    m.aspect_ratio = 64
    m.head_dim = 128
    # 0 derives the width from depth * aspect_ratio rounded up to head_dim;
    # a positive value overrides it (small test and CPU models).
    m.model_dim = 0
    m.vocab_size = 32768
    m.pad_vocab_to = 64
    m.seq_len = 2048
    m.window_pattern = "SSSL"
    m.short_window = 0  # 0: ceil(seq_len / 4) rounded up to 128 (512 at 2048)
    m.rope_base = 100000.0
    m.qk_scale = 1.2
    m.mlp_ratio = 4
    m.smear_channels = 24
    m.logit_softcap = 15.0
    m.param_dtype = "float32"
    # "auto": bfloat16 on accelerators, float32 on CPU; cuDNN attention on GPUs, else XLA.
    m.compute_dtype = "auto"
    m.attention_impl = "auto"  # auto | xla | cudnn
    m.value_path = value_path_config()

    o = c.optim = ml_collections.ConfigDict()
    o.embedding_lr = 0.3
    o.unembedding_lr = 0.008
    o.matrix_lr = 0.02
    o.scalar_lr = 0.5
    o.smear_lr = 0.2
    o.value_table_lr_mult = 0.5
    o.alpha_lr_mult = 0.01
    o.weight_decay = 0.28
    # The reference scales Muon's weight decay by sqrt(B / B_ref) * D_ref / D (spec 3.4), with
    # the d12 model as anchor; far from that size (tiny CPU models) the rule gives decays > 1.
    o.scale_weight_decay = True
    o.adam_eps = 1e-10
    o.embedding_betas = (0.8, 0.995)
    o.unembedding_betas = (0.8, 0.96)
    o.value_table_betas = (0.8, 0.995)
    o.smear_betas = (0.8, 0.95)
    o.alpha_betas = (0.8, 0.95)
    o.beta_betas = (0.96, 0.95)
    o.embedding_wd = 0.001
    o.unembedding_wd = 0.01
    o.value_table_wd = 0.01
    o.alpha_wd = 0.05
    o.muon_ns_steps = 5
    o.muon_beta2 = 0.9
    o.muon_momentum_start = 0.85
    o.muon_momentum = 0.97
    o.muon_momentum_end = 0.90
    o.muon_momentum_warmup_steps = 400
    o.warmup_steps = 40
    o.warmdown_ratio = 0.65
    o.final_lr_frac = 0.05
    o.reference_d_model = 768
    o.reference_batch_tokens = 2**19

    t = c.train = ml_collections.ConfigDict()
    # Horizon precedence (spec 3.4): num_steps > target_flops > target_tokens >
    # target_param_data_ratio (which, like the reference, also anchors the auto batch size).
    t.num_steps = -1
    t.target_flops = -1.0
    t.target_tokens = -1
    t.target_param_data_ratio = 10.5
    t.total_batch_tokens = -1  # -1: the auto batch-size rule
    t.device_batch_size = 32
    t.stop_after_steps = -1  # end this invocation early (scheduler chunks)
    # Independent data streams (0: one per process). The data order depends on this number
    # only, so fixing it lets a run resume on another process count.
    t.data_streams = 0
    t.log_every = 1
    t.eval_every = 250
    t.eval_tokens = 80 * 2**19
    t.sample_every = 2000
    t.sample_tokens = 32  # a greedy sample every sample_every steps and at the end; 0: none
    # CORE at the end of training into WORKDIR/evals/core_step<N>.json (bundle: BOV_EVAL_BUNDLE,
    # default ~/.cache/bov_jax/eval_bundle): 0 off, N > 0 at most N examples per task, -1 all.
    t.core_at_end = 0
    t.skip_nonfinite = False
    t.profile_start_step = -1
    t.profile_num_steps = 0
    t.dump_hlo = False

    mesh = c.mesh = ml_collections.ConfigDict()
    mesh.data = -1  # -1: all devices not used by the other axes
    mesh.fsdp = 1
    mesh.tensor = 1

    ck = c.checkpoint = ml_collections.ConfigDict()
    ck.save_every = 0  # 0: only at the end
    ck.keep = 2
    ck.async_save = True
    ck.fallback = False  # resume from the previous checkpoint if the latest one is damaged
    # A workdir or step directory to take the parameters from (fine-tuning; optimizer, step and
    # data start fresh). Used only while this workdir has no checkpoint of its own.
    ck.init_params_from = ""

    c.data = default_data_config()
    return c


def _key_paths(tree: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    paths = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            paths.update(_key_paths(value, path + "."))
        else:
            paths[path] = value
    return paths


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Check a config against the schema before anything is compiled.

    Raises ValueError naming every unknown or missing key, and any key whose value is
    out of range (the model keys through ModelSpec, the horizon through the plan).
    """
    from bov_jax.accounting import training_plan

    given, known = _key_paths(config), _key_paths(default_config())
    unknown = sorted(set(given) - set(known))
    missing = sorted(set(known) - set(given))
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown config keys: {', '.join(unknown)}")
        if missing:
            parts.append(f"missing config keys: {', '.join(missing)}")
        raise ValueError("; ".join(parts))
    t = config.train
    for key in ("device_batch_size", "log_every", "eval_every", "sample_every"):
        if t[key] <= 0:
            raise ValueError(f"train.{key}={t[key]}; expected a positive integer")
    if t.sample_tokens < 0:
        raise ValueError(f"train.sample_tokens={t.sample_tokens}; expected >= 0 (0: no samples)")
    if t.core_at_end < -1:
        raise ValueError(
            f"train.core_at_end={t.core_at_end}; expected 0 (off), N > 0 (examples per task) "
            "or -1 (all)"
        )
    for key in ("data", "fsdp", "tensor"):
        if config.mesh[key] == 0 or config.mesh[key] < -1:
            raise ValueError(f"mesh.{key}={config.mesh[key]}; expected -1 (fill) or >= 1")
    if config.checkpoint.keep < 1:
        raise ValueError(f"checkpoint.keep={config.checkpoint.keep}; expected >= 1")
    training_plan(config)  # resolves the model spec, horizon and batch size
