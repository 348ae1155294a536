"""Every bad argument fails with a ValueError naming the argument and the rule."""
import pytest
import torch

import moeblaze


def test_top_k_exceeds_experts():
    with pytest.raises(ValueError, match=r"top_k \(9\) must be in \[1, num_experts = 8\]"):
        moeblaze.MoE(16, 8, 8, 9)


def test_bad_expert_id_named():
    x = torch.randn(4, 16)
    w1, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    ids = torch.tensor([[0, 1], [2, 3], [1, 7], [0, 2]])
    with pytest.raises(ValueError, match=r"expert id 7 of token 2 is out of range \[0, 4\)"):
        moeblaze.moe_experts(x, w1, w2, ids, torch.rand(4, 2))


def test_repeated_expert_named():
    x = torch.randn(2, 16)
    w1, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    ids = torch.tensor([[0, 1], [3, 3]])
    with pytest.raises(ValueError, match=r"expert id 3 is repeated in token 1"):
        moeblaze.moe_experts(x, w1, w2, ids, torch.rand(2, 2))


def test_nan_logits_named():
    moe = moeblaze.MoE(16, 8, 4, 2, dtype=torch.float32)
    x = torch.randn(3, 16)
    x[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"(?i)nan"):
        moe(x)


def test_dtype_mismatch():
    # (bf16 x with fp32 weights is the fp32-master-weights case: cast, see test_mixed_precision.)
    x = torch.randn(4, 16)
    w1, w2 = torch.randn(4, 16, 16, dtype=torch.bfloat16), torch.randn(4, 16, 8)
    with pytest.raises(ValueError, match=r"w1 has dtype torch.bfloat16 but x has torch.float32"):
        moeblaze.moe_experts(x, w1, w2, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1))


def test_unsupported_dtype():
    x = torch.randn(4, 16, dtype=torch.float64)
    w1, w2 = torch.randn(4, 16, 16).double(), torch.randn(4, 16, 8).double()
    with pytest.raises(ValueError, match=r"x has dtype torch.float64"):
        moeblaze.moe_experts(x, w1, w2, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1))


def test_shape_rule_from_cpp():
    x = torch.randn(4, 16)
    w1, w2 = torch.randn(4, 16, 12), torch.randn(4, 16, 8)  # w1 must be (E, 2n = 16, d = 16)
    with pytest.raises(ValueError, match=r"w1 must be \(E, w1_rows, d\) = \(4, 16, 16\)"):
        moeblaze.moe_experts(x, w1, w2, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1))


def test_bad_activation_and_router():
    with pytest.raises(ValueError, match="activation 'tanh'"):
        moeblaze.MoE(16, 8, 4, 2, activation="tanh")
    with pytest.raises(ValueError, match="router 'argmax'"):
        moeblaze.MoE(16, 8, 4, 2, router="argmax")
    with pytest.raises(ValueError, match="token_rounding 'nearest'"):
        moeblaze.MoE(16, 8, 4, 2, token_rounding="nearest")


def test_capi_error_code_and_message():
    from moeblaze import _lib
    import ctypes
    cfg = _lib.LayerCfg(4, 16, 8, 4, 9, 0, 1, 0, 0)
    nbytes = ctypes.c_uint64()
    rc = _lib.lib().moeblaze_layer_workspace_bytes(ctypes.byref(cfg), 8, 0, ctypes.byref(nbytes))
    assert rc == _lib.ERR_INVALID_ARGUMENT
    assert "top_k K (9) exceeds num_experts E (4)" in _lib.lib().moeblaze_last_error().decode()
