"""Split a batch across CP ranks in the load-balanced layout of MCore and Transformer Engine.

sbhd/bshd: the sequence is cut into 2*cp equal chunks and CP rank r holds chunks r and
2cp-1-r, concatenated in that order (`megatron.core.utils.get_batch_on_this_cp_rank`). With a
causal mask every rank then does the same amount of work.

THD (packed sequences, `cu_seqlens`): the same split applied to every packed sequence on its
own; each sequence length must be a multiple of 2*cp (`pad_cu_seqlens` builds such offsets).
Rank r's tokens are, sequence after sequence, chunk r then chunk 2cp-1-r of that sequence,
exactly TE's `thd_get_partitioned_indices`. Its local `cu_seqlens` are the global ones / cp.

Position ids follow the tokens: `position_ids` (sbhd) and `thd_position_ids` give each local
token its position in its own (global) sequence, as RoPE needs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpkit.errors import CPConfigError

__all__ = [
    "shard_batch",
    "check_seq_divisible",
    "zigzag_indices",
    "position_ids",
    "shard_seq",
    "gather_seq",
    "pad_cu_seqlens",
    "check_cu_seqlens",
    "offsets_to",
    "thd_partition",
    "segments_to_index",
    "thd_local_cu_seqlens",
    "thd_position_ids",
    "shard_thd",
    "gather_thd",
]


def _check_cp(cp_rank: int, cp_size: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise CPConfigError.single("cp_size", cp_size, "must be an int >= 1", "pass the CP group size")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise CPConfigError.single(
            "cp_rank", cp_rank, f"must be an int in [0, cp_size={cp_size})", "pass this rank's CP rank"
        )


def check_seq_divisible(seq_len: int, cp_size: int, field: str = "seq_len") -> None:
    """Raise CPConfigError unless `seq_len` is a multiple of 2*cp_size (2*cp chunks per
    sequence); any length passes for cp_size == 1 (nothing is split)."""
    if cp_size > 1 and seq_len % (2 * cp_size) != 0:
        pad = -seq_len % (2 * cp_size)
        raise CPConfigError.single(
            field,
            seq_len,
            f"the sequence must be divisible by 2*cp = {2 * cp_size} (it is cut into 2*cp chunks)",
            f"pad the sequence by {pad} token(s) to {seq_len + pad}",
        )


def zigzag_indices(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions (int64, [seq_len // cp_size]) of rank `cp_rank`'s tokens in the full sequence.

    Chunk `cp_rank` then chunk `2*cp_size-1-cp_rank` of the 2*cp_size equal chunks (all of
    them for cp_size == 1). Raises CPConfigError when seq_len is not divisible by 2*cp_size.
    """
    _check_cp(cp_rank, cp_size)
    check_seq_divisible(seq_len, cp_size)
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last * chunk, (last + 1) * chunk, device=device)
    return torch.cat([first, second])


