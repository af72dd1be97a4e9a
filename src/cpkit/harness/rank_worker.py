"""The rank side of a persistent rank pool (cpkit.harness.rank_pool): one process per rank that joins the
pool's process group once, then runs case after case sent to it by importable name.

Each case runs from the same state: RNG seeded, the environment and torch's global switches as
the pool found them. After a case the rank syncs through the store (never through a
communicator a half-done case may still hold), then removes what the case left behind: MCore's
model-parallel state, RNG tracker and microbatch calculator, compiled-graph caches, the
environment and torch's global switches.
A case after which more GPU memory is held than before it is reported as a leak, which fails
that case and retires the pool. Process groups are kept and handed out again to later cases
that ask for the same ranks (cpkit.harness.pool_groups), so their number follows the layouts used, not
the cases; a pool whose groups still grow past MAX_KEPT_GROUPS is retired, and so is one whose
ranks made different numbers of groups (a case that failed on some ranks half-way).

The clean-up's garbage collection scans only what the cases made: what survives it after a case
that imported modules (torch, MCore: millions of objects that never become garbage) moves to
gc's permanent generation (`gc.freeze`). A full collection over that many objects took 0.1-0.3 s
per rank and case, the pools' largest cost per case on CPU. A leak check that fails looks again
with every object unfrozen, so frozen garbage can never be reported as a case's leak.

Messages to the parent go over this rank's own pipe, never stdout: NCCL_DEBUG=INFO, print() or a C
library writing to fd 1 cannot corrupt the channel (fd 1 goes to the rank's stderr file).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib
import os
import random
import signal
import sys
import time
import traceback

from cpkit.harness.attribution import rank_case_context
from cpkit.harness.pool_groups import GroupReuse, group_count, live_groups
from cpkit.harness.rank_stderr import capture_stderr
from cpkit.process_device import BACKEND_ENV

__all__ = ["GPU_LEAK_SLACK_BYTES", "MAX_KEPT_GROUPS", "die_with_parent", "rank_main", "resolve"]

GPU_LEAK_SLACK_BYTES = 512 << 20
"""GPU memory a rank may hold above its start-up level after a case's clean-up (cuBLAS and cuDNN
workspaces, allocator rounding); more than this is a leak of the case that left it."""
SEED = 1234
MAX_KEPT_GROUPS = 512
"""Process groups a pool rank may keep for its cases (cpkit.harness.pool_groups) before the pool is
retired (respawned, not failed). Reused groups follow the layouts a tier runs (the 4x H200
proof at abc9a09 retired no pool for them): past this bound cases make groups they never ask
for again, which is a leak."""


def resolve(ref: str):
    """The callable named by 'module:qualname'."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this rank when the process that started it dies (Linux), so that an
    owner killed outright (SIGKILL, pytest-timeout's thread method) leaves no orphan ranks."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _seed_everything() -> None:
    import torch

    random.seed(SEED)
    torch.manual_seed(SEED)  # every CUDA device too
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(SEED)


def _torch_switches() -> dict:
    import torch

    return {
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "threads": torch.get_num_threads(),
    }


def _restore_switches(saved: dict) -> None:
    import torch

    torch.set_default_dtype(saved["default_dtype"])
    torch.set_grad_enabled(saved["grad"])
    torch.use_deterministic_algorithms(saved["deterministic"])
    torch.backends.cuda.matmul.allow_tf32 = saved["tf32_matmul"]
    torch.backends.cudnn.allow_tf32 = saved["tf32_cudnn"]
    torch.set_num_threads(saved["threads"])


def _reset_upstream_state() -> None:
    """MCore's globals a case may have set up (only where MCore was imported)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
        # destroy_model_parallel leaves it set (MCore 0.16 and 0.19): a later case's module
        # would bind an earlier case's a2a+p2p groups.
        if hasattr(ps, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"):
            ps._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    rnd = sys.modules.get("megatron.core.tensor_parallel.random")
    if rnd is not None:
        rnd.get_cuda_rng_tracker().reset()
    calc = sys.modules.get("megatron.core.num_microbatches_calculator")
    if calc is not None and hasattr(calc, "destroy_num_microbatches_calculator"):
        calc.destroy_num_microbatches_calculator()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _store_sync(store, tag: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait until every rank reached `tag`, through the store alone."""
    import datetime as dt

    store.set(f"{tag}/{rank}", "1")
    store.wait([f"{tag}/{r}" for r in range(world_size)], dt.timedelta(seconds=timeout_s))


def _held_bytes(device) -> int:
    """GPU memory held by live tensors after garbage collection (0 on CPU)."""
    import torch

    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


_frozen_modules = 0
"""len(sys.modules) when this rank last froze its surviving objects (0: never)."""


def _freeze_survivors() -> None:
    """After a clean-up's collection: freeze what survived it when modules were imported since the
    last freeze (or nothing is frozen), so that later collections skip the modules' objects."""
    global _frozen_modules
    if len(sys.modules) != _frozen_modules or not gc.get_freeze_count():
        gc.freeze()
        _frozen_modules = len(sys.modules)


def _clean_up(before_bytes: int, baseline_groups: int, device) -> tuple[str | None, str | None, int]:
    """Reset what a case may leave behind; return (leak or None, why the pool retires or None,
    bytes held).

    Process groups stay alive for later cases (cpkit.harness.pool_groups); only more of them than
    MAX_KEPT_GROUPS retires the pool."""
    _reset_upstream_state()
    held = _held_bytes(device)
    if held > before_bytes + GPU_LEAK_SLACK_BYTES and gc.get_freeze_count():
        gc.unfreeze()  # garbage among the frozen objects is freed before a leak is named
        held = _held_bytes(device)
    _freeze_survivors()
    leak = None
    if held > before_bytes + GPU_LEAK_SLACK_BYTES:
        leak = (f"{(held - before_bytes) / 2**20:.0f} MiB more GPU memory held after the case than before it on "
                f"{device} (module-level state holding tensors?)")
    kept = len(live_groups()) - baseline_groups
    retire = "leak" if leak else "kept groups" if kept > MAX_KEPT_GROUPS else None
    return leak, retire, held


def _compiled_graphs() -> tuple[int, int]:
    """(graphs torch.compile has compiled in this process so far, of those the ones inductor took
    from the machine's FX graph cache): (0, 0) before dynamo is imported. A case's counts say
    whether its seconds went into compiling, and whether another process on this machine had
    already paid for the kernels (the cache is shared by every process of one user)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if not dynamo_utils:
        return 0, 0
    counters = dynamo_utils.counters
    return int(counters["stats"]["unique_graphs"]), int(counters["inductor"]["fxgraph_cache_hit"])


def _outcome(fn, case, device):
    """('ok', value) | ('failed', traceback) for an AssertionError (a wrong result) |
    ('error', traceback) for any other exception | ('skipped', reason) of fn(case)."""
    import torch

    try:
        value = fn(case)
        if device.type == "cuda":
            # Work still queued (a collective a peer never joined) shows here, not later.
            torch.cuda.synchronize(device)
        return "ok", value
    except BaseException as exc:  # noqa: BLE001 - every outcome goes to the parent
        if type(exc).__name__ == "Skipped":  # pytest.skip() inside the case
            return "skipped", str(getattr(exc, "msg", exc))
        if isinstance(exc, KeyboardInterrupt):
            raise
        return ("failed" if isinstance(exc, AssertionError) else "error"), traceback.format_exc()


def rank_main(rank, world_size, backend, pool_dir, conn, parent_pid, gpu_ids, threads, pg_timeout_s, sync_timeout_s):
    """Entry point of one pool rank (multiprocessing spawn target)."""
    os.setpgid(0, 0)  # the pool kills a rank with its children by process group
    capture_stderr(os.path.join(pool_dir, f"rank{rank}.stderr"))
    os.dup2(2, 1)  # the rank's stdout joins its stderr file: nothing can reach the parent's channel
    die_with_parent(parent_pid)
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu_ids if backend == "nccl" else ""
    # Compile in the rank's own process: inductor's default pool of compile workers (up to one
    # per core, per process) would be multiplied by the tier's 20-odd rank processes.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), BACKEND_ENV: backend})
    with open(os.path.join(pool_dir, f"rank{rank}.stacks"), "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            _serve(rank, world_size, backend, pool_dir, conn, threads, pg_timeout_s, sync_timeout_s)
        except BaseException:  # noqa: BLE001 - start-up failure or a broken channel
            try:
                conn.send(("fatal", traceback.format_exc()))
            except (OSError, EOFError):
                pass
            os._exit(1)
    os._exit(0)


def _serve(rank, world_size, backend, pool_dir, conn, threads, pg_timeout_s, sync_timeout_s):
    import torch
    import torch.distributed as dist

    from cpkit.notices import quiet_known_notices

    quiet_known_notices()
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(pool_dir, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    # On gloo a case's groups time out with the world group (MCore asks for 30 minutes): a fault
    # that leaves ranks in different collectives raises where it stuck, not at the case deadline.
    # NCCL pools keep what was asked for.
    cap = datetime.timedelta(seconds=pg_timeout_s) if backend == "gloo" else None
    reuse = GroupReuse(max_timeout=cap).install()
    baseline_groups = len(live_groups())
    held = _held_bytes(device)
    env, switches = dict(os.environ), _torch_switches()
    conn.send(("ready", os.getpid()))
    while True:
        message = conn.recv()
        if message[0] == "exit":
            # No destroy_process_group: the process ends here and frees every communicator, while
            # NCCL's destroy of kept groups can block on peers that left first (a 2-GPU proof
            # spent 23 s of its budget in pool close before its time limit cut it).
            conn.send(("bye",))
            return
        if message[0] == "drop-groups":  # between grids, on every rank: see GroupReuse.drop_all
            conn.send(("dropped", reuse.drop_all(), group_count()))
            continue
        _, seq, ref, case, test_id = message
        _seed_everything()
        reuse.new_case()
        start, graphs = time.perf_counter(), _compiled_graphs()
        with rank_case_context(test_id):  # the coverage map credits the case to the test that asked
            kind, payload = _outcome(resolve(ref), case, device)
        now = _compiled_graphs()
        took = (time.perf_counter() - start, now[0] - graphs[0], now[1] - graphs[1])
        try:
            conn.send((kind, seq, payload, *took))
        except Exception:  # noqa: BLE001 - an unpicklable return value is the case's error
            conn.send(("error", seq, f"the case's return value cannot be sent: {traceback.format_exc()}", *took))
        _store_sync(store, f"case{seq}", rank, world_size, sync_timeout_s)
        os.environ.clear()
        os.environ.update(env)
        _restore_switches(switches)
        leak, retire, held = _clean_up(held, baseline_groups, device)
        conn.send(("clean", seq, leak, retire, group_count()))
