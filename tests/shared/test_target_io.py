from dflash.target_model.files import default_target_layers


def test_default_layers_match_design_for_qwen3_8b():
    # docs/DESIGN.md §2: 36 layers, 5-layer drafter -> 1, 9, 17, 25, 33.
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]


def test_default_layers_stay_distinct_on_shallow_targets():
    for L in range(2, 12):
        for n in range(2, 6):
            layers = default_target_layers(L, n)
            assert layers == sorted(set(layers)), (L, n, layers)
            assert all(0 <= i < L for i in layers)
            assert len(layers) == min(n, L)


def test_default_layers_never_take_the_last_layer_when_they_can_avoid_it():
    # the engines capture the stream entering layer i + 1: the last layer's output cannot be served
    assert default_target_layers(4, 2) == [0, 2]
    for L in range(3, 40):
        for n in range(1, min(L, 6)):
            assert L - 1 not in default_target_layers(L, n), (L, n)
