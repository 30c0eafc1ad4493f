from __future__ import annotations

import pytest
import yaml

from megatron_mok.config import (
    MokConfigError,
    bundled_configs,
    load_config,
    min_minibatch_tokens,
    parse_config,
    resolve_config,
    set_active_config,
)
from megatron_mok.testing import moe_transformer_config

GOOD = {
    "model": {"name": "m", "hidden_size": 256, "moe_ffn_hidden_size": 128, "num_moe_experts": 8, "moe_router_topk": 2},
    "kernel": {"dtype": "bf16", "comm_sms": 16, "ring_slots": 3, "minibatch_tokens": 128},
}


def _with(section: str, **changes):
    raw = {k: dict(v) for k, v in GOOD.items()}
    raw[section].update(changes)
    return raw


def test_bundled_configs_cover_the_required_architectures():
    names = set(bundled_configs())
    assert {"kimi-k2", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "tiny-test"} <= names
    k2 = load_config("kimi-k2")
    assert (k2.model.hidden_size, k2.model.moe_ffn_hidden_size, k2.model.num_moe_experts, k2.model.moe_router_topk) == (
        7168,
        2048,
        384,
        8,
    )
    assert k2.model.moe_shared_expert_intermediate_size == 2048
    dsv3 = load_config("deepseek-v3")
    assert (dsv3.model.num_moe_experts, dsv3.model.moe_router_topk) == (256, 8)
    for name in names:
        cfg = load_config(name)
        assert cfg.kernel.comm_sms + cfg.kernel.compute_sms == cfg.kernel.num_sms
        assert cfg.kernel.minibatch_tokens % cfg.kernel.minibatch_align == 0


def test_two_wave_rule_reproduces_the_published_kimi_minibatch():
    # MoK: hidden 7168 / ffn 2048 needs ~2368 tokens (148 compute SMs, 128x256 tiles)
    assert min_minibatch_tokens(2048, 148, 128, 256) == 2368
    # and the derived value is used when the YAML leaves minibatch_tokens out or 'auto'
    q = load_config("qwen3-235b-a22b")
    assert q.kernel.minibatch_tokens == min_minibatch_tokens(1536, q.kernel.compute_sms)
    raw = _with("kernel")
    del raw["kernel"]["minibatch_tokens"]
    assert parse_config(raw).kernel.minibatch_tokens == min_minibatch_tokens(128, 132 - 16)


@pytest.mark.parametrize(
    "section,key,value,needle",
    [
        ("kernel", "ring_slotz", 4, "unknown key"),
        ("kernel", "macrobatches", 1, "unknown key"),
        ("kernel", "fast_silu", False, "unknown key"),
        ("model", "hiden_size", 4, "unknown key"),
        ("kernel", "comm_sms", 132, "so some SMs compute"),
        ("kernel", "comm_sms", -1, "must be in [0, num_sms - 1"),
        ("kernel", "comm_sms", 0, "needs backward_comm_sms set"),
        ("kernel", "backward_comm_sms", 132, "0 (2 x comm_sms)"),
        ("kernel", "backward_comm_sms", -1, "0 (2 x comm_sms)"),
        ("kernel", "backward_minibatch_tokens", 100, "multiple of minibatch_align"),
        ("kernel", "backward_minibatch_tokens", -64, "0 (minibatch_tokens)"),
        ("kernel", "ring_slots", 1, ">= 2 slots"),
        ("kernel", "dtype", "fp16", "not one of"),
        ("kernel", "dtype", "mxfp8", "sm_100a"),
        ("kernel", "minibatch_tokens", 100, "multiple of minibatch_align"),
        ("kernel", "minibatch_tokens", -64, "positive"),
        ("kernel", "ring_slots", "4", "expected int"),
        ("kernel", "save_fc1_output", 1, "expected bool"),
        ("kernel", "save_expert_input", "yes", "expected bool"),
        ("kernel", "comm_sms", True, "got bool"),
        ("kernel", "gemm_tile_n", 100, "power of two"),
        ("kernel", "owner_capacity_factor", 0.5, "or >= 1.0"),
        ("kernel", "owner_capacity_factor", -1, "or >= 1.0"),
        ("kernel", "owner_capacity_factor", "2", "expected int or float"),
        ("model", "moe_router_topk", 9, "exceeds num_moe_experts"),
        ("model", "hidden_size", 0, "positive"),
    ],
)
def test_bad_settings_name_file_key_and_reason(section, key, value, needle):
    with pytest.raises(MokConfigError) as err:
        parse_config(_with(section, **{key: value}), "cfg.yaml")
    msg = str(err.value)
    assert msg.startswith("cfg.yaml: key '") and f"{section}.{key}" in msg and needle in msg


