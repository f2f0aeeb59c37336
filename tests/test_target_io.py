from dflash.target.files import default_target_layers


def test_default_layers_match_design_for_qwen3_8b():
    # DESIGN section 2: 36 layers, 5-layer drafter -> 1, 9, 17, 25, 33.
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]


def test_default_layers_stay_distinct_on_shallow_targets():
    for L in range(2, 12):
        for n in range(2, 6):
            layers = default_target_layers(L, n)
            assert layers == sorted(set(layers)), (L, n, layers)
            assert all(0 <= i < L for i in layers)
            assert len(layers) == min(n, L)
