"""The vLLM plugin's step health check and teardown hook: what wraps vLLM's
``Worker.sample_tokens`` (a recorded failure raises before the step's tokens
leave the worker) and ``destroy_model_parallel`` (every workspace closed while
the groups still exist). Installed by torch_sdcp.integrations.vllm."""

from __future__ import annotations

import functools

from torch_sdcp.integrations.vllm_calls import engine, face, teardown


def check_step() -> None:
    """Raise if any live workspace of the plugin recorded a failure (a
    timeout, a call mismatch, a peer's abort). Reads host memory only; called
    after each step's synchronisation, before its output leaves the worker."""
    face.check()


def _checked_get_output(get_output):
    output = get_output()  # waits for the step's copy to the host
    check_step()
    return output


def worker_sample_tokens(self, grammar_output):
    """Wraps Worker.sample_tokens: a synchronous output is checked at once;
    an async one when its get_output has waited for the step."""
    output = engine.originals["Worker.sample_tokens"](self, grammar_output)
    get_output = getattr(output, "get_output", None)
    if get_output is None:
        check_step()
        return output
    try:
        output.get_output = functools.partial(_checked_get_output, get_output)
    except AttributeError:  # an output type that takes no attribute: check now (what already ran)
        face.log_once("warning", "async-output", "torch_sdcp: %s takes no wrapper; the step check runs before the "
                  "step's copy finished", type(output).__name__)
        check_step()
    return output


def destroy_model_parallel(*args, **kwargs):
    """Wraps destroy_model_parallel: closes every workspace (collectively,
    while the groups still exist), then vLLM destroys its groups. A failing
    close is logged; vLLM's shutdown goes on."""
    try:
        teardown()
    except Exception as e:
        face.log_once("error", ("teardown", str(e)), "torch_sdcp: closing the workspaces at vLLM's shutdown failed "
                  "(%s: %s); vLLM's shutdown goes on", type(e).__name__, e)
    # A next engine in this process logs its seams again, even under a DCP group name seen before.
    face.logged -= {r for r in set(face.logged) if isinstance(r, tuple) and r[0] == "seams"}
    return engine.originals["destroy_model_parallel"](*args, **kwargs)