def test_missing_sections_and_files(tmp_path):
    with pytest.raises(MokConfigError, match="missing required section"):
        parse_config({"kernel": {}})
    with pytest.raises(MokConfigError, match="unknown top-level key"):
        parse_config({**GOOD, "extra": 1})
    raw = _with("model")
    del raw["model"]["num_moe_experts"]
    with pytest.raises(MokConfigError, match="model.num_moe_experts.*missing"):
        parse_config(raw)
    with pytest.raises(MokConfigError, match="no such config file"):
        load_config("no-such-model")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(MokConfigError, match="invalid YAML"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(GOOD))
    assert load_config(good).kernel.ring_slots == 3


def test_cross_check_against_megatron_config():
    cfg = parse_config(GOOD, "m.yaml")
    tc = moe_transformer_config(hidden_size=256, ffn_hidden_size=128, num_experts=8, topk=2)
    cfg.check_against(tc, ep_size=4)
    with pytest.raises(MokConfigError, match="model.hidden_size.*config says 256.*has 64"):
        cfg.check_against(moe_transformer_config(hidden_size=64, ffn_hidden_size=128, num_experts=8, topk=2))
    with pytest.raises(MokConfigError, match="moe_router_topk"):
        cfg.check_against(moe_transformer_config(hidden_size=256, ffn_hidden_size=128, num_experts=8, topk=4))
    with pytest.raises(MokConfigError, match="not divisible by EP size 3"):
        cfg.check_against(tc, ep_size=3)
    with pytest.raises(MokConfigError, match="flex"):
        big = parse_config(_with("model", num_moe_experts=256), "big.yaml")
        big.check_against(
            moe_transformer_config(hidden_size=256, ffn_hidden_size=128, num_experts=256, topk=2), ep_size=128
        )


def test_resolve_order(monkeypatch, tmp_path):
    tc = moe_transformer_config()  # tiny: matches bundled tiny-test
    assert resolve_config(tc).model.name == "tiny-test"
    path = tmp_path / "mine.yaml"
    raw = _with("model", hidden_size=64, moe_ffn_hidden_size=32, name="mine")
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("MOK_CONFIG", str(path))
    assert resolve_config(tc).model.name == "mine"
    set_active_config("tiny-test")
    try:
        assert resolve_config(tc).model.name == "tiny-test"
    finally:
        set_active_config(None)
    tc.mok_config = "kimi-k2"  # explicit but for another model: a clear error, not a silent run
    with pytest.raises(MokConfigError, match="kimi-k2.yaml: key 'model.hidden_size'"):
        resolve_config(tc)
    monkeypatch.delenv("MOK_CONFIG")
    other = moe_transformer_config(hidden_size=96, ffn_hidden_size=48)
    derived = resolve_config(other)
    assert derived.source.startswith("<derived") and derived.model.hidden_size == 96


def test_fp8_dtype_without_the_kernel_is_a_clear_error_not_a_silent_bf16_run(monkeypatch):
    import torch

    from megatron_mok.backend import MokBackendError, select_backend

    # only the kernel has the FP8 recipe: on CPU, or with the reference forced, fp8 is an error
    with pytest.raises(MokBackendError, match="kernel.dtype 'fp8' runs only on the MoK kernel.*tensors are on cpu"):
        select_backend(torch.device("cpu"), 1, "fp8", torch.bfloat16)
    monkeypatch.setenv("MOK_BACKEND", "reference")
    with pytest.raises(MokBackendError, match="MOK_BACKEND=reference"):
        select_backend(torch.device("cpu"), 1, "fp8", torch.bfloat16)
    monkeypatch.delenv("MOK_BACKEND")
    assert select_backend(torch.device("cpu"), 1, "bf16", torch.float32).name == "reference"


def test_kernel_backend_fp8_weights_are_cached_per_weight_version():
    import torch

    from megatron_mok import fp8
    from megatron_mok.kernel_backend import KernelBackend

    with pytest.raises(ValueError, match="dtype must be 'bf16' or 'fp8'"):
        KernelBackend(dtype="mxfp8")
    assert KernelBackend()._fp8_weights([torch.zeros(256, 128)], [torch.zeros(128, 128)]) is None  # bf16
    b = KernelBackend(dtype="fp8")
    w1 = [torch.randn(256, 128) for _ in range(2)]
    w2 = [torch.randn(128, 128) for _ in range(2)]
    q = b._fp8_weights(w1, w2)
    assert [tuple(t.shape) for t in q.w1q[0]] == [(256, 128)] * 2 and q.w1q[0][0].dtype == torch.float8_e4m3fn
    want_q, want_s = fp8.quantize_weight_128x128(w1[1])
    assert torch.equal(q.w1q[0][1].float(), want_q.float()) and torch.equal(q.w1s[0][1], want_s)
    again = b._fp8_weights(w1, w2)
    assert again.w2q[0][0] is q.w2q[0][0], "unchanged weight was re-quantised"
    w2[0].mul_(3.0)  # in place, as an optimizer step: the version counter moves
    moved = b._fp8_weights(w1, w2)
    assert moved.w2q[0][0] is not q.w2q[0][0] and torch.allclose(moved.w2s[0][0], 3 * q.w2s[0][0])
    assert moved.w1q[0][0] is q.w1q[0][0]


