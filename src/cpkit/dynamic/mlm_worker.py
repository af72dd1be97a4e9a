"""The worker process that runs a Megatron-LM checkout's dynamic-CP code for cpkit.dynamic.mlm.

Run as `python -m cpkit.dynamic.mlm_worker ROOT`. It loads the checkout's own files (never the
installed megatron-core's) and answers one JSON request per line on stdin, one JSON reply per
line on the stdout it had at start (upstream's prints go to stderr). The parent kills it when a
call does not return in time, so an endless loop upstream never blocks cpkit.

Loading: importing the checkout's `megatron.core` package runs its `__init__`, which pulls in
the whole library (Triton, Transformer Engine, about 11 s). Instead the packages on the way to
the needed files are empty package objects whose `__path__` is the checkout's directory, so
`import megatron.core.datasets.data_schedule` runs that file and the files it imports, all from
the checkout. Two imports the scheduling code never calls are stand-ins that raise when called:
`megatron.core.extensions.transformer_engine` (get_thd_partitioned_indices, HAVE_TE=False: TE
is not on CPU machines) and `megatron.core.transformer.multi_token_prediction`
(mtp_on_this_rank, used by DpBalancedScheduler.run only). `install_checkout` does this in the
calling process; it is for worker and rank processes only, never for a process that uses the
installed megatron-core.

Requests: {"op": "schedule", "seq_lens", "dp_cp_size", "max_seq_len_per_rank",
"microbatch_group_size", optional "min_cp_size"} -> {"ok": true, "sample_id_groups": [[[ids of rank r] for r] for mb]};
{"op": "call", "target": "module:function", "args": [...]} runs a cpkit function given the
loaded upstream modules as its first argument (probes of upstream internals in tests). An
exception upstream -> {"ok": false, "error": last line of its traceback, "type": its class}.
A request's "timeout_s" arms a CPU-time alarm (ITIMER_PROF, SIGPROF) in the worker: a hang keeps
computing, while a call waiting for a core on a loaded host does not, so wall time would call a
slow host a hang. Upstream's endless loops are pure Python,
so the alarm ends them and the worker keeps its loaded modules: no restart per hang) ->
{"ok": false, "hang": true}; the parent kills the worker only if even that reply is late.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
import types
from pathlib import Path

__all__ = ["STAND_INS", "install_checkout", "main"]

_PACKAGES = ("megatron", "megatron.core", "megatron.core.datasets",
             "megatron.core.pipeline_parallel", "megatron.core.transformer",
             "megatron.core.extensions", "megatron.core.inference",
             "megatron.core.dist_checkpointing")

STAND_INS = {
    "megatron.core.extensions.transformer_engine": ("get_thd_partitioned_indices",),
    "megatron.core.transformer.multi_token_prediction": ("mtp_on_this_rank",),
}
"""Modules replaced by stand-ins in the worker, and the names they offer (each raises)."""


def _not_loaded(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name} is a stand-in in cpkit's Megatron-LM worker "
                                  "(cpkit/dynamic/mlm_worker.py::STAND_INS)")
    return call


def install_checkout(root: str | os.PathLike) -> dict[str, types.ModuleType]:
    """Make `import megatron.core...` load files from the checkout at `root` in this process;
    returns the modules the scheduling code lives in (data_schedule, data_schedule_utils,
    hybrid_cp_schedule). Raises ImportError when one of them does not load."""
    root = Path(root).resolve()
    if "megatron" in sys.modules \
            and list(getattr(sys.modules["megatron"], "__path__", [])) != [str(root / "megatron")]:
        raise ImportError("another megatron is already imported in this process; "
                          "load a checkout in a fresh process")
    for name in _PACKAGES:
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        package.__package__ = name
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, package)
    for name, attrs in STAND_INS.items():
        stand_in = types.ModuleType(name)
        stand_in.HAVE_TE = False
        for attr in attrs:
            setattr(stand_in, attr, _not_loaded(f"{name}.{attr}"))
        sys.modules[name] = stand_in
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, stand_in)
    modules = {}
    for short, name in (("data_schedule", "megatron.core.datasets.data_schedule"),
                        ("data_schedule_utils", "megatron.core.datasets.data_schedule_utils"),
                        ("hybrid_cp_schedule",
                         "megatron.core.pipeline_parallel.hybrid_cp_schedule")):
        modules[short] = importlib.import_module(name)
    return modules


#: The worker's alarm: SIGPROF, sent after the request's timeout_s of the worker's CPU time.
ALARM = signal.SIGPROF


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that upstream's `except Exception` cannot catch it."""


def _raise_timeout(signum, frame):
    raise _Timeout


def _last_line(err: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
    return text[-1] if text else type(err).__name__


def _where(err: BaseException, root: Path) -> str | None:
    """The innermost frame of the checkout in err's traceback, as "path::function"."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if Path(f.filename).resolve().is_relative_to(root)
              and not f.name.startswith("<")]  # a genexpr names no function
    if not frames:
        return None
    return f"{Path(frames[-1].filename).resolve().relative_to(root)}::{frames[-1].name}"


def _schedule(modules, request) -> dict:
    scheduler = modules["data_schedule"].DefaultDynamicCPScheduler(
        max_seqlen_per_dp_cp_rank=request["max_seq_len_per_rank"],
        cp_size=request["dp_cp_size"], dp_size=1,
        microbatch_group_size_per_vp_stage=request.get("microbatch_group_size"),
        min_cp_size=request.get("min_cp_size", 1))
    groups = scheduler.get_groups_and_subsamples(
        [(i, int(L)) for i, L in enumerate(request["seq_lens"])])
    return {"sample_id_groups": [[[int(s) for s in rank] for rank in mb] for mb in groups]}


def _call(modules, request) -> dict:
    module_name, _, function = request["target"].partition(":")
    if not module_name.startswith("cpkit."):
        raise ValueError(f"target {request['target']!r} is not a cpkit function")
    result = getattr(importlib.import_module(module_name), function)(modules, *request["args"])
    return {"result": result}


def main(argv: list[str] | None = None) -> int:
    """Serve requests until stdin closes (see the module docstring)."""
    root = Path((argv if argv is not None else sys.argv[1:])[0]).resolve()
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # upstream's prints must not mix with the replies
    sys.stdout = sys.stderr
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def send(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    try:
        modules = install_checkout(root)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises
        send({"ready": False, "error": _last_line(err), "type": type(err).__name__})
        return 1
    send({"ready": True})
    signal.signal(ALARM, _raise_timeout)
    for line in sys.stdin:
        request = json.loads(line)
        handler = {"schedule": _schedule, "call": _call}[request["op"]]
        try:
            if request.get("timeout_s"):
                signal.setitimer(signal.ITIMER_PROF, request["timeout_s"])
            try:
                reply = {"ok": True, **handler(modules, request)}
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except _Timeout as err:
            reply = {"ok": False, "hang": True, "where": _where(err, root)}
        except Exception as err:  # noqa: BLE001 - any upstream exception is a finding
            reply = {"ok": False, "error": _last_line(err), "type": type(err).__name__,
                     "where": _where(err, root)}
        send(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
