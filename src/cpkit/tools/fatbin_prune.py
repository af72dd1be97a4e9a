"""Keep only chosen GPU architectures' device code in a shared library's `.nv_fatbin` section.

A CUDA library built for many GPU generations carries, in its `.nv_fatbin` ELF section, one
fatbin per compiled translation unit, and in each fatbin one cubin (or PTX) entry per
architecture. A GPU loads only the entries of its own architecture, so on an H100 or H200
(sm_90) every other entry is dead weight: in Transformer Engine 2.20.2's core library it is
245 of the section's 264 MB, and compression alone does not help (the cubins are already
compressed).

Pruning keeps every fatbin at its offset (the runtime finds each one through a pointer that
the library's `.nvFatBinSegment` holds, so nothing may move), moves the kept entries,
byte for byte, to the front of their fatbin, shrinks the fatbin header's size to them and zeroes
the freed bytes, which xz then compresses to almost nothing.

Format, as read here (little-endian; NVIDIA documents only the wrapper, in CUDA's
`fatbinary_section.h`; the rest is what `cuobjdump` accepts):
- fatbin header, 16 bytes: magic 0xBA55ED50 (u32), version 1 (u16), header size 16 (u16),
  fat size (u64: the bytes of entries after the header);
- entry, back to back after the header: kind (u16, 1 PTX, 2 cubin), version (u16), entry
  header size (u32, 64 or more), payload size (u64, the bytes after the entry header), ...,
  architecture at byte 28 (u32, e.g. 90 for sm_90; sm_90a is 90 as well, with a flag).
- fatbins follow one another in the section; after pruning, zero bytes separate them.

Usage: python -m cpkit.tools.fatbin_prune LIBRARY.so|CORE.whl -o OUT [--arch sm_90,...]
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FATBIN_MAGIC", "FatbinEntry", "Fatbin", "PruneReport", "parse_archs", "elf_section",
           "walk_fatbins", "prune_section", "prune_library_bytes", "main"]

FATBIN_MAGIC = 0xBA55ED50
_FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, fat size
_ENTRY_HEAD = struct.Struct("<HHIQ")  # kind, version, entry header size, payload size
_ENTRY_ARCH_OFFSET = 28
_MIN_ENTRY_HEADER = 64
_NONZERO = re.compile(rb"[^\x00]")
SECTION = ".nv_fatbin"


@dataclass(frozen=True)
class FatbinEntry:
    """One entry of a fatbin: `offset` is from the start of the section."""

    offset: int
    kind: int
    header_size: int
    payload_size: int
    arch: int

    @property
    def size(self) -> int:
        return self.header_size + self.payload_size


@dataclass(frozen=True)
class Fatbin:
    """One fatbin of the section: its index, its offset in the section, its header's size, the
    size of its entries (the header's fat size) and the entries."""

    index: int
    offset: int
    header_size: int
    fat_size: int
    entries: tuple[FatbinEntry, ...]

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.fat_size

    @property
    def archs(self) -> list[int]:
        return sorted({e.arch for e in self.entries})


@dataclass(frozen=True)
class PruneReport:
    """What a prune did: fatbins walked, entries kept and dropped, bytes per architecture before
    (`arch_bytes`), and the bytes of entries kept and zeroed."""

    archs: tuple[int, ...]
    fatbins: int
    entries_kept: int
    entries_dropped: int
    bytes_kept: int
    bytes_zeroed: int
    arch_bytes: dict[int, int]

    def summary(self) -> str:
        per_arch = ", ".join(f"sm_{a} {n / 1e6:.2f} MB" for a, n in sorted(self.arch_bytes.items()))
        return (f"{self.fatbins} fatbins: kept {self.entries_kept} entries ({self.bytes_kept / 1e6:.2f} MB) "
                f"for {', '.join(f'sm_{a}' for a in self.archs)}; zeroed {self.entries_dropped} entries "
                f"({self.bytes_zeroed / 1e6:.2f} MB). Before, per architecture: {per_arch}")


def parse_archs(text: str) -> tuple[int, ...]:
    """`"sm_90,sm_100"` (or `"90,100"`) -> (90, 100). An `a`/`f` suffix is accepted and means
    the same number: a fatbin entry records sm_90a as architecture 90."""
    archs = []
    for token in (t.strip() for t in text.split(",")):
        match = re.fullmatch(r"(?:sm_)?(\d+)[af]?", token)
        if not match:
            raise ValueError(f"--arch {text!r}: {token!r} is not an architecture; write a comma-separated "
                             "list such as sm_90 or sm_90,sm_100")
        archs.append(int(match.group(1)))
    return tuple(sorted(set(archs)))


def elf_section(image: bytes | bytearray, name: str = SECTION) -> tuple[int, int]:
    """(file offset, size) of section `name` in a 64-bit little-endian ELF image. Raises
    ValueError for any other file, and when the section is missing or holds no file bytes."""
    if image[:4] != b"\x7fELF":
        raise ValueError("not an ELF file (no \\x7fELF magic): give a shared library such as libtransformer_engine.so")
    if image[4] != 2 or image[5] != 1:
        raise ValueError(f"ELF class {image[4]}, data encoding {image[5]}: only 64-bit little-endian ELF "
                         "(class 2, encoding 1, as on x86-64 Linux) is supported")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    if shnum == 0 or shstrndx >= shnum or shentsize < 64 or shoff + shnum * shentsize > len(image):
        raise ValueError(f"ELF section header table (offset {shoff}, {shnum} entries of {shentsize} bytes) "
                         f"does not fit the file's {len(image)} bytes or uses extended numbering: cannot read it")

    def header(i: int) -> tuple[int, int, int, int]:
        sh_name, sh_type, _flags, _addr, sh_offset, sh_size = struct.unpack_from("<IIQQQQ", image, shoff + i * shentsize)
        return sh_name, sh_type, sh_offset, sh_size

    _n, _t, strtab, strtab_size = header(shstrndx)
    for i in range(shnum):
        sh_name, sh_type, offset, size = header(i)
        end = image.find(b"\0", strtab + sh_name, strtab + strtab_size)
        if end >= 0 and bytes(image[strtab + sh_name:end]) == name.encode():
            if sh_type == 8:  # SHT_NOBITS: no bytes in the file
                raise ValueError(f"section {name} holds no bytes in the file (SHT_NOBITS)")
            if offset + size > len(image):
                raise ValueError(f"section {name} (offset {offset}, {size} bytes) runs past the end of the "
                                 f"file ({len(image)} bytes): the file is truncated")
            return offset, size
    raise ValueError(f"no {name} section: the library carries no device code to prune")


def walk_fatbins(section: bytes | bytearray) -> list[Fatbin]:
    """Every fatbin of a `.nv_fatbin` section, with its entries. Zero bytes between fatbins (left
    by a prune) are skipped. Raises ValueError naming the offset when the section cannot be
    walked: a wrong magic or version, an entry header too small, or a fatbin or entry that runs
    past its end."""
    fatbins: list[Fatbin] = []
    pos = 0
    while True:
        found = _NONZERO.search(section, pos)
        if found is None:
            return fatbins
        pos = found.start()
        if pos + _FATBIN_HEADER.size > len(section):
            raise ValueError(f"cannot walk {SECTION}: {len(section) - pos} bytes at offset {pos} are too few for "
                             f"a fatbin header ({_FATBIN_HEADER.size}); the section is truncated or not a fatbin section")
        magic, version, header_size, fat_size = _FATBIN_HEADER.unpack_from(section, pos)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"cannot walk {SECTION}: fatbin {len(fatbins)} at offset {pos} has magic "
                             f"{magic:#010x}, expected {FATBIN_MAGIC:#010x}")
        if version != 1 or header_size < _FATBIN_HEADER.size:
            raise ValueError(f"cannot walk {SECTION}: fatbin {len(fatbins)} at offset {pos} has version {version} "
                             f"and header size {header_size}; only version 1 with a header of at least "
                             f"{_FATBIN_HEADER.size} bytes is known")
        end = pos + header_size + fat_size
        if end > len(section):
            raise ValueError(f"cannot walk {SECTION}: fatbin {len(fatbins)} at offset {pos} declares {fat_size} "
                             f"bytes of entries, {end - len(section)} more than the section holds (truncated)")
        fatbins.append(Fatbin(len(fatbins), pos, header_size, fat_size,
                              _walk_entries(section, len(fatbins), pos + header_size, end)))
        pos = end


