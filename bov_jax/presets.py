"""Named presets: one per row of the paper's tables (spec 2.5).

Each preset is a depth plus a value-path composition; `config_for(name)` turns it into
a full config. `python -m bov_jax.presets` lists them with the paper row they reproduce
and the reference's `--model-type`.

  configs/d12.py, d12_bov.py, d24.py, d24_bov.py    the four headline configs
  configs/ablations.py:<name>                        any preset below
"""

from __future__ import annotations

import dataclasses

import ml_collections

from bov_jax import cli
from bov_jax.config import AUTO_DEVICE_ROWS, default_config
from bov_jax.errors import ConfigError
from bov_jax.model.values import ValuePathSpec

# The paper's compute budgets (spec 2.5): the d12 rows (Table 1, Fig. 5(b)) run at 1.5e18 FLOPs;
# the d24 baseline and BoV exist at 100B tokens (Table 2) and at 3.91e19 FLOPs (Table 3); the
# other d24 rows exist only at 3.91e19 FLOPs (Tables 3 and 5).
D12_TARGET_FLOPS = 1.5e18
D24_TARGET_TOKENS = 100_000_000_000
D24_ABLATION_FLOPS = 3.91e19
# runs/ablations.sh evaluates val BPB every 50 steps (spec 6.3) on 80 x 2^19 = 41.9M tokens:
# 0.8 eval tokens per training token at batch 2^20, +27% of the training compute (forward
# passes: a third of a training token's FLOPs; `python -m bov_jax.accounting` prints it). The
# paper's curves (Tables 1 and 3, Fig. 5(b): the ablations) come from that cadence, so every
# preset keeps it ...
PAPER_EVAL_EVERY = 50
# ... except d24 / d24_bov on the 100B-token horizon (Table 2: final BPB and CORE only), a
# multi-day run: every 500 steps is 192 evals, +2.7% compute (pass
# --config.train.eval_every=50 for the authors' cadence; configs/sweeps/table3.py does, at
# 3.91e19 FLOPs).
D24_MAIN_EVAL_EVERY = 500
# d24 runs checkpoint every 1000 steps: ~30 min of an 8-GPU node at d24 (about 1.7 s per
# step of 2^20 tokens), so a crash or preemption loses at most that; each checkpoint is
# 8.6 GB for d24_bov (6.3 GB for d24: fp32 parameters, bf16 tables and the optimizer state),
# written in the background (checkpoint.keep=2 holds two).
D24_SAVE_EVERY = 1000


@dataclasses.dataclass(frozen=True)
class Budget:
    """A training horizon: one of target_flops / target_tokens (the other stays unset)."""

    target_flops: float = -1.0
    target_tokens: int = -1

    def describe(self) -> str:
        if self.target_tokens > 0:
            return f"{self.target_tokens / 1e9:g}B tokens"
        return f"{self.target_flops:.3g} FLOPs".replace("e+", "e")


D12_BUDGET = Budget(target_flops=D12_TARGET_FLOPS)
D24_MAIN_BUDGET = Budget(target_tokens=D24_TARGET_TOKENS)
D24_ABLATION_BUDGET = Budget(target_flops=D24_ABLATION_FLOPS)


@dataclasses.dataclass(frozen=True)
class Preset:
    depth: int
    paper: str
    reference: str  # the authors' --model-type (arch_d{depth}_<reference>)
    value_path: ValuePathSpec
    budget: Budget


def _d12(paper: str, reference: str, **value_path) -> Preset:
    return Preset(12, paper, reference, ValuePathSpec(**value_path), D12_BUDGET)


def _d24(paper: str, reference: str, budget: Budget = D24_ABLATION_BUDGET, **value_path) -> Preset:
    return Preset(24, paper, reference, ValuePathSpec(**value_path), budget)


BANK = dict(source="bank", combine="replace", scale="learned")

