"""Config defaults that depend on the machine."""


def test_param_dtype_auto_is_bf16_on_a_gpu_and_fp32_on_cpu(monkeypatch):
    import torch

    from rlhf_core.config import DSConfig, GenerateConfig, resolve_param_dtype

    assert DSConfig().param_dtype == GenerateConfig().ds.param_dtype == "auto"
    assert (
        resolve_param_dtype("auto", cuda=True) == "bf16" and resolve_param_dtype("auto", cuda=False) == "fp32"
    )
    assert (
        resolve_param_dtype("bf16", cuda=False) == "bf16" and resolve_param_dtype("fp32", cuda=True) == "fp32"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # default: this process's device
    assert resolve_param_dtype("auto") == "bf16"
