"""GPUs a reader meets: memory, bandwidth, interconnect and dense peak FLOP/s, each with its source.

Memory is given twice: ``memory_gb`` as the vendor states it, and ``nvidia_smi_mib`` as
``nvidia-smi`` reports the total (MiB = 2^20 bytes), which is what a program can see. The
vendors' "GB" of GPU memory behave as GiB: an "80 GB" A100 shows 81,920 MiB, 85.9 x 10^9 bytes
(the book's GB); compare only numbers in the same unit. Plans use ``memory_bytes`` (nvidia-smi's
total), and ``python -m labkit.plan --list-gpus`` shows it in GB beside the vendor's figure. Bandwidths in GB/s (10^9 bytes/s);
``link_gbps`` is the GPU-to-GPU link's total (both directions) as the vendor quotes it. Peak FLOP/s are dense (the datasheets' "with
sparsity" figures are twice these); fp16/bf16/tf32/fp8 on the tensor cores, fp32 without them.
``smem_kib_per_sm``: the largest shared memory (on-chip SRAM) one SM can give a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .validate import ArgumentError, check_float, check_int, check_positive

__all__ = ["GPU", "GPUS", "get_gpu", "peak_flops", "mfu"]

_T = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float           # the vendor's figure, in its "GB" (in fact GiB, see above)
    nvidia_smi_mib: int        # total memory as nvidia-smi reports it, MiB (2^20 bytes)
    memory_bandwidth_gbps: float
    interconnect: str
    link_gbps: float           # GPU-to-GPU link, GB/s, both directions together
    sm_count: int
    smem_kib_per_sm: int       # largest shared memory per SM a kernel can use (KiB)
    peak: dict = field(default_factory=dict)  # dtype -> dense FLOP/s
    source: str = ""
    network_gbps: float = 12.5  # scale-out bandwidth per GPU, GB/s, one direction (see below)

    @property
    def memory_bytes(self) -> int:
        """What a program can allocate at most: nvidia-smi's total, in bytes."""
        return self.nvidia_smi_mib * 2**20


