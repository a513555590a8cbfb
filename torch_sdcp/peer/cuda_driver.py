"""The CUDA driver through cuda-python, imported lazily (the host backend does
not need it): ``driver()`` (the ``cuda.bindings.driver`` module) and ``cu()``
(one driver call, its error raised naming the call). Used by the CUDA VMM
backend (cuda_vmm) and by the bench's virtual ranks."""

from __future__ import annotations

__all__ = ["cu", "driver"]


def driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            "torch_sdcp: the 'cuda' backend of PeerArena needs cuda-python "
            f"(`from cuda.bindings import driver` failed: {e})") from e
    return driver


def _error_string(err) -> str:
    name = getattr(err, "name", str(err))
    try:
        e2, desc = driver().cuGetErrorString(err)
        text = desc.decode() if isinstance(desc, (bytes, bytearray)) and int(e2) == 0 else "?"
    except Exception:
        text = "?"
    return f"{name} ({int(err)}): {text}"


def cu(name: str, *args):
    """Call driver.<name>(*args), raise RuntimeError naming the call on any error, return the
    outputs (None, one value, or a tuple)."""
    drv = driver()
    out = getattr(drv, name)(*args)
    if not isinstance(out, tuple):
        out = (out,)
    err = out[0]
    if int(err) != int(drv.CUresult.CUDA_SUCCESS):
        raise RuntimeError(f"torch_sdcp: {name} failed: {_error_string(err)}")
    if len(out) == 1:
        return None
    if len(out) == 2:
        return out[1]
    return out[1:]
