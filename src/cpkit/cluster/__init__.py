"""`python -m cpkit.cluster CHECK`: the suite's multi-rank checks on the nodes of a torchrun job.

    torchrun --nnodes N --nproc-per-node G [--node-rank R --master-addr A --master-port P |
             --rdzv-backend c10d --rdzv-endpoint A:P] -m cpkit.cluster CHECK
             [--backend nccl|gloo] [--report PATH] [--timeout S] [layout flags]

CHECK is smoke (every group of the layout matches MCore and all-reduces), attention (every comm
type against the single-rank reference), hierarchical (the a2a+p2p training step against cp=1),
eval-cp, dynamic-cp, bench-attention, or all. Each runs the scenario functions of the functional
tests (cpkit.testing.scenarios). Nodes are blocks of LOCAL_WORLD_SIZE consecutive ranks; a layout
whose a2a groups span nodes is refused (exit 2) unless --allow-cross-node-a2a. The checks' models
are their own, with head counts their a2a groups divide (smoke builds groups only): no head flags
(`cpkit layout check --num-heads N --num-kv-heads K` checks a model's). Rank 0 prints the
groups per node and a table, and writes the JSON report; every rank exits 0 only when every
check passed on every rank, 1 otherwise (a raising rank ends all ranks within a few seconds, a
hung one at the check's timeout, named in the report with its stack).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings

__all__ = ["build_parser", "main"]

DEFAULT_REPORT = "cluster-report.json"
GRACE_S = 5.0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,2, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m cpkit.cluster` (also used to check skills' commands)."""
    from cpkit.cluster.checks import CHECKS
    from cpkit.hierarchical.topology import ALLOW_FLAG

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.cluster", description=__doc__.splitlines()[0])
    p.add_argument("check", choices=CHECKS + ("all",), help="what to run")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl where CUDA is present, else gloo")
    p.add_argument("--report", default=DEFAULT_REPORT, help=f"JSON report written by rank 0 (default {DEFAULT_REPORT})")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per check (and per collective) before a rank is named hung (default 600)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the layout (smoke)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the layout (smoke)")
    p.add_argument("--cp", type=int, default=None, help="CP size (default: world / (tp * pp))")
    p.add_argument("--cp-comm-type", default=None,
                   help="default: a2a+p2p on several nodes of several ranks, else p2p")
    p.add_argument("--hierarchical-cp-sizes", type=_int_list, default=None,
                   help="a2a size,p2p size (default for a2a+p2p: the a2a level fills a node)")
    p.add_argument(ALLOW_FLAG, action="store_true", help="accept a2a groups that span nodes")
    return p


def _layout(args, world: int, nproc: int):
    """The job's CPLayout from the flags; by default CP over all ranks, hierarchical across nodes."""
    import math

    from cpkit.parallel.layout import CPLayout

    cp = args.cp or max(1, world // (args.tp * args.pp))
    inner = math.gcd(cp, max(1, nproc // args.tp))  # CP positions inside one node
    comm = args.cp_comm_type or ("a2a+p2p" if 1 < inner < cp else "p2p")
    hier = args.hierarchical_cp_sizes
    if comm == "a2a+p2p" and hier is None:
        hier = [inner, cp // inner]
    return CPLayout(world_size=world, tp=args.tp, pp=args.pp, cp=cp, cp_comm_type=comm,
                    hierarchical_context_parallel_sizes=hier)


def _torchrun_env() -> tuple[int, int, int, int]:
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not set: start this under torchrun, e.g. "
                         "`torchrun --nproc-per-node 4 -m cpkit.cluster all`")
    return tuple(int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def main(argv=None) -> int:
    """Run the checks on this rank; returns the exit code, the same on every rank: 0 when every
    check passed on every rank, 1 when one failed, 2 for a layout refused before any check. After
    a failure the process groups are left as they are (a rank may still be inside a collective):
    leave with os._exit, as `python -m cpkit.cluster` does."""
    from cpkit.errors import CPConfigError
    from cpkit.hierarchical.topology import NodeTopology, check_topology, format_node_report, node_report

    args = build_parser().parse_args(argv)
    rank, world, local_rank, nproc = _torchrun_env()
    try:
        topo = NodeTopology(world, nproc)
        layout = _layout(args, world, nproc).validate()
        check_topology(layout, topo, allow_cross_node_a2a=args.allow_cross_node_a2a)
    except CPConfigError as exc:  # the same on every rank: no collective needed to agree
        from cpkit.cluster.coordinator import store_barrier

        if rank == 0:
            for v in exc.violations:
                print(f"error: {v.message}", file=sys.stderr, flush=True)
        store_barrier("refused", world, timeout_s=30.0)
        return 2

    if args.backend == "gloo" and "torch" not in sys.modules:
        # gloo ranks compute on CPU: hide the GPUs before torch looks for them, so that nothing
        # (MCore, a kernel choice, an RNG fork) initializes CUDA by accident, as the launcher does.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    from cpkit.cluster.checks import CHECKS, JobShape, build_check, run_check
    from cpkit.cluster.coordinator import Coordinator, store_barrier
    from cpkit.cluster.report import Report, merge_outcomes
    from cpkit.process_device import BACKEND_ENV

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        if rank == 0:
            print(f"error: --backend nccl needs one GPU per local rank ({nproc}), found {torch.cuda.device_count()}; "
                  "fix: start --nproc-per-node at most the GPU count, or use --backend gloo", file=sys.stderr, flush=True)
        store_barrier("refused", world, timeout_s=30.0)
        return 2
    os.environ[BACKEND_ENV] = backend  # cpkit.process_device.device() follows it
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    # Collectives time out a little after the check does, so that the watchdog names the hung
    # rank before NCCL's own timeout tears the waiting ranks down.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout + 6 * GRACE_S))
    names = list(CHECKS) if args.check == "all" else [args.check]
    job = JobShape(backend, world, nproc, layout, args.allow_cross_node_a2a)
    topology = node_report(layout, topo)
    report = Report(args.report, {"world_size": world, "nnodes": topo.nnodes, "nproc_per_node": nproc,
                                   "backend": backend, "layout": layout.to_dict(), "topology": topology}, names)

    def on_abort(name, outcomes):  # rank 0's watchdog, before the job ends
        report.add(merge_outcomes(name, outcomes))
        report.write()

    coord = Coordinator(rank, world, grace_s=GRACE_S, on_abort=on_abort)
    if rank == 0:
        print(f"cpkit.cluster: {', '.join(names)} on {world} rank(s), {topo.nnodes} node(s), {backend}", flush=True)
        print("\n".join(format_node_report(topology)), flush=True)
    passed = True
    for name in names:
        coord.begin(name, args.timeout)
        try:
            outcome = run_check(build_check(name, job), rank)
        except BaseException as exc:  # noqa: BLE001 - reported with its traceback, then every rank stops
            import traceback

            outcome = {"passed": False, "detail": f"rank {rank}: " + "".join(traceback.format_exception(exc)),
                       "seconds": None}
        entry = merge_outcomes(name, coord.finish(name, outcome))
        report.add(entry)
        if rank == 0:
            print(f"{name}: {'pass' if entry['passed'] else 'FAIL'} ({entry['seconds'] or 0:.1f} s)", flush=True)
        if not entry["passed"]:
            passed = False
            break
    if rank == 0:
        report.write()
        coord.report_written()
    else:
        coord.wait_for_report(3 * GRACE_S)
    if passed:
        dist.destroy_process_group()
    return 0 if passed else 1
