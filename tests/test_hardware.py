"""labkit.hardware: the table's units and internal consistency, peak_flops and MFU."""

import pytest

from labkit.hardware import GPUS, get_gpu, mfu, peak_flops

REQUIRED = ("t4", "l4", "a10", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "rtx-4090")


def test_the_table_holds_the_gpus_readers_meet_each_with_a_source():
    assert set(REQUIRED) <= set(GPUS)
    for g in GPUS.values():
        assert g.source and g.sm_count > 0 and g.smem_kib_per_sm > 0 and g.memory_bandwidth_gbps > 0
        # the vendors' "GB" of GPU memory are in fact GiB: nvidia-smi's total (MiB) is at most that
        # many GiB, and at most 7% short of it (ECC and reserved memory are not reported)
        assert 0.93 * g.memory_gb * 1024 <= g.nvidia_smi_mib <= g.memory_gb * 1024, g.name
        # dense tensor-core half precision is faster than plain fp32 on every GPU listed
        assert g.peak["fp16"] > g.peak["fp32"]


def test_peak_flops_aliases_and_published_figures():
    assert peak_flops("a100", "bf16") == 312e12  # A100 datasheet: 312 TFLOPS dense BF16
    assert peak_flops("h100", "bf16") == peak_flops("h200", "bf16")  # same Hopper SXM compute
    assert get_gpu("A100").nvidia_smi_mib == 81_920  # the "80 GB" A100
    assert get_gpu("h200").nvidia_smi_mib == 143_771


def test_mfu_of_a_step_at_peak_is_one():
    assert mfu(312e12 * 8 * 2.0, 2.0, 8, "a100", "bf16") == pytest.approx(1.0)


@pytest.mark.parametrize("call,match", [
    (lambda: peak_flops("t4", "bf16"), "dtype='bf16' has no peak for t4"),
    (lambda: get_gpu("v100"), "gpu='v100'"),
    (lambda: mfu(1.0, 0.0, 8, "a100"), "step_time_s=0.0"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