def position_ids(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Position ids ([seq_len // cp_size], int64) of this rank's sbhd/bshd shard: its zigzag indices."""
    return zigzag_indices(seq_len, cp_rank, cp_size, device=device)


def shard_seq(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int) -> torch.Tensor:
    """This rank's shard of `x` along `seq_dim` (sbhd: 0, bshd and [b, s] token tensors: 1).

    Returns a new tensor with x.shape[seq_dim] // cp_size entries on `seq_dim`: chunk r then
    chunk 2cp-1-r, identical to MCore's `get_batch_on_this_cp_rank` (which, like this, returns
    x itself for cp_size == 1). Raises CPConfigError when x.shape[seq_dim] is not divisible by
    2*cp_size.
    """
    _check_cp(cp_rank, cp_size)
    if cp_size == 1:
        return x
    seq_dim = seq_dim % x.dim()
    seq_len = x.shape[seq_dim]
    check_seq_divisible(seq_len, cp_size, field=f"x.shape[{seq_dim}]")
    chunk = seq_len // (2 * cp_size)
    # Two slices and one cat: no index tensor, so no host-to-device copy (on a GPU a copy from
    # pageable memory, which also waits for the device) per call.
    return torch.cat([x.narrow(seq_dim, cp_rank * chunk, chunk),
                      x.narrow(seq_dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)], dim=seq_dim)


def gather_seq(shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of `shard_seq`: the full tensor from every rank's shard (`shards[r]` from rank r)."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("gather_seq: shards is empty; pass one shard per CP rank")
    if cp_size == 1:
        return shards[0]
    seq_dim = seq_dim % shards[0].dim()
    local = shards[0].shape[seq_dim]
    if local % 2 != 0 or any(s.shape != shards[0].shape for s in shards):
        raise ValueError(
            f"gather_seq: shards must share one shape with an even length on dim {seq_dim} "
            f"(two chunks each), got {[tuple(s.shape) for s in shards]}"
        )
    halves = [s.chunk(2, dim=seq_dim) for s in shards]
    ordered = [halves[r][0] for r in range(cp_size)] + [halves[r][1] for r in reversed(range(cp_size))]
    return torch.cat(ordered, dim=seq_dim)


# ---------------------------------------------------------------------------------------------
# THD


def pad_cu_seqlens(seq_lens: Sequence[int] | torch.Tensor, cp_size: int) -> torch.Tensor:
    """cu_seqlens (int32, [n + 1]) with every sequence padded up to a multiple of 2*cp_size.

    `seq_lens` are the real lengths; the padding sits at the end of each sequence (as MCore's
    `cu_seqlens_q_padded`). Pass the result to `thd_partition` and as `cu_seqlens` of the attention.
    """
    _check_cp(0, cp_size)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).reshape(-1)
    if (lens < 0).any():
        raise CPConfigError.single("seq_lens", lens.tolist(), "lengths must be >= 0", "pass real lengths")
    mult = 2 * cp_size
    padded = (lens + mult - 1) // mult * mult
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


# Offsets copied to a device by `offsets_to` keep their host values on the tensor: reading them
# back (.tolist()) would wait for every kernel queued before, once per micro-batch in a training
# step, so the host could not queue the next micro-batch while the GPU runs this one.
_HOST_ATTR = "_cpkit_host_offsets"


def offsets_to(cu_seqlens: torch.Tensor, device: Any) -> torch.Tensor:
    """`cu_seqlens` (host offsets) on `device`, carrying their host values, which
    check_cu_seqlens and the attention's offset check then read instead of the device's (no
    device-to-host sync); an in-place change of the device tensor drops them."""
    out = cu_seqlens.to(device)
    if out.device.type != "cpu":
        setattr(out, _HOST_ATTR, (out._version, [int(c) for c in cu_seqlens.tolist()]))
    return out


def _host_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """The offsets as a host list: the values offsets_to kept, else read from the tensor."""
    kept = getattr(cu_seqlens, _HOST_ATTR, None)
    if kept is not None and kept[0] == cu_seqlens._version:
        return list(kept[1])
    return [int(c) for c in cu_seqlens.tolist()]


def check_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> list[int]:
    """Host copy (list) of `cu_seqlens` after checking it is 1-D [n + 1] integer offsets from 0
    whose every sequence length is a non-negative multiple of 2*cp_size (any non-negative
    length for cp_size == 1); CPConfigError otherwise."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise CPConfigError.single(
            "cu_seqlens", tuple(cu_seqlens.shape), "must be 1-D with n + 1 >= 2 offsets",
            "pass cumulative sequence lengths [0, l0, l0 + l1, ...]",
        )
    if cu_seqlens.dtype.is_floating_point:
        raise CPConfigError.single("cu_seqlens.dtype", cu_seqlens.dtype, "must be an integer dtype",
                                   "use torch.int32 offsets")
    cu = _host_offsets(cu_seqlens)
    if cu[0] != 0:
        raise CPConfigError.single("cu_seqlens[0]", cu[0], "must be 0", "start the offsets at 0")
    mult = 2 * cp_size if cp_size > 1 else 1
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length < 0:
            raise CPConfigError.single(
                f"cu_seqlens (sequence {i})", length, f"offsets must not decrease ({cu[i]} -> {cu[i + 1]})",
                "pass cumulative sequence lengths [0, l0, l0 + l1, ...]",
            )
        if length % mult:
            pad = -length % mult
            raise CPConfigError.single(
                f"cu_seqlens (sequence {i})",
                length,
                f"every packed sequence must be padded to a multiple of 2*cp = {mult}",
                f"pad it by {pad} token(s); cpkit.sharding.pad_cu_seqlens(seq_lens, cp_size) "
                "builds padded offsets",
            )
    return cu


def thd_partition(
    cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int, total_tokens: int | None = None
) -> torch.Tensor:
    """Indices (int64, [cu_seqlens[-1] // cp_size]) into the packed token dim held by `cp_rank`.

    `cu_seqlens` are the GLOBAL padded offsets ([n + 1]); for each sequence, in order, the
    indices of its chunk r then its chunk 2cp-1-r (TE's `thd_get_partitioned_indices`).
    `total_tokens`, when given, must be >= cu_seqlens[-1] (trailing tokens are not assigned).
    Raises CPConfigError for a sequence length that is not a multiple of 2*cp_size.
    """
    _check_cp(cp_rank, cp_size)
    cu = check_cu_seqlens(cu_seqlens, cp_size)
    if total_tokens is not None and total_tokens < cu[-1]:
        raise CPConfigError.single("total_tokens", total_tokens, f"must be >= cu_seqlens[-1]={cu[-1]}",
                                   "pass the packed token count")
    device = cu_seqlens.device
    if cp_size == 1:
        return torch.arange(cu[-1], device=device)
    starts = torch.tensor(cu[:-1], dtype=torch.int64, device=device)
    chunk = (torch.tensor(cu[1:], dtype=torch.int64, device=device) - starts) // (2 * cp_size)
    seg_starts = torch.stack([starts + cp_rank * chunk, starts + (2 * cp_size - 1 - cp_rank) * chunk], 1)
    return segments_to_index(seg_starts.reshape(-1), chunk.repeat_interleave(2), cu[-1] // cp_size)


def segments_to_index(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate the index ranges [starts[i], starts[i] + lengths[i]) (int64, [total]).

    `total` must be lengths.sum(); passing it keeps this free of host syncs on GPU.
    """
    starts = starts.to(torch.int64)
    lengths = lengths.to(torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths  # exclusive prefix sum: where each segment starts
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                  output_size=total)
    return starts[seg] + torch.arange(total, device=lengths.device) - offsets[seg]


def thd_local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """This rank's cu_seqlens (same dtype): the global padded offsets divided by cp_size."""
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor")


def thd_position_ids(cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Position of each local THD token within its own sequence (int64, [cu_seqlens[-1] // cp])."""
    index = thd_partition(cu_seqlens, cp_rank, cp_size)
    cu = cu_seqlens.to(torch.int64)
    seq = torch.searchsorted(cu, index, right=True) - 1
    return index - cu[seq]


def shard_thd(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int,
              seq_dim: int = 0) -> torch.Tensor:
    """This rank's THD shard of `x` along its packed token dim (`seq_dim`, 0 for [t, h, d],
    1 for [1, t] token tensors): `x.index_select(seq_dim, thd_partition(...))`."""
    index = thd_partition(cu_seqlens, cp_rank, cp_size, total_tokens=x.shape[seq_dim]).to(x.device)
    return x.index_select(seq_dim, index)


def gather_thd(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
    """Inverse of `shard_thd`: the packed tensor ([cu_seqlens[-1]] on `seq_dim`) from every rank's shard."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("gather_thd: shards is empty; pass one shard per CP rank")
    seq_dim = seq_dim % shards[0].dim()
    total = int(cu_seqlens[-1])
    shape = list(shards[0].shape)
    shape[seq_dim] = total
    out = shards[0].new_empty(shape)
    for r, shard in enumerate(shards):
        index = thd_partition(cu_seqlens, r, cp_size).to(shard.device)
        if shard.shape[seq_dim] != index.numel():
            raise ValueError(
                f"gather_thd: shard {r} has {shard.shape[seq_dim]} tokens on dim {seq_dim}, "
                f"expected cu_seqlens[-1] / cp = {index.numel()}"
            )
        out.index_copy_(seq_dim, index, shard)
    return out


def shard_batch(batch: dict, cp_group: Any) -> dict:
    """This CP rank's part of a full batch (each tensor [b, s, ...], sequence dim 1), in the
    load-balanced zigzag layout of shard_seq; a copy of the dict at CP size 1 (None group)."""
    cp = 1 if cp_group is None else cp_group.size()
    if cp == 1:
        return dict(batch)
    rank = cp_group.rank()
    return {k: shard_seq(v, rank, cp, seq_dim=1) for k, v in batch.items()}
