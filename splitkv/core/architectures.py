"""The NVIDIA architectures splitkv builds for, as plain data: what each compute capability
lets a decode launch have (shared memory a block may opt in to and an SM holds, thread-block
clusters and programmatic dependent launch), and the GPUs users run as the
``core.builds.DeviceProperties`` their wrapper would read. CPU tests build and plan for each
without the GPU (docs/design/architectures.md).

Shared memory: the CUDA C++ Programming Guide, "Compute Capabilities", technical
specifications per compute capability (maximum shared memory per SM and per thread block;
docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html): a block
may opt in to the SM's shared memory less the 1 KiB the driver reserves a block, 163 KiB of
164 on 8.0, 99 of 100 on 8.6, 8.9 and 12.0, 227 of 228 on 9.0 and 10.0 (CCCL's
``cuda::arch::traits`` give the same bytes). Clusters and programmatic dependent launch: 9.0
and newer (the same guide), which the runtime asks of the device (``runtime.device_features``)."""

from __future__ import annotations

from dataclasses import dataclass

from .builds import DeviceProperties


@dataclass(frozen=True)
class Architecture:
    """One compute capability's limits a decode launch meets."""

    cc: int                          # compute capability, major x 10 + minor
    shared_per_block_optin: int      # bytes a block may opt in to
    shared_per_sm: int               # bytes an SM holds

    @property
    def arch(self) -> str:
        """NVRTC's ``-arch`` for a CUBIN of this architecture."""
        return f"sm_{self.cc}"

    @property
    def clusters(self) -> bool:
        """Thread-block clusters (the cluster merge's builds) and programmatic dependent
        launch: compute capability 9.0 and newer."""
        return self.cc >= 90


KIB = 1024
ARCHITECTURES = {a.cc: a for a in (
    Architecture(80, 163 * KIB, 164 * KIB),      # A100
    Architecture(86, 99 * KIB, 100 * KIB),       # RTX 30xx, A10, A40
    Architecture(89, 99 * KIB, 100 * KIB),       # L40S, L4, RTX 40xx
    Architecture(90, 227 * KIB, 228 * KIB),      # H100, H200
    Architecture(100, 227 * KIB, 228 * KIB),     # B200
    Architecture(120, 99 * KIB, 100 * KIB),      # RTX 50xx, RTX PRO 6000 Blackwell
)}

# SMs per GPU, from NVIDIA's product specifications (CUDA cores / 128 where a sheet lists cores):
# A100 108; RTX 3090 10,496 cores, 82; L40S 18,176 cores, 142; H100 SXM5 132; H100 PCIe 14,592
# cores, 114; H100 NVL and H200 NVL 16,896 cores, 132; H200 132; B200 148; RTX 4090 16,384 cores,
# 128; RTX 5090 21,760 cores, 170.
GPU_SMS = {"NVIDIA A100-SXM4-80GB": (80, 108), "NVIDIA GeForce RTX 3090": (86, 82),
           "NVIDIA L40S": (89, 142),
           "NVIDIA H100 80GB HBM3": (90, 132), "NVIDIA H200": (90, 132),
           "NVIDIA H100 PCIe": (90, 114), "NVIDIA H100 NVL": (90, 132),
           "NVIDIA H200 NVL": (90, 132),
           "NVIDIA B200": (100, 148), "NVIDIA GeForce RTX 4090": (89, 128),
           "NVIDIA GeForce RTX 5090": (120, 170)}


def device_properties(name: str) -> DeviceProperties:
    """The ``DeviceProperties`` a wrapper on the GPU ``name`` (a key of ``GPU_SMS``) reads."""
    cc, sms = GPU_SMS[name]
    arch = ARCHITECTURES[cc]
    return DeviceProperties(sms, arch.shared_per_block_optin, arch.shared_per_sm, cc, name)


def architecture_properties(cc: int) -> DeviceProperties:
    """``DeviceProperties`` of one GPU of each architecture (the first of ``GPU_SMS``)."""
    name = next(n for n, (c, _) in GPU_SMS.items() if c == cc)
    return device_properties(name)