GPUS: dict[str, GPU] = {g.name: g for g in [
    # network_gbps, the last field: the reference cluster's scale-out port per GPU, one direction.
    # DGX A100: eight 200 Gb/s HDR InfiniBand ports, one per GPU (25 GB/s); DGX H100 and H200:
    # eight 400 Gb/s NDR ports (ConnectX-7), one per GPU (50 GB/s). The PCIe cards have no reference
    # cluster: 12.5 GB/s (a 100 Gb/s port per GPU) is assumed; plan_training(network_gbps=...) overrides.
    # Each peak below is the vendor's dense figure: the datasheets' tensor-core figures marked
    # "with sparsity" halved. A dtype the GPU has no tensor-core path for has no entry (the T4 has
    # no bf16: peak_flops("t4", "bf16") is refused, and so is a bf16 plan on it).
    # T4 datasheet: FP32 8.1 TFLOPS, mixed precision (FP16/FP32) 65 TFLOPS, no BF16 or TF32;
    # 16 GB GDDR6 (256-bit at 10 Gb/s: 320 GB/s); PCIe Gen3 x16, 32 GB/s.
    GPU("t4", 16, 15_360, 320, "PCIe Gen3 x16", 32, 40, 64,
        {"fp32": 8.1 * _T, "fp16": 65 * _T},
        "NVIDIA T4 Tensor Core GPU datasheet; Turing architecture whitepaper (SMs, shared memory)"),
    # L4 datasheet: FP32 30.3; TF32 120*, FP16 242*, BF16 242*, FP8 485* TFLOPS (* with sparsity);
    # 24 GB GDDR6, 300 GB/s; PCIe Gen4 x16, 64 GB/s.
    GPU("l4", 24, 23_034, 300, "PCIe Gen4 x16", 64, 58, 100,
        {"fp32": 30.3 * _T, "tf32": 60 * _T, "fp16": 121 * _T, "bf16": 121 * _T, "fp8": 242.5 * _T},
        "NVIDIA L4 Tensor Core GPU datasheet; Ada Lovelace architecture whitepaper"),
    # A10 datasheet: FP32 31.2; TF32 62.5, BF16 125, FP16 125 TFLOPS (dense; 125/250/250 with
    # sparsity); 24 GB GDDR6, 600 GB/s; PCIe Gen4, 64 GB/s.
    GPU("a10", 24, 23_028, 600, "PCIe Gen4 x16", 64, 72, 100,
        {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "fp16": 125 * _T, "bf16": 125 * _T},
        "NVIDIA A10 Tensor Core GPU datasheet; Ampere GA102 whitepaper"),
    # A100 datasheet (SXM): FP32 19.5; TF32 156, BF16 312, FP16 312 TFLOPS (dense); 40 GB HBM2
    # at 1,555 GB/s or 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s.
    GPU("a100-40gb", 40, 40_960, 1_555, "NVLink 3 (SXM4)", 600, 108, 164,
        {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB); A100 architecture whitepaper", 25.0),
    GPU("a100-80gb", 80, 81_920, 2_039, "NVLink 3 (SXM4)", 600, 108, 164,
        {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); A100 architecture whitepaper", 25.0),
    # H100 datasheet (SXM): FP32 67; TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958* TFLOPS
    # (* with sparsity); 80 GB, 3.35 TB/s; NVLink 900 GB/s. H200 (SXM): the same compute, 141 GB
    # HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    GPU("h100-sxm", 80, 81_559, 3_350, "NVLink 4 (SXM5)", 900, 132, 228,
        {"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T, "fp8": 1979 * _T},
        "NVIDIA H100 Tensor Core GPU datasheet (SXM); Hopper architecture whitepaper", 50.0),
    GPU("h200", 141, 143_771, 4_800, "NVLink 4 (SXM)", 900, 132, 228,
        {"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T, "fp8": 1979 * _T},
        "NVIDIA H200 Tensor Core GPU datasheet (SXM); Hopper architecture whitepaper", 50.0),
    # RTX 4090 (Ada whitepaper, Appendix A): FP32 82.6; TF32 82.6, FP16 and BF16 165.2 TFLOPS with
    # FP32 accumulate (dense; the FP16-accumulate figure, 330.3, is not what training uses);
    # 24 GB GDDR6X, 1,008 GB/s; PCIe Gen4 x16, no NVLink.
    GPU("rtx-4090", 24, 24_564, 1_008, "PCIe Gen4 x16 (no NVLink)", 64, 128, 100,
        {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "fp16": 165.2 * _T, "bf16": 165.2 * _T},
        "Ada Lovelace architecture whitepaper, Appendix A (tensor FLOP/s with FP32 accumulate)"),
]}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "4090": "rtx-4090"}


def get_gpu(gpu: str | GPU) -> GPU:
    """The table's entry for ``gpu`` (a name such as "a100", "h100-sxm", or a :class:`GPU`)."""
    if isinstance(gpu, GPU):
        return gpu
    if not isinstance(gpu, str):
        raise ArgumentError(f"gpu={gpu!r} must be a GPU or a name; valid: {sorted(GPUS) + sorted(_ALIASES)}")
    key = _ALIASES.get(str(gpu).lower(), str(gpu).lower())
    if key not in GPUS:
        raise ArgumentError(f"gpu={gpu!r} is not in the table; valid: {sorted(GPUS) + sorted(_ALIASES)}", "gpu",
                            gpu=gpu, valid=sorted(GPUS) + sorted(_ALIASES))
    return GPUS[key]


def peak_flops(gpu: str | GPU, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of ``gpu`` in ``dtype`` ("fp32", "tf32", "fp16", "bf16", "fp8")."""
    g = get_gpu(gpu)
    if not isinstance(dtype, str) or dtype not in g.peak:
        raise ArgumentError(f"dtype={dtype!r} has no peak for {g.name}; valid: {sorted(g.peak)}")
    return g.peak[dtype]


def mfu(flops_per_step: float, step_time_s: float, n_gpus: int, gpu: str | GPU, dtype: str = "bf16") -> float:
    """Model FLOPs utilisation: the step's model FLOPs / (time x GPUs x dense peak)."""
    check_float("flops_per_step", flops_per_step, 0.0)
    check_positive("step_time_s", step_time_s)
    check_int("n_gpus", n_gpus, 1)
    return flops_per_step / (step_time_s * n_gpus * peak_flops(gpu, dtype))
