"""Check that every torch.ops.sdcp op has a CUDA kernel registered (CI, after
the CUDA build). The ops come from the dispatcher, not from a list: every
`sdcp::` op except the host-side workspace control ops, which are registered
once for every backend (CompositeExplicitAutograd) and need no CUDA kernel.

    python tools/check_cuda_kernels.py
"""

import sys

import torch

import torch_sdcp  # noqa: F401  (registers the ops)

HOST_ONLY_KEY = "CompositeExplicitAutograd"


def sdcp_ops() -> list:
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("sdcp::"))


def main() -> int:
    if not torch.version.cuda:
        print("CI expects the CUDA build of torch (it compiles the CUDA kernels)", file=sys.stderr)
        return 1
    ops = [op for op in sdcp_ops() if not torch._C._dispatch_has_kernel_for_dispatch_key(op, HOST_ONLY_KEY)]
    if not ops:
        print("no sdcp op needs a CUDA kernel: the extension registered nothing", file=sys.stderr)
        return 1
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
    if missing:
        print(f"CUDA kernels not built for: {missing}", file=sys.stderr)
        return 1
    print(f"CUDA kernels compiled and registered for every op ({len(ops)}: {', '.join(ops)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
