"""What this machine has, known without importing torch (a command line is checked before torch is imported:
fmoe_cli/options.py).

`surely_no_gpu`: whether no GPU torch could use is here, from the device nodes a GPU driver makes. Importing torch
to ask `torch.cuda.is_available()` costs 5–8 s; a user who asked for a GPU on a machine without one (`--device
cuda`, or `fmoe plan` with neither `--vram` nor `--profile`) hears it in a fraction of a second instead. Where a node
exists the answer is "maybe": torch says, later (a driver without a CUDA build of torch, a card another process
holds).
"""

from __future__ import annotations

import os

# NVIDIA's driver (its control node, and its per-GPU entries in /proc), AMD's ROCm (the KFD node torch's HIP build
# opens), WSL 2's paravirtual GPU
GPU_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia/gpus", "/dev/kfd", "/dev/dxg")


def surely_no_gpu() -> bool:
    """True where torch surely sees no CUDA (or ROCm) device: no GPU driver's node, or CUDA_VISIBLE_DEVICES set to
    hide every device ("" or -1). False where one may be present."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    return not any(os.path.exists(node) for node in GPU_NODES)