PRESETS: dict[str, Preset] = {
    # Table 1 (d12, val BPB): Output / Target / Coeff.
    "d12": _d12("Table 1 row 1: V / - / -", "gpt_base"),
    "d12_v_learn": _d12(
        "Table 1 row 2: V / last 4 / gamma", "gpt_base_v_scale_learn", scale="learned"
    ),
    "d12_v1_every_layer": _d12(
        "Table 1 row 3: V1 / all 12 / 1 (targets 1..11)",
        "gpt_base_v_from_v1_every_layer",
        source="v1",
        layers="all",
    ),
    "d12_v1_learn_every2": _d12(
        "Table 1 row 4: V1 / every 2 / gamma",
        "gpt_base_v_from_v1_learn_every2",
        source="v1",
        scale="learned",
        layers="every_other",
    ),
    "d12_v1": _d12("Table 1 row 5: V1 / last 4 / 1", "gpt_base_v_from_v1", source="v1"),
    "d12_v1_learn": _d12(
        "Table 1 row 6: V1 / last 4 / gamma",
        "gpt_base_v_from_v1_learn",
        source="v1",
        scale="learned",
    ),
    "d12_x0_learn_every2": _d12(
        "Table 1 row 7: x0WV / every 2 / gamma",
        "gpt_base_v_from_x0_learn_every2",
        source="x0",
        scale="learned",
        layers="every_other",
    ),
    "d12_x0": _d12("Table 1 row 8: x0WV / last 4 / 1", "gpt_base_v_from_x0", source="x0"),
    "d12_x0_learn": _d12(
        "Table 1 row 9: x0WV / last 4 / gamma",
        "gpt_base_v_from_x0_learn",
        source="x0",
        scale="learned",
    ),
    "d12_add_v1": _d12(
        "Table 1 row 10: V+V1 / last 4 / 0.5",
        "gpt_base_add_init_v",
        source="v1",
        combine="add",
        scale="fixed",
    ),
    "d12_add_v1_learn": _d12(
        "Table 1 row 11: V+V1 / last 4 / alpha, beta",
        "gpt_base_add_init_v_learn",
        source="v1",
        combine="add",
        scale="learned",
    ),
    "d12_add_x0": _d12(
        "Table 1 row 12: V+x0WV / last 4 / 0.5",
        "gpt_base_add_init_res_v",
        source="x0",
        combine="add",
        scale="fixed",
    ),
    "d12_add_x0_learn": _d12(
        "Table 1 row 13: V+x0WV / last 4 / alpha, beta",
        "gpt_base_add_init_res_v_learn",
        source="x0",
        combine="add",
        scale="learned",
    ),
    # Figure 5(b) (d12 BoV component ablation).
    "d12_bov": _d12("Fig. 5(b): BoV", "gpt_base_v_from_value_emb_learn", **BANK),
    "d12_bov_no_coeff": _d12("Fig. 5(b): no coeff.", "gpt_base_v_from_value_emb", source="bank"),
    "d12_bov_every_layer": _d12(
        "Fig. 5(b): every layer (12 tables)",
        "gpt_base_v_from_value_emb_learn_every_layer",
        **BANK,
        layers="all",
    ),
    "d12_bov_shared": _d12(
        "Fig. 5(b): shared table",
        "gpt_base_v_from_value_emb_learn_shared",
        **BANK,
        bank_shared=True,
    ),
    "d12_bov_add_v": _d12(
        "Fig. 5(b): add V (inferred: alpha V + beta E)",
        "gpt_base_add_init_value_emb_learn",
        source="bank",
        combine="add",
        scale="learned",
    ),
    # d24 (val BPB / CORE): Table 2 at 100B tokens (baseline, BoV; also rows 1-2 of Table 3
    # with --config.train.target_flops=3.91e19), Tables 3 and 5 at 3.91e19 FLOPs.
    "d24": _d24("Table 2 row 1: baseline (Table 3 row 1 at 3.91e19)", "gpt_base", D24_MAIN_BUDGET),
    "d24_bov": _d24(
        "Table 2 row 2: BoV (Table 3 row 2 at 3.91e19)",
        "gpt_base_v_from_value_emb_learn",
        D24_MAIN_BUDGET,
        **BANK,
    ),
    "d24_x0_learn": _d24(
        "Table 3 row 3: x0WV / gamma", "gpt_base_v_from_x0_learn", source="x0", scale="learned"
    ),
    "d24_v1_learn": _d24(
        "Table 3 row 4: V1 / gamma", "gpt_base_v_from_v1_learn", source="v1", scale="learned"
    ),
    "d24_v1_every_layer": _d24(
        "Table 3 row 5: V1 every layer (SVFormer-like, 1..23)",
        "gpt_base_v_from_v1_every_layer",
        source="v1",
        layers="all",
    ),
    "d24_ve_gated": _d24(
        "Tables 3/5: V + E_v[i] (modded-nanogpt style)",
        "gpt_base_add_init_value_emb_nanogpt_every2",
        source="bank",
        combine="gated_add",
        layers="every_other",
        bank_init="uniform",
    ),
}


def config_for(name: str) -> ml_collections.ConfigDict:
    """The full config of a preset: reference defaults plus depth, value path, horizon."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    config = default_config()
    config.name = name
    config.model.depth = preset.depth
    config.model.value_path.update(dataclasses.asdict(preset.value_path))
    config.train.target_flops = preset.budget.target_flops
    config.train.target_tokens = preset.budget.target_tokens
    config.train.eval_every = (
        D24_MAIN_EVAL_EVERY if preset.budget == D24_MAIN_BUDGET else PAPER_EVAL_EVERY
    )
    config.train.device_batch_size = AUTO_DEVICE_ROWS  # the compiled rows for the chip
    if preset.depth == 24:
        config.checkpoint.save_every = D24_SAVE_EVERY
    return config


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    width = max(map(len, PRESETS))
    print(f"{'preset':{width}}  {'paper row':52}  {'budget':15}  reference --model-type")
    for name, p in PRESETS.items():
        print(f"{name:{width}}  {p.paper:52}  {p.budget.describe():15}  {p.reference}")
    print(
        "\nRun one with: python -m bov_jax.main --config=configs/ablations.py:<preset> "
        "--workdir=runs/<preset> (the d12/d24 headline presets also have configs/<preset>.py; "
        "configs/quickstart.py:<preset> gives a preset's value path on the small CPU model)."
    )


if __name__ == "__main__":
    cli.run(main)
