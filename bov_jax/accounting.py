"""FLOPs, parameter counts, training horizon and LR/WD scaling (spec sections 3.4 and 4).

One function, `training_plan(config)`, is used by the trainer (horizon, batch size,
LR scaling), the step logs (MFU numerator) and the CLI:

  python -m bov_jax.accounting --config=configs/d24_bov.py [--config.train.target_flops=3.91e19]

FLOPs per token = 6 * (matmul parameters) + sum over layers of 12 * H * hd * min(window, T):
embedding and bank lookups and scalar coefficients cost nothing, a BoV/V1 target layer's
value projection is gone, and a second c_v call (x0 source with combine=add) counts twice.
Parameter counts are given both as the model holds them and in the reference's convention,
which still counts the dead c_v of BoV/V1 target layers (it sets the scaling-param horizon).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from bov_jax.model import layers
from bov_jax.model.spec import ModelSpec
from bov_jax.model.values import GATE_CHANNELS

REFERENCE_DEPTH = 12
# Counts and horizons depend on sizes, not on dtypes or attention kernels; resolving `auto`
# for a fixed platform keeps accounting from starting a device backend (a sweep's or a
# report's process must not take the GPU its training jobs need).
COUNTING_PLATFORM = "cpu"


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by group (reference names, spec 4 `num_scaling_params`)."""

    wte: int
    lm_head: int
    transformer_matrices: int  # every block parameter, dead c_v and coefficients included
    scalars: int  # smear gate and lambda
    value_embeds: int  # banks, a shared table once
    dead_value_proj: int  # c_v of target layers that do not use it (not in the model)
    coefficients: int  # gamma / alpha / beta
    flop_matmul: int  # parameters multiplied per token, extra c_v calls included

    @property
    def total_reference(self) -> int:
        return (
            self.wte + self.lm_head + self.transformer_matrices + self.scalars + self.value_embeds
        )

    @property
    def total(self) -> int:
        """Parameters the model really holds (no dead c_v)."""
        return self.total_reference - self.dead_value_proj

    @property
    def scaling(self) -> int:
        return self.transformer_matrices + self.lm_head


def param_counts(spec: ModelSpec) -> ParamCounts:
    d, kv, vp = spec.d_model, spec.kv_dim, spec.value_path
    hidden = spec.mlp_ratio * d
    per_block = 3 * d * kv + kv * d + 2 * d * hidden  # c_q, c_k, c_v, c_proj, c_fc, c_proj
    targets = spec.targets
    coefficients = sum(len(vp.coefficient_names(True)) for _ in targets)
    gates = GATE_CHANNELS * spec.n_head * len(targets) if vp.combine == "gated_add" else 0
    dead = sum(d * kv for i in targets if not vp.owns_projection(True))
    extra_calls = sum(
        (vp.projection_calls(True) - 1) * d * kv for i in targets if vp.projection_calls(True) > 1
    )
    n_tables = (1 if vp.bank_shared else len(targets)) if vp.uses_bank else 0
    matrices = spec.n_layer * per_block + coefficients + gates
    lm_head = spec.padded_vocab * d
    return ParamCounts(
        wte=spec.padded_vocab * d,
        lm_head=lm_head,
        transformer_matrices=matrices,
        scalars=spec.smear_channels + 1,
        value_embeds=n_tables * spec.padded_vocab * kv,
        dead_value_proj=dead,
        coefficients=coefficients,
        flop_matmul=spec.n_layer * per_block - dead + gates + extra_calls + lm_head,
    )


def attention_flops_per_token(spec: ModelSpec) -> int:
    """12 * H * hd * min(window + ... , T) summed over layers (spec 4; window 512 or T)."""
    return sum(12 * spec.n_head * spec.head_dim * min(w, spec.seq_len) for w in spec.windows)


def xla_attention_flops_per_token(spec: ModelSpec) -> float:
    """What the "xla" attention computes (`layers.blocked_attention`): 12 * H * hd * (scores
    per head) / T summed over layers; the paper's count takes min(window, T) scores a query."""
    return sum(
        12 * spec.n_head * spec.head_dim * layers.scored_pairs(spec.seq_len, w) / spec.seq_len
        for w in spec.windows
    )


def flops_per_token(spec: ModelSpec) -> int:
    return 6 * param_counts(spec).flop_matmul + attention_flops_per_token(spec)


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    flops_per_token: int
    params: ParamCounts
    total_batch_tokens: int
    auto_batch_prediction: float
    num_steps: int
    horizon_source: str
    batch_lr_scale: float
    dmodel_lr_scale: float
    muon_weight_decay: float

    @property
    def tokens(self) -> int:
        return self.num_steps * self.total_batch_tokens

    @property
    def total_flops(self) -> float:
        return float(self.tokens) * self.flops_per_token

    def summary(self) -> dict[str, Any]:
        p = self.params
        return {
            "flops_per_token": self.flops_per_token,
            "params_total": p.total,
            "params_total_reference": p.total_reference,
            "params_scaling": p.scaling,
            "params_by_group": {
                "wte": p.wte,
                "lm_head": p.lm_head,
                "transformer_matrices": p.transformer_matrices,
                "scalars": p.scalars,
                "value_embeds": p.value_embeds,
                "dead_value_proj": p.dead_value_proj,
            },
            "num_steps": self.num_steps,
            "horizon_source": self.horizon_source,
            "total_batch_tokens": self.total_batch_tokens,
            "auto_batch_prediction": round(self.auto_batch_prediction, 1),
            "tokens": self.tokens,
            "tokens_per_scaling_param": self.tokens / p.scaling,
            "total_flops": self.total_flops,
            "batch_lr_scale": self.batch_lr_scale,
            "dmodel_lr_scale": self.dmodel_lr_scale,
            "muon_weight_decay": self.muon_weight_decay,
        }