def _walk_entries(section: bytes | bytearray, index: int, pos: int, end: int) -> tuple[FatbinEntry, ...]:
    entries = []
    while pos < end:
        where = f"fatbin {index}, entry {len(entries)} at offset {pos}"
        if pos + _MIN_ENTRY_HEADER > end:
            raise ValueError(f"cannot walk {SECTION}: {where}: {end - pos} bytes left in the fatbin, fewer than an "
                             f"entry header ({_MIN_ENTRY_HEADER}); the fatbin is truncated")
        kind, _version, header_size, payload_size = _ENTRY_HEAD.unpack_from(section, pos)
        if header_size < _MIN_ENTRY_HEADER:
            raise ValueError(f"cannot walk {SECTION}: {where} has an entry header of {header_size} bytes, "
                             f"fewer than {_MIN_ENTRY_HEADER}")
        if pos + header_size + payload_size > end:
            raise ValueError(f"cannot walk {SECTION}: {where} ({header_size} + {payload_size} bytes) runs "
                             f"{pos + header_size + payload_size - end} bytes past its fatbin's end (truncated)")
        arch, = struct.unpack_from("<I", section, pos + _ENTRY_ARCH_OFFSET)
        entries.append(FatbinEntry(pos, kind, header_size, payload_size, arch))
        pos += header_size + payload_size
    return tuple(entries)