def test_comm_sms_zero_is_the_in_sm_pull():
    from megatron_mok.kernel_backend import KernelBackend

    spec = parse_config(_with("kernel", comm_sms=0, backward_comm_sms=8)).kernel
    assert (spec.comm_sms, spec.compute_sms, spec.bwd_comm_sms) == (0, 132, 8)
    assert KernelBackend(comm_sms=0, backward_comm_sms=8).backward_comm_sms == 8
    with pytest.raises(ValueError, match="backward_comm_sms >= 1 when comm_sms is 0"):
        KernelBackend(comm_sms=0)


def test_backward_comm_sms_default_and_explicit():
    assert parse_config(GOOD).kernel.bwd_comm_sms == 32  # 0: twice the forward's 16
    assert parse_config(_with("kernel", backward_comm_sms=12)).kernel.bwd_comm_sms == 12
    assert parse_config(_with("kernel", comm_sms=100)).kernel.bwd_comm_sms == 131  # capped: one SM computes
    assert load_config("kimi-k2").kernel.bwd_comm_sms == 8  # kept x / act rows: the backward pulls only dY
    f8 = load_config("kimi-k2-fp8").kernel
    assert (f8.dtype, f8.comm_sms, f8.minibatch_tokens, f8.bwd_comm_sms) == ("fp8", 0, 4096, 28)
    # DeepSeek-V3's FP8 forward runs bigger minibatches (32 local experts), its backward as measured
    d8 = load_config("deepseek-v3-fp8").kernel
    assert (d8.dtype, d8.minibatch_tokens, d8.bwd_minibatch_tokens, d8.bwd_comm_sms) == ("fp8", 8192, 4096, 28)


def test_backward_minibatch_default_and_explicit():
    from megatron_mok.backend import kernel_backend

    assert parse_config(GOOD).kernel.bwd_minibatch_tokens == parse_config(GOOD).kernel.minibatch_tokens
    assert parse_config(_with("kernel", backward_minibatch_tokens=6144)).kernel.bwd_minibatch_tokens == 6144
    assert load_config("kimi-k2").kernel.bwd_minibatch_tokens == 6144
    b = kernel_backend(8, 1000.0, 16, 0.0, "bf16", 6144)
    assert b.backward_minibatch_tokens == 6144 and kernel_backend(8, 1000.0, 16, 0.0, "bf16", 0) is not b


def test_owner_capacity_factor_sizes_the_owner_row_buffers():
    from megatron_mok.kernel_backend import KernelBackend

    assert parse_config(GOOD).kernel.owner_capacity_factor == 0.0  # default: dropless worst case
    assert parse_config(_with("kernel", owner_capacity_factor=2)).kernel.owner_capacity_factor == 2
    T, K = 4096, 8
    assert KernelBackend(owner_capacity_factor=0.0).owner_rows(8, T, K) == 8 * T * K
    assert KernelBackend(owner_capacity_factor=2.0).owner_rows(8, T, K) == 2 * T * K
    assert KernelBackend(owner_capacity_factor=1.25).owner_rows(8, 3, 3) == 12  # ceil(11.25)
    assert KernelBackend(owner_capacity_factor=16.0).owner_rows(8, T, K) == 8 * T * K  # never above the worst case


def test_fp8_dtype_needs_whole_scale_blocks():
    assert parse_config(_with("kernel", dtype="fp8")).kernel.dtype == "fp8"
    raw = _with("kernel", dtype="fp8")
    raw["model"]["moe_ffn_hidden_size"] = 192  # 1.5 blocks of 128
    with pytest.raises(MokConfigError, match="multiples of 128.*/ 192"):
        parse_config(raw, "cfg.yaml")


def test_kernel_warning_only_when_asked(caplog):
    """A minibatch below the two-waves minimum is not logged where a config is only read (the CLI's info, CPU
    runs); the layer says it once when the kernel backend runs (kernel_warning)."""
    import logging

    with caplog.at_level(logging.WARNING):
        cfg = load_config("tiny-test")
    assert not [r for r in caplog.records if "under-fill" in r.getMessage()]
    assert "below the two-GEMM-waves minimum" in cfg.kernel_warning()
    assert load_config("kimi-k2").kernel_warning() is None