def reference_spec(config: Any) -> ModelSpec:
    """The depth-12 model of the same family: the anchor of the batch-size rule (spec 3.4)."""
    m = config.model.copy_and_resolve_references()
    m.depth = REFERENCE_DEPTH
    m.model_dim = 0
    return ModelSpec.from_config(m, COUNTING_PLATFORM)


def training_plan(config: Any) -> TrainingPlan:
    """Resolve horizon, batch size and LR/WD scaling from a full config (spec 3.4)."""
    spec = ModelSpec.from_config(config.model, COUNTING_PLATFORM)
    t, o = config.train, config.optim
    params = param_counts(spec)
    fpt = flops_per_token(spec)
    ratio = t.target_param_data_ratio
    if ratio == 0:
        raise ValueError("train.target_param_data_ratio must be non-zero (its sign cancels)")
    target_tokens = int(ratio * params.scaling)
    d_ref = ratio * param_counts(reference_spec(config)).scaling
    b_ref = o.reference_batch_tokens
    prediction = b_ref * (target_tokens / d_ref) ** 0.383
    batch = t.total_batch_tokens if t.total_batch_tokens > 0 else 2 ** round(math.log2(prediction))
    if t.num_steps > 0:
        steps, source = t.num_steps, "train.num_steps"
    elif t.target_flops > 0:
        steps, source = round(t.target_flops / (fpt * batch)), "train.target_flops"
    elif t.target_tokens > 0:
        steps, source = round(t.target_tokens / batch), "train.target_tokens"
    else:
        steps, source = target_tokens // batch, "train.target_param_data_ratio"
    if steps <= 0:
        raise ValueError(f"the horizon from {source} gives {steps} steps; expected at least 1")
    return TrainingPlan(
        flops_per_token=fpt,
        params=params,
        total_batch_tokens=batch,
        auto_batch_prediction=prediction,
        num_steps=steps,
        horizon_source=source,
        batch_lr_scale=math.sqrt(batch / b_ref),
        dmodel_lr_scale=(spec.d_model / o.reference_d_model) ** -0.5,
        muon_weight_decay=(
            o.weight_decay * math.sqrt(batch / b_ref) * (d_ref / target_tokens)
            if o.scale_weight_decay
            else o.weight_decay
        ),
    )


def evaluation_cost(config: Any, plan: TrainingPlan) -> dict[str, Any]:
    """What the in-training val BPB evals cost over the whole horizon.

    Evals run at step 0, every train.eval_every steps and at the end, each over
    max(1, eval_tokens // seq_len) rows. An eval is a forward pass: 1/3 of a training token's
    FLOPs (2N + the forward third of attention against 6N + attention), so the share of the
    training compute is eval tokens / (3 x training tokens).
    """
    t, seq_len = config.train, config.model.seq_len
    evals = plan.num_steps // t.eval_every + 1 + (plan.num_steps % t.eval_every > 0)
    tokens = evals * max(1, t.eval_tokens // seq_len) * seq_len
    return {
        "evals": evals,
        "eval_every": t.eval_every,
        "tokens_per_eval": max(1, t.eval_tokens // seq_len) * seq_len,
        "eval_tokens_total": tokens,
        "compute_share": tokens / (3 * plan.tokens),
    }


def xla_cross_check(config: Any, rows: int = 2) -> dict[str, Any]:
    """XLA's cost_analysis() FLOPs of the compiled forward+backward next to the analytic count.

    Compiles the loss gradient of the configured model at its sequence length for `rows`
    sequences (use small shapes on CPU). The comparable analytic figure counts the attention
    scores the "xla" attention computes (`xla_attention_flops_per_token`: blocks of queries,
    not the paper's min(window, T) per query); elementwise work (norms, softmax, rotary) adds a
    little on XLA's side. Layers are unrolled here, so no scanned body is under-counted.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bov_jax.model.gpt import GPT, cross_entropy

    spec = ModelSpec.from_config(config.model)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(spec, seed=0)), nnx.Param)
    tokens = jax.ShapeDtypeStruct((rows, spec.seq_len), jnp.int32)

    def loss(p, ids):
        return cross_entropy(nnx.merge(graphdef, p)(ids), ids)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla = cost["flops"] / (rows * spec.seq_len)
    comparable = 6 * param_counts(spec).flop_matmul + xla_attention_flops_per_token(spec)
    return {
        "analytic_flops_per_token": flops_per_token(spec),
        "analytic_as_computed": comparable,
        "xla_flops_per_token": xla,
        "xla_over_comparable": xla / comparable,
        "note": "as computed: the attention scores of the blocked XLA attention; XLA also "
        "counts elementwise ops, and a lax.scan body would be counted once",
    }


def main(argv: list[str]) -> None:
    from absl import flags

    config = flags.FLAGS.config
    plan = training_plan(config)
    summary = {**plan.summary(), "evaluation": evaluation_cost(config, plan)}
    if flags.FLAGS.xla:
        summary["xla"] = xla_cross_check(config)
    print(json.dumps(summary, indent=2))


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    from absl import flags
    from ml_collections import config_flags

    # Not bov_jax.config's flag: it imports this module (to resolve the horizon). A config
    # file that does not load is still one line (cli.parse_flags).
    config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
    flags.DEFINE_bool("xla", False, "Also compile the model and print XLA's FLOPs count.")


if __name__ == "__main__":
    from bov_jax import cli

    define_flags()
    cli.run(main)
