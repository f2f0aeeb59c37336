"""The recipe study's configs (bench/recipe_study.py, docs/RECIPE.md): each a name for train-section overrides,
one factor at a time from a setup's base, and the setup bases themselves."""

from __future__ import annotations

# name -> overrides of params.yaml's train section (target_layers picks the store)
CONFIGS: dict[str, dict] = {
    "base": {},
    "lr6e-4": {"lr": 6e-4},
    "lr1e-3": {"lr": 1e-3},
    "anchors512": {"num_anchors": 512},
    "anchors512_bb4096": {"num_anchors": 512, "block_budget": 4096},
    "anchors512_bb8192": {"num_anchors": 512, "block_budget": 8192},
    "anchors256_bb8192": {"num_anchors": 256, "block_budget": 8192},
    "bb8192": {"block_budget": 8192},
    "beta2_0.999": {"betas": [0.9, 0.999]},
    "wd0.01": {"weight_decay": 0.01},
    "minlr0": {"min_lr_ratio": 0.0},
    "gamma7": {"gamma": 7.0},
    "kd0.5": {"kd_weight": 0.5},
    "rows2": {"rows_per_batch": 2},
    "tb4096": {"token_budget": 4096, "block_budget": 4096},
    "layers03": {"target_layers": [0, 3]},
    "peer": {"lr": 6e-4, "num_anchors": 512, "block_budget": 8192, "betas": [0.9, 0.999], "weight_decay": 0.01,
             "min_lr_ratio": 0.0},
    "base_1500": {"steps": 1500},  # the baseline at the FLOPs of bb8192's 500 steps
    "bb8192_lr6e-4": {"block_budget": 8192, "lr": 6e-4},
    "bb8192_beta2_0.999": {"block_budget": 8192, "betas": [0.9, 0.999]},
    "bb16384": {"block_budget": 16384},
    "peer_lr2e-3": {"lr": 2e-3, "num_anchors": 512, "block_budget": 8192, "betas": [0.9, 0.999],
                    "weight_decay": 0.01, "min_lr_ratio": 0.0},
    # lr against the older 2e-3 (params.yaml's lr is 6e-4: "base" and "bb8192" above run at 6e-4)
    "base_1500_lr2e-3": {"steps": 1500, "lr": 2e-3},  # setup b: against bb8192 at lr 2e-3
    "bb8192_lr2e-3": {"block_budget": 8192, "lr": 2e-3},
    "base_3000": {"steps": 3000},  # the FLOPs of bb8192's 1000 steps
    "bb8192_1000": {"block_budget": 8192, "steps": 1000},
    "base_2000": {"steps": 2000},  # the FLOPs of the peer recipe's 500 steps
    "ga2": {"grad_accum": 2},  # 2 micro-batches per step: loss normalised over the step (the default)
    "ga2_micro": {"grad_accum": 2, "loss_norm": "micro_batch"},  # ... each micro-batch its own mean, averaged
    "ga4": {"grad_accum": 4},
    "ga4_micro": {"grad_accum": 4, "loss_norm": "micro_batch"},
    # drafter init, equal GPU-seconds, data workers
    "init_target": {"drafter_init": "target"},  # the drafter's layers start as the target's last layers
    "init_target_1000": {"drafter_init": "target", "steps": 1000},
    "base_1000": {"steps": 1000},  # ~ the peer recipe's 500 steps in GPU-seconds (50 s alone)
    "base_w4": {"num_workers": 4},  # GPU-seconds alone with 4 DataLoader workers instead of params.yaml's 1
    "peer_w4": {"lr": 6e-4, "num_anchors": 512, "block_budget": 8192, "betas": [0.9, 0.999], "weight_decay": 0.01,
                "min_lr_ratio": 0.0, "num_workers": 4},
    # tau at equal GPU-seconds with 4 DataLoader workers (each run alone on the device)
    "bb8192_w4": {"block_budget": 8192, "num_workers": 4},
    "base_1000_w4": {"steps": 1000, "num_workers": 4},
    "peer_1000_w4": {"lr": 6e-4, "num_anchors": 512, "block_budget": 8192, "betas": [0.9, 0.999],
                     "weight_decay": 0.01, "min_lr_ratio": 0.0, "num_workers": 4, "steps": 1000},
    # setup c (base cli5: block 16, 5 layers, token budget = block budget 4096, 1 row per batch)
    "c_base": {},  # the CLI's defaults for a real target, at README's 8B layer count
    "c_l1": {"num_layers": 1},  # the CLI's first --num-layers default
    "c_l3": {"num_layers": 3},  # the CLI's --num-layers default
    "c_b8": {"block_size": 8},  # gamma follows the block (4); the block budget then holds 2x the blocks
    "c_rows4": {"rows_per_batch": 4},  # README's 8B example: 4 packed rows per micro-batch
    "c_bb16384": {"block_budget": 16384},  # 4x the block tokens per row: more samples per row
    "c_peer": {"num_anchors": 512, "block_budget": 16384, "betas": [0.9, 0.999], "weight_decay": 0.01,
               "min_lr_ratio": 0.0},  # the peer recipe at this shape (block budget 4x the token budget, as on a)
    "c_lr3e-4": {"lr": 3e-4},
    "c_lr1.2e-3": {"lr": 1.2e-3},
    "c_2x": {"steps": 2000},  # the base for 2x the steps (needs --steps 1000 for the others)
    "c_base_1000": {"steps": 1000},  # the base for 2x the steps of --steps 500
    # 3 layers past 500 steps, and at the 5-layer run's GPU-seconds (0.68x the step: 1500 ~ 1000 x 5 layers)
    "c_l3_1000": {"num_layers": 3, "steps": 1000},
    "c_l3_1500": {"num_layers": 3, "steps": 1500},
    "c_l3_b8": {"num_layers": 3, "block_size": 8},  # block 8 at the default depth (online tau and speed-up decide)
}

# name -> train-section overrides for every config of a setup that names it (NAME:TARGET:TRAIN:HELDOUT:BASE)
SETUP_BASES: dict[str, dict] = {
    # the CLI's own defaults (docs/OPTIONS.md) where params.yaml differs, at 5 layers (README's 8B example when
    # the study ran; the CLI's --num-layers default was then 1, config c_l1, and is 3 since, config c_l3);
    # num_workers 2 = the CLI's default
    "cli5": {"block_size": 16, "num_layers": 5, "token_budget": 4096, "block_budget": None, "num_workers": 2},
}