def prune_section(section: bytearray, archs: tuple[int, ...], base_offset: int = 0) -> PruneReport:
    """Keep only the entries of `archs` in every fatbin of `section`, in place: kept entries move
    byte for byte to the front of their fatbin, its fat size shrinks to them, and the rest of the
    fatbin is zeroed; no fatbin moves. Pruning a pruned section again changes nothing.

    Raises ValueError, before changing anything, naming every fatbin that has no entry for
    `archs` (its index, offset in the section and, with `base_offset`, in the file, and the
    architectures it has): the library would then fail to load its kernels on that GPU."""
    if not archs:
        raise ValueError("no architecture asked for: pass at least one, e.g. --arch sm_90")
    fatbins = walk_fatbins(section)
    wanted = set(archs)
    empty = [f for f in fatbins if not any(e.arch in wanted for e in f.entries)]
    if empty:
        names = "; ".join(f"fatbin {f.index} at section offset {f.offset} (file offset {base_offset + f.offset}) "
                          f"has {', '.join(f'sm_{a}' for a in f.archs) or 'no entries'}" for f in empty)
        raise ValueError(f"{len(empty)} of {len(fatbins)} fatbins would keep no entry for "
                         f"{', '.join(f'sm_{a}' for a in archs)}: {names}. Add one of their architectures to "
                         "--arch, or use the library as it is")
    arch_bytes: Counter[int] = Counter()
    kept = dropped = kept_bytes = zeroed = 0
    for fatbin in fatbins:
        body = bytearray()
        for entry in fatbin.entries:
            arch_bytes[entry.arch] += entry.size
            if entry.arch in wanted:
                body += section[entry.offset:entry.offset + entry.size]
                kept += 1
            else:
                dropped += 1
                zeroed += entry.size
        start = fatbin.offset + fatbin.header_size
        section[start:fatbin.end] = bytes(body) + bytes(fatbin.fat_size - len(body))
        struct.pack_into("<Q", section, fatbin.offset + 8, len(body))
        kept_bytes += len(body)
    return PruneReport(tuple(archs), len(fatbins), kept, dropped, kept_bytes, zeroed, dict(arch_bytes))


def prune_library_bytes(image: bytearray, archs: tuple[int, ...]) -> PruneReport:
    """Prune the `.nv_fatbin` section of a 64-bit little-endian ELF image in place (see
    `prune_section`); the file keeps its size and every other byte."""
    offset, size = elf_section(image)
    section = bytearray(image[offset:offset + size])
    report = prune_section(section, archs, base_offset=offset)
    image[offset:offset + size] = section
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cpkit.tools.fatbin_prune", allow_abbrev=False,
        description="Keep only the given GPU architectures' entries in the .nv_fatbin section of a shared "
                    "library, or of every such library in a wheel (the wheel's RECORD is updated).")
    parser.add_argument("input", type=Path, help="a shared library (.so) or a wheel (.whl) holding some")
    parser.add_argument("-o", "--output", type=Path, required=True, help="where to write the pruned file")
    parser.add_argument("--arch", default="sm_90", help="comma-separated architectures to keep (default sm_90)")
    parser.add_argument("--member", action="append", default=None,
                        help="for a wheel: a regular expression for the libraries to prune, by their path in the "
                             "wheel (repeatable; default: TE's libtransformer_engine.so and libnccl_ep.so)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: prune a library or a wheel; prints one summary line per library pruned."""
    args = _parser().parse_args(argv)
    try:
        archs = parse_archs(args.arch)
        if args.input.suffix == ".whl":
            from cpkit.tools.wheel_rewrite import rewrite_members

            patterns = args.member or [r"(.*/)?lib(transformer_engine|nccl_ep)\.so"]
            reports = {}

            def prune(name: str, data: bytes) -> bytes:
                image = bytearray(data)
                reports[name] = prune_library_bytes(image, archs)
                return bytes(image)

            rewrite_members(args.input, args.output, patterns, prune)
        else:
            image = bytearray(args.input.read_bytes())
            reports = {args.input.name: prune_library_bytes(image, archs)}
            args.output.write_bytes(image)
    except (ValueError, OSError) as exc:
        print(f"fatbin_prune: {args.input}: {exc}", file=sys.stderr)
        return 1
    for name, report in reports.items():
        print(f"{name}: {report.summary()}")
    if args.json:
        args.json.write_text(json.dumps({name: {**r.__dict__, "archs": list(r.archs)} for name, r in reports.items()},
                                        indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
