"""Tensors over raw memory with an explicit device: DLPack through ctypes."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from .lifetime import _Mapping, interrupts_kept

# The device must never be inferred from the pointer: for peer memory cudaPointerGetAttributes names
# the owning GPU (torch.as_tensor(__cuda_array_interface__) without a device gives a tensor on the
# peer's GPU). at::fromDLPack passes the DLPack device to from_blob as its target device, so no
# inference happens; _byte_tensor still checks data_ptr, device and size of the result.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleterType = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DLDeleterType)]

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_UINT = 1
_DLTENSOR_NAME = b"dltensor"

# address of the DLManagedTensor -> (struct, shape array, _Mapping): keeps the struct alive
# until torch calls the deleter, and holds the mapping reference of that storage.
_LIVE: dict[int, tuple[Any, Any, _Mapping]] = {}
_LIVE_LOCK = threading.Lock()


def _dl_deleter_impl(address) -> None:
    with interrupts_kept():  # never let an exception escape into C, nor a Ctrl-C be lost there
        with _LIVE_LOCK:
            entry = _LIVE.pop(address, None)
        if entry is not None:
            entry[2].unref()


_DL_DELETER = _DLDeleterType(_dl_deleter_impl)
# The callback's trampoline must outlive every tensor, also those freed late at interpreter
# shutdown: keep one reference forever.
ctypes.pythonapi.Py_IncRef.argtypes = [ctypes.py_object]
ctypes.pythonapi.Py_IncRef.restype = None
ctypes.pythonapi.Py_IncRef(_DL_DELETER)

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _byte_tensor(address: int, nbytes: int, device: torch.device, mapping: _Mapping) -> torch.Tensor:
    """A 1-D uint8 tensor over [address, address + nbytes) on `device`, zero-copy, whose storage
    holds one reference on `mapping` until torch frees it."""
    m = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    m.dl_tensor.data = address
    if device.type == "cuda":
        m.dl_tensor.device.device_type = _KDL_CUDA
        m.dl_tensor.device.device_id = device.index
    else:
        m.dl_tensor.device.device_type = _KDL_CPU
        m.dl_tensor.device.device_id = 0
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype.code = _KDL_UINT
    m.dl_tensor.dtype.bits = 8
    m.dl_tensor.dtype.lanes = 1
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _DL_DELETER
    key = ctypes.addressof(m)
    mapping.ref()
    with _LIVE_LOCK:
        _LIVE[key] = (m, shape, mapping)
    try:
        capsule = _PyCapsule_New(key, _DLTENSOR_NAME, None)
        t = torch.utils.dlpack.from_dlpack(capsule)
        del capsule
    except BaseException:
        # Not consumed (or consumed and already freed): drop our entry if still there.
        _dl_deleter_impl(key)
        raise
    if t.data_ptr() != address or t.device != device or t.numel() != nbytes:
        got = (t.data_ptr(), t.device, t.numel())
        del t
        raise RuntimeError(
            "torch_sdcp: PeerArena: the tensor made over the mapping is not a zero-copy view: "
            f"expected (data_ptr 0x{address:x}, device {device}, {nbytes} bytes), got "
            f"(0x{got[0]:x}, {got[1]}, {got[2]})")
    return t
