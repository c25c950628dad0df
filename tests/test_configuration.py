"""The drafter's configuration (modeling/configuration_d3d.py: D3DConfig)."""

import pytest

from d3d_hf import D3DConfig


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        D3DConfig(block_size=0)
    with pytest.raises(ValueError, match="mask_token_id"):
        D3DConfig(vocab_size=10, mask_token_id=10)
    with pytest.raises(ValueError, match="source_layer_ids"):
        D3DConfig(num_hidden_layers=2, source_layer_ids=[0])
