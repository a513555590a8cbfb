"""A stand-in for the CUDA driver calls of torch_sdcp.bench.virtual_ranks
(``FakeDriver``) over host memory, for the virtual ranks' CPU tests; conftest's
``fake_driver`` fixture installs one."""

from __future__ import annotations

import ctypes


class FakeDriver:
    """The driver calls VirtualRanks makes, over host memory: allocations are
    bytearrays, a mapping makes a virtual address an alias of one."""

    GRANULARITY = 2 << 20

    def __init__(self, fail: str | None = None, fail_at: int = 1, swap: bool = False):
        self.fail, self.fail_at, self.swap = fail, fail_at, swap  # raise at the fail_at-th call of `fail`
        self.calls: dict[str, int] = {}
        self.allocations: dict[int, bytearray] = {}
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> (allocation, bytes)
        self.ranges: dict[int, int] = {}
        self.retained = self.pushed = 0
        self.next_address = 1 << 40

    def _resolve(self, address: int) -> tuple[bytearray, int]:
        for start, (allocation, size) in self.mappings.items():
            if start <= address < start + size:
                return self.allocations[allocation], address - start
        raise RuntimeError(f"unmapped address 0x{address:x}")

    def __call__(self, name: str, *args):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name == self.fail and self.calls[name] == self.fail_at:
            raise RuntimeError(f"torch_sdcp: {name} failed: injected")
        if name == "cuDevicePrimaryCtxRetain":
            self.retained += 1
        elif name == "cuDevicePrimaryCtxRelease":
            self.retained -= 1
        elif name == "cuCtxPushCurrent":
            self.pushed += 1
        elif name == "cuCtxPopCurrent":
            self.pushed -= 1
        elif name == "cuDeviceGetAttribute":
            return 1
        elif name == "cuMemGetAllocationGranularity":
            return self.GRANULARITY
        elif name == "cuMemCreate":
            handle = len(self.allocations) + len(self.calls) * 1000
            self.allocations[handle] = bytearray(args[0])
            return handle
        elif name == "cuMemRelease":
            del self.allocations[args[0]]
        elif name == "cuMemAddressReserve":
            address, self.next_address = self.next_address, self.next_address + args[0] + self.GRANULARITY
            self.ranges[address] = args[0]
            return address
        elif name == "cuMemAddressFree":
            assert self.ranges.pop(args[0]) == args[1]
        elif name == "cuMemMap":
            address, size, _, allocation, _ = args
            # A wrong mapping: the second range sees the allocations in reverse.
            if self.swap and len(self.ranges) > 1 and address >= sorted(self.ranges)[1]:
                handles = sorted(self.allocations)
                allocation = handles[len(handles) - 1 - handles.index(allocation)]
            self.mappings[address] = (allocation, size)
        elif name == "cuMemUnmap":
            assert self.mappings.pop(args[0])[1] == args[1]
        elif name in ("cuMemsetD8", "cuMemsetD32"):
            address, value, count = args
            width = 1 if name == "cuMemsetD8" else 4
            memory, offset = self._resolve(address)
            memory[offset:offset + width * count] = value.to_bytes(width, "little") * count
        elif name == "cuMemcpyDtoH":
            host, address, count = args
            memory, offset = self._resolve(address)
            ctypes.memmove(host, bytes(memory[offset:offset + count]), count)
        return None

    def released(self) -> bool:
        return not (self.allocations or self.mappings or self.ranges or self.retained or self.pushed)
