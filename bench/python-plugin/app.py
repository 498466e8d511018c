# A plugin written in Python against wit/middleware.wit, stamping like the
# bundled one (a top-level request or each of a top-level batch, not nested
# params), for measuring what a plugin in
# another language costs: see bench/compile_cache.py and BENCHMARKS.md.
# BUILD_MARK tells two builds apart; bench/compile_cache.py sets it.
import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports.handler import (
    Action_Forward, Action_ForwardWithBody, Action_Reject, PluginError, Rejection,
)
from wit_world.imports import clock, identity
from wit_world.imports.types import IdLayout

BUILD_MARK = "A"

_layout = IdLayout.TRTLLM_V1
_LAYOUTS = {"trtllm-v1": IdLayout.TRTLLM_V1, "trtllm-v2": IdLayout.TRTLLM_V2}


def _make_id(layout, machine, tick):
    if layout == IdLayout.TRTLLM_V1:
        raw = (tick.millis << 22) | (machine << 12) | tick.sequence
        return raw % (2**63 - 1 - 2**42) + 2**42
    node, proc = machine // 64, machine % 64
    raw = ((tick.millis % 2**39) << 24) | (node << 16) | (proc << 10) | tick.sequence
    return raw % (2**63 - 1 - 2**40) + 2**40


class Handler(exports.Handler):
    def name(self):
        return "py-disagg-id"

    def version(self):
        return "0.1.0"

    def configure(self, settings):
        global _layout
        for s in settings:
            if s.name == "id-layout":
                if s.value not in _LAYOUTS:
                    raise Err(f"id-layout: unknown layout {s.value!r}")
                _layout = _LAYOUTS[s.value]
            else:
                raise Err(f"{s.name}: unknown setting")

    def handle(self, request):
        try:
            doc = json.loads(bytes(request.body))
        except Exception:
            return Action_Forward()
        # A request, or a batch: each request of a top-level array.
        requests = doc if isinstance(doc, list) else [doc]
        waiting = [dp for dp in map(_unstamped, requests) if dp is not None]
        if not waiting:
            return Action_Forward()
        try:
            mid = identity.current_machine_id()
        except Err as e:
            return Action_Reject(Rejection(503, "no_machine_id", f"no machine id: {e.value}"))
        if mid.layout != _layout:
            return Action_Reject(Rejection(503, "no_machine_id", "machine id layout differs from id-layout"))
        space = 4096 if _layout == IdLayout.TRTLLM_V1 else 1024
        for dp in waiting:
            # One tick for each id: the host's clock never gives one twice.
            dp["disagg_request_id"] = _make_id(_layout, mid.value, clock.next_tick(space))
        return Action_ForwardWithBody(json.dumps(doc, separators=(",", ":")).encode())


def _unstamped(request):
    """The context-only disaggregated_params of `request` that wait for an id, if any."""
    if not isinstance(request, dict):
        return None
    dp = request.get("disaggregated_params")
    if not isinstance(dp, dict):
        return None
    rt = dp.get("request_type")
    if not isinstance(rt, str) or rt.lower() != "context_only":
        return None
    # Like the bundled plugin: the id lives in disaggregated_params.
    if dp.get("disagg_request_id") is not None:
        return None
    return dp
